"""claw_pipelines.ops: claw check and claw repair."""
