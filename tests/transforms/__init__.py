"""claw_pipelines.transforms: the pure frame functions on crafted frames."""
