"""ReplicaView: what the router knows about one replica when it routes a request."""

from __future__ import annotations

from dataclasses import dataclass, field

from cachepoint.kvcore import PrefixIndex
from cachepoint.routing.costs import TierValue
from cachepoint.routing.routed import RoutedBlocks

_UNREPORTED = TierValue()  # the defaults a replica gets until its heartbeat says otherwise


@dataclass(slots=True)
class ReplicaView:
    """One replica as the router sees it: its event-built index and its last reported load.

    Mutable on purpose: the gateway updates the load fields from each heartbeat and
    the index from each event batch, and hands the same objects to the policy.
    """

    name: str  # replica name, unique in the fleet (the CacheReplica pod)
    index: PrefixIndex = field(default_factory=PrefixIndex)  # blocks it holds, from its events
    queued_prefill_tokens: int = 0  # prefill tokens waiting or in progress on it
    running: int = 0  # requests in prefill or decode
    waiting: int = 0  # requests queued and not yet admitted
    max_waiting: int | None = None  # queue bound; at it the replica is skipped (None: unbounded)
    live: bool = True  # heartbeat fresh; a replica that is not live is never chosen
    tier_value: TierValue = _UNREPORTED  # what a host/disk hit saves, from its cost model
    routed: RoutedBlocks = field(default_factory=RoutedBlocks)  # sent there, not yet in events

    @property
    def routable(self) -> bool:
        """Live and below its queue bound."""
        return self.live and (self.max_waiting is None or self.waiting < self.max_waiting)
