"""Routing, all of it on the gateway's side: what a router sees (`RouteRequest`), what
it answers (`Routed`), the seam a router plugs into (`Router`), the directory's
cache-aware router (contract §4), and the traced, counted decision (`decide`).

The directory router hashes the prompt with the same kvcore code and keys the replica
will use, then lets the configured policy (cachepoint.routing) choose among the
replicas that serve the request's (alias-resolved) model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from opentelemetry.trace import Tracer

from cachepoint.gateway.errors import ApiError, not_found, overloaded
from cachepoint.gateway.fleet.directory import ReplicaDirectory
from cachepoint.gateway.fleet.upstream import ReplicaClient, ReplicaSession
from cachepoint.gateway.observability.metrics import GatewayMetrics
from cachepoint.kvcore import KeySpan, hash_blocks
from cachepoint.routing import (
    CacheKeyAffinity,
    LeastLoadedPolicy,
    NoReplicaError,
    ReplicaView,
    RouteDecision,
    RoutingPolicy,
    make_policy,
)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a router may look at to choose a replica."""

    tokens: Sequence[int]  # the rendered prompt
    key_spans: Sequence[tuple[int, Sequence[str]]]  # (start_block, extra keys)
    model: str  # the served model id (aliases resolved): only its replicas may be chosen
    avoid: frozenset[str] = frozenset()  # replicas already tried for this request
    # OpenAI's prompt_cache_key, scoped by the org ("org:<id>:<key>"): requests that
    # share it go where the last one went while that replica keeps up (CacheKeyAffinity)
    affinity: str | None = None


@dataclass(frozen=True, slots=True)
class Routed:
    replica: ReplicaClient  # where to send the request
    decision: RouteDecision | None  # why (None for the static fallback)


class Router(Protocol):
    def pick(self, req: RouteRequest) -> Routed: ...

    def report_failure(self, name: str) -> None:
        """A call to ``name`` failed at the transport; route elsewhere meanwhile."""

    def freshness_s(self, name: str) -> float | None:
        """Seconds since ``name``'s prefix index last changed (None if unknown)."""

    def started_s(self, name: str) -> float | None:
        """When ``name``'s process started, in epoch seconds (None if unknown)."""

    def evicted_from(self, name: str, req: RouteRequest, token: int) -> str | None:
        """The tier ``name`` last held the block of ``req`` holding ``token`` in, when
        its events say it was removed from every tier (None if unknown)."""

    async def aclose(self) -> None:
        """Close its connections to replicas (the app does, when it stops)."""


def decide(router: Router, req: RouteRequest, *, tracer: Tracer, metrics: GatewayMetrics) -> Routed:
    """``router``'s choice for ``req``, in a ``route`` span and counted by outcome; its
    error (no replica can take the request) is counted and raised."""
    with tracer.start_as_current_span("route") as span:
        try:
            routed = router.pick(req)
        except ApiError:
            metrics.route_decisions.labels("-", "no_replica").inc()
            raise
        policy = routed.decision.policy if routed.decision else "static"
        metrics.route_decisions.labels(policy, "routed").inc()
        span.set_attribute("cachepoint.route.replica", routed.replica.name)
        if routed.decision is not None:
            span.set_attributes(routed.decision.span_attributes())
        age = router.freshness_s(routed.replica.name)
        if age is not None:
            span.set_attribute("cachepoint.route.index_age_s", age)
        return routed


class DirectoryRouter:
    """Routes with the configured policy while the event plane is up, and on load
    alone (least-loaded) while it is down."""

    def __init__(
        self,
        directory: ReplicaDirectory,
        http: ReplicaSession | None = None,
        *,
        policy: str,
        block_size: int,
        nats_up: Callable[[], bool] = lambda: True,
    ) -> None:
        self.directory = directory
        self.http = http or ReplicaSession()  # generate calls (fleet/upstream.py)
        self.policy: RoutingPolicy = make_policy(policy)
        self.fallback: RoutingPolicy = LeastLoadedPolicy()
        self.block_size = block_size
        self.nats_up = nats_up
        self.affinity = CacheKeyAffinity()  # prompt_cache_key -> the replica it went to
        self._clients: dict[str, ReplicaClient] = {}

    def _client(self, name: str, url: str) -> ReplicaClient:
        c = self._clients.get(name)
        if c is None or c.url != url.rstrip("/"):
            c = ReplicaClient(name, url, self.http)
            self._clients[name] = c
        return c

    def _candidates(self, req: RouteRequest) -> list[ReplicaView]:
        """The replicas that serve ``req.model``, not draining, not already tried; a
        clear error when there are none (a 404 if no known replica serves the model)."""
        views = [v for v in self.directory.views(req.model) if v.name not in req.avoid]
        if views:
            return views
        served = self.directory.served_models()
        if served and req.model not in served:
            # NOTE: the model resolved (a configured model, or an alias of one) but no
            # replica reports it: a request must never reach another model's replica.
            raise not_found(
                f"model: {req.model} is not served by any replica (replicas serve: "
                f"{', '.join(sorted(served))})"
            )
        draining = self.directory.draining(req.model)
        if draining:
            raise overloaded(
                f"no replica can take the request: every replica serving {req.model} is "
                f"draining or was tried ({', '.join(sorted({*draining, *req.avoid}))})"
            )
        if req.avoid:
            raise overloaded(
                f"no replica can take the request: no other replica serves {req.model}"
            )
        return views  # none known at all: the policy says so

    def pick(self, req: RouteRequest) -> Routed:
        views = self._candidates(req)
        spans = [KeySpan(start, tuple(keys)) for start, keys in req.key_spans]
        hashes = hash_blocks(req.tokens, self.block_size, spans)
        now = self.directory.clock()
        for v in views:
            v.routed.expire(now)
        policy = self.policy if self.nats_up() else self.fallback
        try:
            decision = policy.choose(hashes, views, self.block_size, num_tokens=len(req.tokens))
        except NoReplicaError as exc:
            raise overloaded(f"no replica can take the request: {exc}") from exc
        decision = self.affinity.steer(req.affinity, decision, now)
        url = self.directory.url_of(decision.replica)
        assert url is not None, "views() only lists replicas with a URL"
        # NOTE: heartbeats report load once a second; a burst routed in between would
        # all see the same stale numbers and pile onto one replica. Count the prefill
        # just sent until the next heartbeat reports the truth (which includes it).
        chosen = next(v for v in views if v.name == decision.replica)
        chosen.queued_prefill_tokens += max(0, len(req.tokens) - decision.matched_tokens)
        # NOTE: and the blocks just sent, until the replica's events speak for them: the
        # next request with this prefix follows instead of computing it elsewhere
        # (cachepoint.routing.routed). Only while events flow: without them the
        # fallback routes on load alone and nothing would ever confirm or forget these.
        if policy is self.policy:
            chosen.routed.add(hashes, now)
        return Routed(self._client(decision.replica, url), decision)

    async def aclose(self) -> None:
        """Close the connections to replicas (the app does, when it stops)."""
        await self.http.aclose()

    def report_failure(self, name: str) -> None:
        self.directory.mark_down(name)
        self.affinity.forget(name)

    def freshness_s(self, name: str) -> float | None:
        return self.directory.freshness_s(name)

    def started_s(self, name: str) -> float | None:
        st = self.directory.replicas.get(name)
        # NOTE: a replica's epoch is its start time in wall-clock nanoseconds.
        return st.epoch / 1e9 if st is not None and st.epoch else None

    def evicted_from(self, name: str, req: RouteRequest, token: int) -> str | None:
        end = (token // self.block_size + 1) * self.block_size
        if end > len(req.tokens):
            return None
        spans = [KeySpan(start, tuple(keys)) for start, keys in req.key_spans]
        hashes = hash_blocks(req.tokens[:end], self.block_size, spans)
        tier = self.directory.evicted_from(name, hashes[-1])
        return tier.value if tier is not None else None
