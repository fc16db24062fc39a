"""Policies by name: what the gateway's settings and `cachepoint sim --policy` select."""

from __future__ import annotations

from typing import Any

from cachepoint.routing.policies import (
    CacheAwarePolicy,
    LeastLoadedPolicy,
    PrefixAffinityPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
)

PolicyClass = (
    type[CacheAwarePolicy]
    | type[PrefixAffinityPolicy]
    | type[RoundRobinPolicy]
    | type[LeastLoadedPolicy]
)

POLICIES: dict[str, PolicyClass] = {
    "cache_aware": CacheAwarePolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "prefix_affinity": PrefixAffinityPolicy,
}
"""Every policy by its settings name."""

DEFAULT_POLICY = "cache_aware"
"""What the gateway routes by unless told otherwise (prefix tokens held against
queued prefill tokens; docs/sim.md compares it with the others on Mooncake's trace)."""


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    """Build a policy by name; unknown names and options raise `ValueError`."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
    try:
        policy: RoutingPolicy = cls(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for routing policy {name!r}: {exc}") from None
    return policy
