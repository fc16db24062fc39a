"""Routing policies: pick the replica for a request from per-replica prefix indexes and load.

Pure (no I/O, no clock, no asyncio): the gateway and the trace simulator import
the same classes.
"""

from .decision import Candidate, NoReplicaError, RouteDecision
from .policies import (
    CacheAwarePolicy,
    LeastLoadedPolicy,
    PrefixAffinityPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
    routable,
    usable_blocks,
)
from .registry import DEFAULT_POLICY, POLICIES, make_policy
from .view import ReplicaView

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "CacheAwarePolicy",
    "Candidate",
    "LeastLoadedPolicy",
    "NoReplicaError",
    "PrefixAffinityPolicy",
    "ReplicaView",
    "RoundRobinPolicy",
    "RouteDecision",
    "RoutingPolicy",
    "make_policy",
    "routable",
    "usable_blocks",
]
