"""Cache diagnostics: what the server knows beyond a miss's reason (the tier an evicted
entry was last in, the replica an entry routed elsewhere lives on).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("usage", sa.Column("miss_detail", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("usage", "miss_detail")
