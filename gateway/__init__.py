"""The Claw gateway: durable ingestion and an OpenAI-compatible proxy (FastAPI)."""
