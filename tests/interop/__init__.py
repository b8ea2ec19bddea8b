"""claw_pipelines.interop: chat logs in, SFT and preference exports out, in the model's own ids."""
