"""Alembic environment: runs on the connection handed in by `migrate.upgrade`."""

from __future__ import annotations

from alembic import context

from cachepoint.gateway.db.models import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
