"""Simulated model and agents for demos and tests (honest test doubles)."""
