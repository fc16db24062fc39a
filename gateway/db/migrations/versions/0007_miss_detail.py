"""Each usage row's API (messages, chat.completions, completions) and OpenAI's
prompt_cache_key; and cache diagnostics' miss_detail (the tier an evicted entry was last
in, the replica an entry routed elsewhere lives on).

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
    op.add_column(
        "usage",
        sa.Column("api", sa.String(24), nullable=False, server_default="messages"),
    )
    op.add_column("usage", sa.Column("prompt_cache_key", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("usage", "prompt_cache_key")
    op.drop_column("usage", "api")
    op.drop_column("usage", "miss_detail")
