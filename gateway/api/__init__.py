"""The gateway's public HTTP API (FastAPI)."""
