"""Idempotency keys: one row per (api key, idempotency-key), the first outcome kept 24 h.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "idempotency_keys",
        sa.Column("api_key_id", sa.String(40), primary_key=True),
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("org_id", sa.String(40), nullable=False),
        sa.Column("body_sha256", sa.String(64), nullable=False),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("headers", sa.Text(), nullable=False),
        sa.Column("response", sa.LargeBinary(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_s", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_idempotency_created", "idempotency_keys", ["created_s"])


def downgrade() -> None:
    op.drop_index("ix_idempotency_created", table_name="idempotency_keys")
    op.drop_table("idempotency_keys")
