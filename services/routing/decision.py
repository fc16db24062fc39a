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
    matched_blocks: int  # leading prompt blocks its index holds (after the last-token cap)
    matched_tokens: int  # matched_blocks * block_size: the prefill tokens it would save
    load_tokens: int  # its queued prefill tokens when the request was routed
    score: float  # the policy's score; higher is better


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The replica a policy chose, and why."""

    replica: str  # the chosen replica's name
    policy: str  # the policy's name, as `make_policy` knows it
    matched_blocks: int  # blocks the chosen replica is expected to hit
    matched_tokens: int  # tokens the chosen replica is expected to serve from cache
    score: float  # the chosen candidate's score
    candidates: tuple[Candidate, ...]  # every routable replica, in the order given

    def span_attributes(self) -> dict[str, AttributeValue]:
        """Attributes for the gateway's `route` span (flat, OpenTelemetry-typed)."""
        return {
            "cachepoint.route.policy": self.policy,
            "cachepoint.route.replica": self.replica,
            "cachepoint.route.matched_blocks": self.matched_blocks,
            "cachepoint.route.matched_tokens": self.matched_tokens,
            "cachepoint.route.score": self.score,
            "cachepoint.route.candidates": [
                f"{c.replica}:matched={c.matched_tokens},load={c.load_tokens},score={c.score:g}"
                for c in self.candidates
            ],
        }
