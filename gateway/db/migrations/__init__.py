"""Alembic migrations for the billing database."""
