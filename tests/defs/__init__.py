"""claw_pipelines.defs: the Dagster asset graph."""
