"""Initial schema: orgs, workspaces, api keys, prices, usage ledger.

Revision ID: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "orgs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("allow_global_scope", sa.Boolean(), nullable=False),
        sa.Column("global_allowlist", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "workspaces",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column(
            "org_id",
            sa.String(40),
            sa.ForeignKey("orgs.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("org_id", "name"),
    )
    op.create_index("ix_workspaces_org_id", "workspaces", ["org_id"])
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column(
            "org_id",
            sa.String(40),
            sa.ForeignKey("orgs.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column(
            "workspace_id",
            sa.String(40),
            sa.ForeignKey("workspaces.id", ondelete="SET NULL"),
            nullable=True,
        ),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("hint", sa.String(16), nullable=False),
        sa.Column("is_admin", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_api_keys_org_id", "api_keys", ["org_id"])
    op.create_table(
        "prices",
        sa.Column("model", sa.String(256), primary_key=True),
        sa.Column("input_per_mtok", sa.BigInteger(), nullable=False),
        sa.Column("output_per_mtok", sa.BigInteger(), nullable=False),
        sa.Column("write_5m_mult", sa.String(16), nullable=False),
        sa.Column("write_1h_mult", sa.String(16), nullable=False),
        sa.Column("read_mult", sa.String(16), nullable=False),
    )
    op.create_table(
        "usage",
        sa.Column("request_id", sa.String(64), primary_key=True),
        sa.Column("org_id", sa.String(40), nullable=False),
        sa.Column("workspace_id", sa.String(40), nullable=True),
        sa.Column("api_key_id", sa.String(40), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("replica", sa.String(128), nullable=False),
        sa.Column("scope", sa.String(8), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("cache_read_input_tokens", sa.Integer(), nullable=False),
        sa.Column("cache_write_5m_tokens", sa.Integer(), nullable=False),
        sa.Column("cache_write_1h_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("cost_micros", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_s", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_usage_org_time", "usage", ["org_id", "created_s"])


def downgrade() -> None:
    for table in ("usage", "prices", "api_keys", "workspaces", "orgs"):
        op.drop_table(table)
