"""What the app holds for its lifetime: database, renderer, router, auth cache, prices."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry import trace
from sqlalchemy.orm import Session, sessionmaker

from .contract.billing import Price, cost_micros
from .contract.render import Renderer
from .ledger import Charge, price_for, record_on
from .metrics import GatewayMetrics
from .settings import GatewaySettings
from .tenants import KeyContext, authenticate, hash_key
from .upstream import Router


@dataclass(slots=True)
class GatewayState:
    settings: GatewaySettings
    sessions: sessionmaker[Session]
    renderer: Renderer
    router: Router
    tracer: trace.Tracer = field(default_factory=trace.NoOpTracer)
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    # key hash -> (context or None, monotonic expiry): keeps auth off the DB per request
    _auth_cache: dict[str, tuple[KeyContext | None, float]] = field(default_factory=dict)
    # model -> (price, monotonic expiry): prices change rarely; reading them per request
    # cost a query on the billing path
    _price_cache: dict[str, tuple[Price, float]] = field(default_factory=dict)

    # Models the live replicas report (set by the app from the directory).
    served_models: Callable[[], set[str]] = field(default_factory=lambda: set)

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
        self._auth_cache[digest] = (ctx, now + self.settings.auth_cache_seconds)
        return ctx

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
        price = self.price(charge.model)
        bind = self.sessions.kw["bind"]
        inserted = record_on(bind, charge, price)
        if not inserted:
            return None
        cost = cost_micros(charge.buckets, price)
        self.metrics.billed(charge.org_id, charge.model, charge.buckets, cost)
        return cost
