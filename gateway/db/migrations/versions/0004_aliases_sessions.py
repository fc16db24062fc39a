"""Model aliases, and the session and user a usage row belongs to.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_aliases",
        sa.Column("alias", sa.String(256), primary_key=True),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    # NOTE: nullable, no default: rows billed before this revision have no session, user
    # or alias, and reports show them under None rather than under a made-up value.
    op.add_column("usage", sa.Column("requested_model", sa.String(256), nullable=True))
    op.add_column("usage", sa.Column("session_id", sa.String(128), nullable=True))
    op.add_column("usage", sa.Column("user_id", sa.String(512), nullable=True))
    op.create_index("ix_usage_org_session", "usage", ["org_id", "session_id"])


def downgrade() -> None:
    # NOTE: plain DROP COLUMN (SQLite >= 3.35, PostgreSQL), as in 0003: no batch copy.
    op.drop_index("ix_usage_org_session", table_name="usage")
    op.drop_column("usage", "user_id")
    op.drop_column("usage", "session_id")
    op.drop_column("usage", "requested_model")
    op.drop_table("model_aliases")
