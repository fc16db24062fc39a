"""Tables. Money is integer micro-dollars; time is UTC plus epoch seconds for bucketing."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class Org(Base):
    __tablename__ = "orgs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    allow_global_scope: Mapped[bool] = mapped_column(Boolean, default=False)
    # Newline-separated prefix digests global scope may cover; empty = any.
    global_allowlist: Mapped[str] = mapped_column(Text, default="")
    # Share of each replica's retained blocks the org may hold; None = the replica default.
    retained_share: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Workspace(Base):
    __tablename__ = "workspaces"
    __table_args__ = (UniqueConstraint("org_id", "name"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    org_id: Mapped[str] = mapped_column(ForeignKey("orgs.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


# How a raw API key starts, by kind. NOTE: here beside the table, below both the
# tenancy code that mints keys and the admin schemas that show a key's hint.
KEY_PREFIX = "sk-cp-"
ADMIN_KEY_PREFIX = "sk-cp-admin-"


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    org_id: Mapped[str] = mapped_column(ForeignKey("orgs.id", ondelete="CASCADE"), index=True)
    workspace_id: Mapped[str | None] = mapped_column(
        ForeignKey("workspaces.id", ondelete="SET NULL"), nullable=True
    )
    name: Mapped[str] = mapped_column(String(128), default="")
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex; never the key
    hint: Mapped[str] = mapped_column(String(16))  # last characters, to recognise a key
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class ModelPrice(Base):
    __tablename__ = "prices"

    model: Mapped[str] = mapped_column(String(256), primary_key=True)
    input_per_mtok: Mapped[int] = mapped_column(BigInteger)  # micro-dollars per 1M tokens
    output_per_mtok: Mapped[int] = mapped_column(BigInteger)
    write_5m_mult: Mapped[str] = mapped_column(String(16), default="1.25")  # exact decimals
    write_1h_mult: Mapped[str] = mapped_column(String(16), default="2")
    read_mult: Mapped[str] = mapped_column(String(16), default="0.1")


class UsageRecord(Base):
    """One row per billed request; the request id makes a retry unable to bill twice."""

    __tablename__ = "usage"
    __table_args__ = (
        Index("ix_usage_org_time", "org_id", "created_s"),
        # NOTE: "what did this session cost" is the first question a platform team asks.
        Index("ix_usage_org_session", "org_id", "session_id"),
    )

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(40))
    workspace_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    api_key_id: Mapped[str] = mapped_column(String(40))
    model: Mapped[str] = mapped_column(String(256))
    replica: Mapped[str] = mapped_column(String(128), default="")
    scope: Mapped[str] = mapped_column(String(8), default="org")
    input_tokens: Mapped[int] = mapped_column(Integer)
    cache_read_input_tokens: Mapped[int] = mapped_column(Integer)
    cache_write_5m_tokens: Mapped[int] = mapped_column(Integer)
    cache_write_1h_tokens: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(Integer)
    cost_micros: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    created_s: Mapped[int] = mapped_column(BigInteger)  # epoch seconds: portable bucketing
    # The client's name for the model when an alias resolved it (``model`` is served).
    requested_model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    # The X-Claude-Code-Session-Id header, when sent and well formed.
    session_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # metadata.user_id as the client sent it (Claude Code: a JSON string), capped.
    user_id: Mapped[str | None] = mapped_column(String(512), nullable=True)
    # Cache diagnostics against the turn before (gateway/diagnostics.py): the reason
    # type ("none": only appended; NULL: not compared) and the tokens it cost.
    miss_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    miss_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # what only the server knows of it: "tier host" (evicted), "entry on r0" (routed)
    miss_detail: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # the API the request came to: messages, chat.completions or completions
    api: Mapped[str] = mapped_column(String(24), nullable=False, server_default="messages")
    prompt_cache_key: Mapped[str | None] = mapped_column(String(64), nullable=True)  # OpenAI's


class ModelAlias(Base):
    """A client-facing model name (or ``prefix*`` / ``*`` pattern) -> a served model id.
    Overrides the gateway's ``model_aliases`` setting for the same name."""

    __tablename__ = "model_aliases"

    alias: Mapped[str] = mapped_column(String(256), primary_key=True)
    model: Mapped[str] = mapped_column(String(256))  # the served model id it resolves to
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class IdempotencyRecord(Base):
    """A client's `idempotency-key` on POST /v1/messages: the first request's outcome,
    replayed to any retry with the same key and body for 24 h (expired rows are purged
    lazily). ``status`` None means the first request is still in flight: its gateway
    renews ``lease_until_s`` while it works, and a retry takes over a key whose lease
    lapsed (its gateway died), billing the cut attempt from ``progress``."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (Index("ix_idempotency_created", "created_s"),)

    api_key_id: Mapped[str] = mapped_column(String(40), primary_key=True)  # the key's scope
    key: Mapped[str] = mapped_column(String(255), primary_key=True)  # the client's header
    org_id: Mapped[str] = mapped_column(String(40))
    body_sha256: Mapped[str] = mapped_column(String(64))  # of the canonical request
    request_id: Mapped[str] = mapped_column(String(64))  # the request that owns the key
    status: Mapped[int | None] = mapped_column(Integer, nullable=True)  # None: in flight
    kind: Mapped[str] = mapped_column(String(8), default="json")  # json | sse
    headers: Mapped[str] = mapped_column(Text, default="{}")  # JSON object to replay
    response: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    created_s: Mapped[int] = mapped_column(BigInteger)  # epoch seconds: expiry and purge
    # Epoch seconds the owner's claim holds to while in flight; None: a row written by a
    # gateway without leases (before 0005), which lapses an hour after ``created_s``.
    lease_until_s: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # A keyed stream's charge so far (ledger.charge_to_json: input buckets, output tokens
    # delivered), written at a bounded rate; None before its prefill and for JSON calls.
    progress: Mapped[str | None] = mapped_column(Text, nullable=True)


class PromptFingerprint(Base):
    """One opted-in request's prompt fingerprint (gateway/contract/fingerprint.py): hashes
    and token positions, never text, kept `diagnostics_retention_s` for the next turn's
    `diagnostics.previous_message_id` to name."""

    __tablename__ = "prompt_fingerprints"
    __table_args__ = (
        Index("ix_prompt_fingerprints_created", "created_s"),
        Index("ix_prompt_fingerprints_session", "org_id", "session_id", "created_s"),
        Index("ix_prompt_fingerprints_key", "org_id", "api_key_id", "created_s"),
    )

    message_id: Mapped[str] = mapped_column(String(64), primary_key=True)  # msg_...
    org_id: Mapped[str] = mapped_column(String(40))
    workspace_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    session_id: Mapped[str | None] = mapped_column(String(128), nullable=True)  # its session
    api_key_id: Mapped[str | None] = mapped_column(String(40), nullable=True)  # the key it used
    created_s: Mapped[int] = mapped_column(BigInteger)  # epoch seconds
    data: Mapped[bytes] = mapped_column(LargeBinary)  # Fingerprint.encode()
