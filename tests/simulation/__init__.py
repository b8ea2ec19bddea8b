"""claw_pipelines.simulation: the simulated model, served for real."""
