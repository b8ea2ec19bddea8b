"""Simulated model and agents for demos and tests (honest test doubles).

- `llm`, `protocol`, `sampling`, `serving`: the simulated OpenAI-compatible model
  (`claw sim-llm`);
- `agents`: white-box math solvers, black-box tool agents, a feedback service;
- `word_task`: the learning loop's toy verifiable task and its agents (`claw demo --learn`);
- `model_folders`: Hugging Face tokenizer and tiny Qwen2 folders built locally (the real-
  server tests' model, the learning loop's first policy);
- `bulk`: large lakes written column-wise (benchmarks).
"""
