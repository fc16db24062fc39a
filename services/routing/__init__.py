"""Routing policies: pick the replica for a request from per-replica prefix indexes and load.

Pure (no I/O, no clock, no asyncio): the gateway and the trace simulator import
the same classes.
"""

from cachepoint.routing.affinity import CacheKeyAffinity
from cachepoint.routing.costs import DEVICE_EQUIVALENT, TierValue, lower_hit_value, tier_value
from cachepoint.routing.decision import Candidate, NoReplicaError, RouteDecision
from cachepoint.routing.policies import (
    CacheAwarePolicy,
    LeastLoadedPolicy,
    PrefixAffinityPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
    routable,
    usable_blocks,
)
from cachepoint.routing.registry import DEFAULT_POLICY, POLICIES, make_policy
from cachepoint.routing.routed import RoutedBlocks
from cachepoint.routing.view import ReplicaView

__all__ = [
    "DEFAULT_POLICY",
    "DEVICE_EQUIVALENT",
    "POLICIES",
    "CacheAwarePolicy",
    "CacheKeyAffinity",
    "Candidate",
    "LeastLoadedPolicy",
    "NoReplicaError",
    "PrefixAffinityPolicy",
    "ReplicaView",
    "RoundRobinPolicy",
    "RouteDecision",
    "RoutedBlocks",
    "RoutingPolicy",
    "TierValue",
    "lower_hit_value",
    "make_policy",
    "routable",
    "tier_value",
    "usable_blocks",
]
