"""Silver, gold, the lake, live materialization, consumption, integrity."""
