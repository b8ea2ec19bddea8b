"""Data in and out in other systems' shapes.

- `export`: `claw export`: a gold partition as verl-style Parquet or JSON lines, SFT
  messages or preference pairs;
- `chat_logs`: `claw import`: trajectories logged elsewhere, as OpenAI-style chat logs with
  token ids, into bronze with their provenance.
"""
