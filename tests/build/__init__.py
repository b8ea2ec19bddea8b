"""claw_pipelines.build: silver, gold, increments, the live materializer, re-scoring, and
writers racing."""
