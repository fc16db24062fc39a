"""What the app holds for its lifetime: database, renderer, router, auth cache, prices."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from opentelemetry import trace
from sqlalchemy.orm import Session, sessionmaker

from cachepoint.billing import Price, cost_micros
from cachepoint.gateway.billing.ledger import Charge, price_for, record_on
from cachepoint.gateway.contract.render import Renderer
from cachepoint.gateway.diagnostics import FingerprintStore
from cachepoint.gateway.fleet.routing import Router
from cachepoint.gateway.intake import BodyLimits, IntakePool
from cachepoint.gateway.observability import requestlog
from cachepoint.gateway.observability.metrics import GatewayMetrics
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.gateway.tenancy.ratelimit import Limits, RateLimiter
from cachepoint.gateway.tenancy.tenants import KeyContext, authenticate, hash_key


@dataclass(slots=True)
class GatewayState:
    settings: GatewaySettings
    sessions: sessionmaker[Session]
    renderer: Renderer
    router: Router
    tracer: trace.Tracer = field(default_factory=trace.NoOpTracer)
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    limiter: RateLimiter = field(init=False)  # rate limits per org and key, from settings
    intake: IntakePool = field(init=False)  # worker threads for parsing and rendering
    body_limits: BodyLimits = field(init=False)  # caps on a body's shape, from settings
    fingerprints: FingerprintStore = field(init=False)  # cache diagnostics' prompt fingerprints
    # key hash -> (context or None, monotonic expiry): keeps auth off the DB per request
    _auth_cache: dict[str, tuple[KeyContext | None, float]] = field(default_factory=dict)
    # key hash -> monotonic time it was last forgotten (revoked or restored here): a
    # lookup begun before then must not put its stale answer back in the cache
    _forgotten_at: dict[str, float] = field(default_factory=dict)
    # model -> (price, monotonic expiry): prices change rarely; reading them per request
    # cost a query on the billing path
    _price_cache: dict[str, tuple[Price, float]] = field(default_factory=dict)

    # Models the live replicas report (set by the app from the directory).
    served_models: Callable[[], set[str]] = field(default_factory=lambda: set)
    # wall-clock seconds for the ledger's timestamps and cache diagnostics' ages (tests
    # move it to age a turn past its TTL)
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        s = self.settings
        self.limiter = RateLimiter(
            Limits(
                s.org_requests_per_minute,
                s.org_input_tokens_per_minute,
                s.key_requests_per_minute,
                s.key_input_tokens_per_minute,
                s.org_count_tokens_per_minute,
            )
        )
        self.intake = IntakePool(
            s.intake_workers, s.intake_org_share, s.intake_org_bytes, s.intake_inline_bytes
        )
        self.body_limits = BodyLimits(
            s.max_json_depth, s.max_messages, s.max_content_blocks, s.max_tools
        )
        self.fingerprints = FingerprintStore(
            self.sessions.kw["bind"], s.diagnostics_retention_s, clock=lambda: self.clock()
        )

    def models(self) -> list[str]:
        """Configured models plus whatever the live replicas say they serve."""
        return sorted(set(self.settings.models) | self.served_models())

    @property
    def default_price(self) -> Price:
        return Price(self.settings.default_input_per_mtok, self.settings.default_output_per_mtok)

    def cached_auth(self, raw: str) -> tuple[bool, KeyContext | None]:
        """(found, context) from the cache alone: the hot path never touches the DB."""
        hit = self._auth_cache.get(hash_key(raw))
        if hit is not None and hit[1] > time.monotonic():
            return True, hit[0]
        return False, None

    def authenticate(self, raw: str) -> KeyContext | None:
        """Look the key up in the database (a worker thread calls this) and cache it."""
        digest = hash_key(raw)
        now = time.monotonic()
        with self.sessions() as session:
            ctx = authenticate(session, raw)
        if len(self._auth_cache) > 100_000:
            self._auth_cache.clear()
        if self._forgotten_at.get(digest, -1.0) >= now:
            return ctx  # changed while this lookup ran: answer it, but do not cache it
        self._auth_cache[digest] = (ctx, now + self.settings.auth_cache_seconds)
        return ctx

    def forget_key(self, key_hash: str) -> None:
        """Drop a key (by its stored hash) from this process's auth cache after it was
        revoked or restored: its next request is looked up again. NOTE: other gateway
        processes keep their cached answer for up to ``auth_cache_seconds``."""
        self._forgotten_at[key_hash] = time.monotonic()
        self._auth_cache.pop(key_hash, None)

    def price(self, model: str) -> Price:
        now = time.monotonic()
        hit = self._price_cache.get(model)
        if hit is not None and hit[1] > now:
            return hit[0]
        with self.sessions() as session:
            price = price_for(session, model, self.default_price)
        self._price_cache[model] = (price, now + self.settings.auth_cache_seconds)
        return price

    def bill(self, charge: Charge) -> int | None:
        """Write the usage row (idempotent by request id); runs in a worker thread.
        Returns the cost in micro-dollars, or None if this request was already billed."""
        requestlog.note_charge(charge)
        price = self.price(charge.model)
        bind = self.sessions.kw["bind"]
        now = self.clock()
        prints = self.fingerprints
        also = prints.writer(charge.request_id)
        at = datetime.fromtimestamp(now, UTC)
        inserted = record_on(bind, charge, price, now=at, also=also)
        if also is not None:
            prints.prune()
        if not inserted:
            return None
        b = charge.buckets
        kept = b.cache_read_input_tokens + b.cache_write_5m_tokens + b.cache_write_1h_tokens
        prints.billed(charge.request_id, replica=charge.replica, at_s=now, kept_tokens=kept)
        spent = b.input_tokens + b.cache_write_5m_tokens + b.cache_write_1h_tokens
        self.limiter.spend_input(charge.org_id, charge.api_key_id, spent)
        cost = cost_micros(charge.buckets, price)
        self.metrics.billed(charge.org_id, charge.model, charge.buckets, cost)
        return cost
