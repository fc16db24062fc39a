"""The replica's internal HTTP API (FastAPI)."""
