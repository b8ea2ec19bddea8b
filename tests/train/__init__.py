"""claw_pipelines.train: tree attention and the adapters, checked against flat training."""
