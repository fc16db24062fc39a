"""What a routing policy returns: the choice, and every candidate's score for the trace span."""

from __future__ import annotations

from dataclasses import dataclass

AttributeValue = str | int | float | list[str]
"""An OpenTelemetry attribute value (the subset `span_attributes` uses)."""


class NoReplicaError(RuntimeError):
    """No replica can take the request: none is live, or every live one is at its queue bound."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One routable replica as the policy scored it."""

    replica: str  # replica name
    matched_blocks: int  # leading prompt blocks it would hit, any tier (after the last-token cap)
    matched_tokens: int  # matched_blocks * block_size: the prefill tokens it would not compute
    load_tokens: int  # its queued prefill tokens when the request was routed
    score: float  # the policy's score; higher is better
    saved_tokens: float = 0.0  # matched_tokens with lower-tier hits priced by transfer time
    host_blocks: int = 0  # of matched_blocks, those held in host memory (to be promoted)
    disk_blocks: int = 0  # of matched_blocks, those held on local disk (to be promoted)
    routed_blocks: int = 0  # of matched_blocks, those routed there but not yet in its events

    def describe(self) -> str:
        """One line for the `route` span's candidate list."""
        out = f"{self.replica}:matched={self.matched_tokens},load={self.load_tokens}"
        out += f",score={self.score:g}"
        if self.host_blocks or self.disk_blocks:
            out += f",host={self.host_blocks},disk={self.disk_blocks}"
        if self.routed_blocks:
            out += f",routed={self.routed_blocks}"
        return out


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The replica a policy chose, and why."""

    replica: str  # the chosen replica's name
    policy: str  # the policy's name, as `make_policy` knows it
    matched_blocks: int  # blocks the chosen replica is expected to hit, in any tier
    matched_tokens: int  # tokens the chosen replica is expected to serve from cache
    score: float  # the chosen candidate's score
    candidates: tuple[Candidate, ...]  # every routable replica, in the order given
    host_blocks: int = 0  # of matched_blocks, those it holds in host memory
    disk_blocks: int = 0  # of matched_blocks, those it holds on local disk
    routed_blocks: int = 0  # of matched_blocks, those routed there and not yet in its events
    steered: bool = False  # sent where its prompt_cache_key went before (CacheKeyAffinity)

    def span_attributes(self) -> dict[str, AttributeValue]:
        """Attributes for the gateway's `route` span (flat, OpenTelemetry-typed)."""
        return {
            "cachepoint.route.policy": self.policy,
            "cachepoint.route.replica": self.replica,
            "cachepoint.route.matched_blocks": self.matched_blocks,
            "cachepoint.route.matched_tokens": self.matched_tokens,
            "cachepoint.route.host_blocks": self.host_blocks,
            "cachepoint.route.disk_blocks": self.disk_blocks,
            "cachepoint.route.routed_blocks": self.routed_blocks,
            "cachepoint.route.score": self.score,
            "cachepoint.route.candidates": [c.describe() for c in self.candidates],
            "cachepoint.route.cache_key_steered": self.steered,
        }
