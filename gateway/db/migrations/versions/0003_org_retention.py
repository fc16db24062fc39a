"""Per-org retention quota: the share of each replica's retained blocks an org may hold.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NOTE: nullable, no default: NULL means "the replica's org_retained_share", so
    # existing orgs follow the fleet default until an operator sets one.
    op.add_column("orgs", sa.Column("retained_share", sa.Float(), nullable=True))


def downgrade() -> None:
    # NOTE: a plain DROP COLUMN (SQLite >= 3.35, PostgreSQL), never a batch table copy:
    # with foreign keys on, dropping and recreating orgs would cascade to its keys.
    op.drop_column("orgs", "retained_share")
