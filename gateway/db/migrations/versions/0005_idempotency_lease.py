"""Idempotency leases: an in-flight key's lease, and the charge its stream
has delivered so far, so that a retry can take over the key of a gateway that died and
bill the cut attempt.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# NOTE: the hour after which a key left in flight was given up before leases existed.
LEGACY_LEASE_S = 3600


def upgrade() -> None:
    op.add_column("idempotency_keys", sa.Column("lease_until_s", sa.BigInteger(), nullable=True))
    op.add_column("idempotency_keys", sa.Column("progress", sa.Text(), nullable=True))
    # NOTE: a key in flight now belongs to a gateway of the previous version, which does
    # not renew leases: it keeps the hour that version gave it, no more and no less.
    op.execute(
        sa.text(
            "UPDATE idempotency_keys SET lease_until_s = created_s + :legacy WHERE status IS NULL"
        ).bindparams(legacy=LEGACY_LEASE_S)
    )


def downgrade() -> None:
    # NOTE: plain DROP COLUMN (SQLite >= 3.35, PostgreSQL), as in 0003 and 0004.
    op.drop_column("idempotency_keys", "progress")
    op.drop_column("idempotency_keys", "lease_until_s")
