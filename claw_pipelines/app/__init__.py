"""The launcher: the `claw` CLI and what it starts (gateway, dashboard, Dagster, the live
materializer, the demo and its learning loop: `learn.py`, `claw demo --learn`). The only part
of claw_pipelines that imports gateway and dashboards."""
