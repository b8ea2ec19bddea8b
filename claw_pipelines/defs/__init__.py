"""Dagster definitions (assets, checks, sensors, schedules, resources), loaded only by
`claw_pipelines.definitions`. Asset bodies stay thin: read, call a transform, write."""
