"""One settings object for the gateway: flags, environment (CACHEPOINT_GATEWAY_*), defaults."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from cachepoint.routing import DEFAULT_POLICY

DEFAULT_DB = "sqlite:///.cachepoint/cachepoint.db"

# Betas this gateway understands; any other value in `anthropic-beta` is a 400.
KNOWN_BETAS = [
    "prompt-caching-2024-07-31",
    "prompt-caching-scope-2026-01-05",
    "extended-cache-ttl-2025-04-11",
    "token-counting-2024-11-01",
    "messages-2023-12-15",
    "tools-2024-04-04",
    "tools-2024-05-16",
    "token-efficient-tools-2025-02-19",
    "interleaved-thinking-2025-05-14",
    "context-1m-2025-08-07",
    "fine-grained-tool-streaming-2025-05-14",
]


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CACHEPOINT_GATEWAY_", extra="forbid", populate_by_name=True
    )

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8080, ge=0, le=65535, description="HTTP port")
    database_url: str = Field(DEFAULT_DB, description="SQLAlchemy URL of the billing database")
    replica_urls: list[str] = Field(
        default_factory=list,
        description="replicas to poll for load before (or without) heartbeats",
    )
    nats_url: str | None = Field(
        None,
        validation_alias=AliasChoices(
            "nats_url", "CACHEPOINT_GATEWAY_NATS_URL", "CACHEPOINT_NATS_URL"
        ),
        description="NATS for kv events and heartbeats; None = load-only routing",
    )
    routing_policy: str = Field(DEFAULT_POLICY, description="cache_aware | least_loaded | ...")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="the replicas' heartbeat period")
    models: list[str] = Field(
        default_factory=lambda: ["cachepoint-tiny"], description="model ids served"
    )
    model_dir: Path | None = Field(None, description="tokenizer folder; None = byte tokenizer")
    block_size: int = Field(16, ge=1, description="the replicas' KV block size")
    max_context_tokens: int = Field(8192, ge=16, description="prompt + max_tokens limit")
    min_cacheable_tokens: int = Field(1024, ge=0, description="shorter prefixes are not cached")
    tenant_scope: str = Field("org", pattern="^(org|workspace)$", description="cache tenant key")
    known_betas: list[str] = Field(default_factory=lambda: list(KNOWN_BETAS))
    cache_key_betas: list[str] = Field(
        default_factory=lambda: ["context-1m-2025-08-07", "interleaved-thinking-2025-05-14"],
        description="betas that change the KV or the cache key",
    )
    default_input_per_mtok: int = Field(3_000_000, ge=0, description="µ$ / MTok w/o price row")
    default_output_per_mtok: int = Field(15_000_000, ge=0, description="µ$ / MTok w/o price row")
    max_body_bytes: int = Field(32 * 2**20, ge=1024, description="larger bodies get 413")
    auth_cache_seconds: float = Field(5.0, ge=0, description="how long a key lookup is reused")
    upstream_timeout_s: float = Field(600.0, gt=0, description="replica call timeout")
