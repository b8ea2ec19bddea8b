"""The gateway: ingestion, validation, the WAL, crash safety, security, the route table."""
