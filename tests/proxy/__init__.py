"""The OpenAI-compatible proxy and the simulated model it is tested against."""
