"""CacheKeyAffinity: OpenAI's ``prompt_cache_key`` as a routing input.

NOTE: OpenAI routes requests that share a prefix and a ``prompt_cache_key`` to the same
machine while that machine keeps up, and lets the overflow go elsewhere. The prefix
alone already decides where the policy sends a request once the replica holding it has
published its blocks (and `RoutedBlocks` covers the seconds before). What the key adds:
requests whose shared prefix is shorter than a block, or routed by load alone (NATS
down: the fallback policy sees no prefixes), still land together. A key is steered to
the replica its last request went to when that replica holds at least as much of the
prompt as the policy's choice and has at most ``slack_tokens`` more prefill queued.

The key a caller sends is scoped here by the gateway (org id and key), so a key never
steers one org's requests by another's. Pure (the caller passes the clock), like the
policies.
"""

from __future__ import annotations

from dataclasses import replace

from cachepoint.routing.decision import RouteDecision


class CacheKeyAffinity:
    """Scoped cache key -> (replica, deadline) of the last request that carried it.

    Entries leave on their deadline (``ttl_s`` after the last request with the key),
    and oldest first beyond ``max_keys``."""

    __slots__ = ("_last", "max_keys", "slack_tokens", "ttl_s")

    def __init__(
        self, ttl_s: float = 300.0, max_keys: int = 65_536, slack_tokens: int = 8192
    ) -> None:
        if ttl_s <= 0 or max_keys <= 0 or slack_tokens < 0:
            raise ValueError("ttl_s and max_keys must be positive, slack_tokens not negative")
        # NOTE: 5 minutes, the shortest TTL of the cache it steers towards: past it the
        # replica may no longer hold what the key's requests shared.
        self.ttl_s = ttl_s  # seconds a key keeps steering after its last request
        self.max_keys = max_keys  # bound on keys: the oldest go first
        self.slack_tokens = slack_tokens  # more queued prefill than the choice still allowed
        self._last: dict[str, tuple[str, float]] = {}  # key -> (replica, monotonic deadline)

    def __len__(self) -> int:
        return len(self._last)

    def steer(self, key: str | None, decision: RouteDecision, now: float) -> RouteDecision:
        """``decision``, or the same request sent to the replica ``key`` last went to
        (where it still holds as much and keeps up); then remember where it went."""
        if key is None:
            return decision
        chosen = decision
        last = self._last.pop(key, None)
        if last is not None and last[1] > now and last[0] != decision.replica:
            by_name = {c.replica: c for c in decision.candidates}
            home, best = by_name.get(last[0]), by_name.get(decision.replica)
            if (
                home is not None
                and best is not None
                and home.matched_tokens >= best.matched_tokens
                and home.load_tokens <= best.load_tokens + self.slack_tokens
            ):
                chosen = replace(
                    decision,
                    replica=home.replica,
                    matched_blocks=home.matched_blocks,
                    matched_tokens=home.matched_tokens,
                    score=home.score,
                    host_blocks=home.host_blocks,
                    disk_blocks=home.disk_blocks,
                    routed_blocks=home.routed_blocks,
                    steered=True,
                )
        # NOTE: re-inserted last: a dict keeps insertion order, so the first entry is
        # always the oldest and goes first past the bound.
        self._last[key] = (chosen.replica, now + self.ttl_s)
        while len(self._last) > self.max_keys:
            del self._last[next(iter(self._last))]
        return chosen

    def forget(self, replica: str) -> None:
        """``replica`` is gone (down, restarted, draining): no key steers to it."""
        for key in [k for k, (r, _) in self._last.items() if r == replica]:
            del self._last[key]
