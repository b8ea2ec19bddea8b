"""claw_pipelines.lake: Delta tables on a path and on object stores, other engines reading them,
policy versions."""
