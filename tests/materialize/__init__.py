"""claw_pipelines.materialize: silver, gold, increments, the live materializer, re-scoring, and
writers racing."""
