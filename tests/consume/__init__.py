"""claw_pipelines.consume: the consumption API on real gold datasets, the contract report."""
