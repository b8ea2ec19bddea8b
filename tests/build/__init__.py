"""claw_pipelines.build: silver, gold, increments, the live materializer, re-scoring, writers racing."""
