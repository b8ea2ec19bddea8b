"""claw_pipelines.tokenization: a model's own tokenizer folder, as transformers loads it."""
