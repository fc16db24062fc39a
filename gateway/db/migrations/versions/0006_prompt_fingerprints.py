"""Cache diagnostics: prompt fingerprints (one row per opted-in or session request,
hashes only), and each usage row's miss reason against the turn before.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "prompt_fingerprints",
        sa.Column("message_id", sa.String(64), primary_key=True),
        sa.Column("org_id", sa.String(40), nullable=False),
        sa.Column("workspace_id", sa.String(40), nullable=True),
        sa.Column("session_id", sa.String(128), nullable=True),
        sa.Column("api_key_id", sa.String(40), nullable=True),
        sa.Column("created_s", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
    )
    op.create_index("ix_prompt_fingerprints_created", "prompt_fingerprints", ["created_s"])
    op.create_index(
        "ix_prompt_fingerprints_session",
        "prompt_fingerprints",
        ["org_id", "session_id", "created_s"],
    )
    op.create_index(
        "ix_prompt_fingerprints_key",
        "prompt_fingerprints",
        ["org_id", "api_key_id", "created_s"],
    )
    op.add_column("usage", sa.Column("miss_reason", sa.String(32), nullable=True))
    op.add_column("usage", sa.Column("miss_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    # NOTE: plain DROP COLUMN (SQLite >= 3.35, PostgreSQL), as in 0003 to 0005.
    op.drop_column("usage", "miss_tokens")
    op.drop_column("usage", "miss_reason")
    op.drop_index("ix_prompt_fingerprints_key", table_name="prompt_fingerprints")
    op.drop_index("ix_prompt_fingerprints_session", table_name="prompt_fingerprints")
    op.drop_index("ix_prompt_fingerprints_created", table_name="prompt_fingerprints")
    op.drop_table("prompt_fingerprints")
