"""One settings object for the gateway: flags, environment (CACHEPOINT_GATEWAY_*), defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cachepoint.events.subjects import check_replica_name
from cachepoint.gateway.tenancy.aliases import check_alias, check_target
from cachepoint.routing import DEFAULT_POLICY
from cachepoint.runtime.serve import shared_env

DEFAULT_DB = "sqlite:///.cachepoint/cachepoint.db"

# Betas this gateway understands. Others are accepted and named in the
# cachepoint-ignored-betas response header, or a 400 with `strict_betas`.
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
    # Cache diagnostics (gateway/diagnostics.py): GA, the header optional, as on Anthropic.
    "cache-diagnosis-2026-04-07",
]

# NOTE: beta families Anthropic defines that change nothing on this gateway: Claude Code
# and the SDKs send them on every request. FAMILY-DATE of any date is accepted
# and not reported; the date is required so that `prompt-caching` does not swallow the
# scope beta (`prompt-caching-scope-…`), whose meaning stays with `known_betas`.
NOOP_BETA_FAMILIES = [
    "claude-code",
    "context-management",
    "thinking-token-count",
    "advanced-tool-use",
    "tool-search-tool",
    "interleaved-thinking",
    "effort",
    "fine-grained-tool-streaming",
    "token-efficient-tools",
    "prompt-caching",
    "extended-cache-ttl",
    "token-counting",
    "output-128k",
    "messages",
    "tools",
    # Claude Code 2.1.328 (captured): system turns among the messages (rendered in
    # place), and per-turn output_config on them (effort: a no-op here).
    "mid-conversation-tool-changes",
    "per-turn-control",
]


class ProfileSettings(BaseModel):
    """One model's own settings (``model_profiles``); None = the gateway-wide one."""

    model_config = ConfigDict(extra="forbid")

    context_window: int | None = Field(
        None, ge=16, description="prompt + max_tokens limit; default max_context_tokens"
    )
    min_cacheable_tokens: int | None = Field(
        None, ge=0, description="shorter prefixes are not cached; default min_cacheable_tokens"
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        max_length=16,
        description="ids that end the turn besides the checkpoint's EOS ids (sent to replicas)",
    )


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
        validation_alias=shared_env("nats_url", "GATEWAY"),
        description="NATS for kv events and heartbeats; None = load-only routing",
    )
    nats_user: str | None = Field(
        None,
        validation_alias=shared_env("nats_user", "GATEWAY"),
        description="NATS user ('gateway' in generated configs); None = connect without auth",
    )
    nats_password: SecretStr | None = Field(
        None,
        validation_alias=shared_env("nats_password", "GATEWAY"),
        description="NATS password for nats_user",
    )
    replicas: dict[str, str] = Field(
        default_factory=dict,
        description="replica name -> base URL: the only URL each may announce (exact check)",
    )
    replica_url_check: Literal["auto", "exact", "k8s-dns", "off"] = Field(
        "auto",
        description=(
            "which URL a replica may announce: exact (the `replicas` map), k8s-dns "
            "(http(s)://POD.SERVICE.NAMESPACE.svc[.cluster.local][:PORT] for name "
            "NAMESPACE_POD, or the map), off (any); auto = exact if `replicas` is set, else off"
        ),
    )
    max_epoch_skew_s: float = Field(
        60.0, ge=0, description="epochs (replica start times) further in the future are refused"
    )
    health_interval_s: float = Field(
        2.0, ge=0, description="seconds between /readyz polls of each replica; 0 = no polls"
    )

    @model_validator(mode="after")
    def _event_plane(self) -> GatewaySettings:
        if (self.nats_user is None) != (self.nats_password is None):
            raise ValueError("nats_user and nats_password go together: set both or neither")
        for name, url in self.replicas.items():
            check_replica_name(name)
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica {name}: {url!r} is not an http(s) URL")
        if self.replica_url_check == "exact" and not self.replicas:
            raise ValueError("replica_url_check=exact needs the replicas name -> URL map")
        return self

    @property
    def url_check(self) -> str:
        """The URL rule in force: `auto` resolved."""
        if self.replica_url_check == "auto":
            return "exact" if self.replicas else "off"
        return self.replica_url_check

    routing_policy: str = Field(DEFAULT_POLICY, description="cache_aware | least_loaded | ...")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="the replicas' heartbeat period")
    internal_token: SecretStr | None = Field(
        None,
        validation_alias=shared_env("internal_token", "GATEWAY"),
        description="bearer token sent on every call to a replica; None = none sent",
    )
    models: list[str] = Field(
        default_factory=lambda: ["cachepoint-tiny"], description="model ids served"
    )
    model_dir: Path | None = Field(
        None,
        description="checkpoint (HF folder or .gguf): tokenizer, chat template; None = bytes",
    )
    block_size: int = Field(16, ge=1, description="the replicas' KV block size")
    max_context_tokens: int = Field(8192, ge=16, description="prompt + max_tokens limit")
    min_cacheable_tokens: int = Field(1024, ge=0, description="shorter prefixes are not cached")
    model_profiles: dict[str, ProfileSettings] = Field(
        default_factory=dict,
        description=(
            "model id -> its own context_window, min_cacheable_tokens, stop_token_ids "
            "(JSON in CACHEPOINT_GATEWAY_MODEL_PROFILES); each must name a served model"
        ),
    )

    model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "client model name -> served model id, so clients that send their own names "
            "(Claude Code: claude-sonnet-4-5) work unchanged; a name may end in one '*' "
            "(prefix), '*' alone is the default; exact beats longest prefix beats '*'. "
            "JSON in CACHEPOINT_GATEWAY_MODEL_ALIASES; `cachepoint-admin models alias` "
            "entries override it"
        ),
    )

    @model_validator(mode="after")
    def _aliases(self) -> GatewaySettings:
        for name, target in self.model_aliases.items():
            check_alias(name)
            check_target(target)
        return self

    @model_validator(mode="after")
    def _profiles(self) -> GatewaySettings:
        unknown = sorted(set(self.model_profiles) - set(self.models))
        if unknown:
            raise ValueError(
                f"model_profiles names {', '.join(map(repr, unknown))}, not served here "
                f"(models: {', '.join(self.models)}); add it with --model or drop its profile"
            )
        return self

    tenant_scope: str = Field("org", pattern="^(org|workspace)$", description="cache tenant key")
    known_betas: list[str] = Field(default_factory=lambda: list(KNOWN_BETAS))
    noop_beta_families: list[str] = Field(
        default_factory=lambda: list(NOOP_BETA_FAMILIES),
        description="betas FAMILY-YYYY-MM-DD (or YYYYMMDD) accepted as no-ops, not reported",
    )
    strict_betas: bool = Field(
        False,
        description=(
            "400 on a beta neither known nor in a no-op family; off = accept it and "
            "name it in the cachepoint-ignored-betas response header"
        ),
    )
    clamp_max_tokens: bool = Field(
        False,
        description=(
            "lower max_tokens to the room the context window leaves instead of a 400; "
            "a prompt that fills the window alone is still a 400"
        ),
    )
    cache_key_betas: list[str] = Field(
        default_factory=lambda: ["context-1m-2025-08-07", "interleaved-thinking-2025-05-14"],
        description="betas that change the KV or the cache key",
    )
    openai_min_cached_tokens: int = Field(
        1024,
        ge=1,
        description=(
            "OpenAI-compatible endpoints: a prompt this long or longer has what the engine "
            "reused of it reported as cached_tokens and billed at the cached-input price "
            "(OpenAI's automatic caching); a shorter one is billed all as input"
        ),
    )
    diagnostics_retention_s: int = Field(
        7200,
        ge=60,
        description=(
            "seconds a prompt fingerprint (cache diagnostics) is kept for a later turn to "
            "name; longer than the 1h TTL, so a turn after an expiry is still diagnosed"
        ),
    )
    default_input_per_mtok: int = Field(3_000_000, ge=0, description="µ$ / MTok w/o price row")
    default_output_per_mtok: int = Field(15_000_000, ge=0, description="µ$ / MTok w/o price row")
    max_body_bytes: int = Field(
        32 * 2**20, ge=1024, description="larger bodies get 413, chunked ones while read"
    )
    body_read_timeout_s: float = Field(
        30.0, gt=0, description="a request body not fully read by then gets 408"
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="port of the private /metrics listener; 0 = any free port, None = off",
    )
    # NOTE: per gateway process, in requests or input tokens per minute; 0 = no limit.
    # The org defaults are far above what one CPU stack serves, so the embedded stack
    # and the tests are never throttled; an operator sets real ones.
    org_requests_per_minute: int = Field(6_000, ge=0, description="per org; 0 = no limit")
    org_input_tokens_per_minute: int = Field(
        10_000_000, ge=0, description="input + cache-write tokens per org; 0 = no limit"
    )
    key_requests_per_minute: int = Field(0, ge=0, description="per API key; 0 = no limit")
    key_input_tokens_per_minute: int = Field(0, ge=0, description="per API key; 0 = no limit")
    auth_cache_seconds: float = Field(5.0, ge=0, description="how long a key lookup is reused")
    upstream_timeout_s: float = Field(600.0, gt=0, description="replica call timeout")
    idempotency_lease_s: float = Field(
        15.0,
        ge=1,
        le=3600,
        description=(
            "lease of an idempotency key in flight, renewed every third of it while its "
            "request runs; a retry takes over a key whose lease lapsed (its gateway died)"
        ),
    )
    api_docs: bool = Field(
        False, description="serve /docs, /redoc and /openapi.json; off = they are 404s"
    )
    sse_ping_interval_s: float = Field(
        10.0,
        ge=0,
        description="a stream sends an SSE ping after this long without an event; 0 = none",
    )
    # Request intake: heavy work off the event loop, shared fairly between orgs.
    intake_workers: int = Field(
        4, ge=1, le=256, description="threads that parse, render and tokenize request bodies"
    )
    intake_org_share: int = Field(
        2, ge=1, description="intake threads one org may use at once (keep below intake_workers)"
    )
    intake_org_bytes: int = Field(
        64 * 2**20,
        ge=1024,
        description=(
            "body bytes one org's requests in intake may declare at once (its first is "
            "always let in; a body without content-length counts as max_body_bytes); "
            "beyond, a 429 before the body is read"
        ),
    )
    intake_inline_bytes: int = Field(
        8192,
        ge=0,
        le=65536,
        description=(
            "a body of at most this many bytes is parsed and prepared on the event loop, "
            "not in an intake thread: its work is shorter than the thread switch; 0 = never"
        ),
    )
    max_json_depth: int = Field(
        64, ge=8, le=512, description="nesting of objects and arrays in a body (the body is 1)"
    )
    max_messages: int = Field(20_000, ge=1, description="entries in `messages`")
    max_content_blocks: int = Field(
        20_000, ge=1, description="content blocks in a body: system, messages, tool results"
    )
    max_tools: int = Field(10_000, ge=1, description="entries in `tools`")
    org_count_tokens_per_minute: int = Field(
        6_000, ge=0, description="count_tokens requests per org, its own budget; 0 = no limit"
    )

    @model_validator(mode="after")
    def _intake(self) -> GatewaySettings:
        if self.intake_workers > 1 and self.intake_org_share >= self.intake_workers:
            raise ValueError(
                f"intake_org_share {self.intake_org_share} must be below intake_workers "
                f"{self.intake_workers}: one org could take every intake thread"
            )
        return self
