"""The tokenizer bundled for the simulated model and the tests (`tokenizer.json`), and how
it was trained (`train`)."""
