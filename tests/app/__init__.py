"""claw_pipelines.app: the launcher's own runs (`claw demo --learn`)."""
