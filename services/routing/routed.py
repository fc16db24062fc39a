"""RoutedBlocks: the blocks a router has sent to a replica that its events have not yet shown.

NOTE: a replica publishes a prompt's blocks when their prefill commits, seconds after
the request was routed on a busy CPU and a few hundred milliseconds on a GPU. Two
sessions of one tenant that start together are both routed before either's events
arrive: on the event-built index alone both look cold, the tie-break spreads them, and
two replicas compute and keep the same prefix (under pool pressure, the tenant then
holds half as much elsewhere; the routing bench's run-to-run spread came from this).
Counting what was routed there, until the replica's own events speak for those blocks,
sends the second session after the first, where the replica's prefill coalescing makes
it wait for the first's blocks instead of computing them again. SGLang's router does
the same by inserting a request's prefix into the chosen worker's tree when it routes.

Pure (the caller passes the clock), like the policies that read it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cachepoint.kvcore import BlockHash


class RoutedBlocks:
    """Block hashes routed to one replica and not yet seen in its events, each until a deadline.

    Entries leave on their deadline (``ttl_s`` after the last routing that named them),
    when an event or snapshot of the replica names the hash (`forget`), when the
    replica's index is dropped or it stops being routable (`clear`), and oldest first
    beyond ``max_blocks``.
    """

    __slots__ = ("_deadline", "max_blocks", "ttl_s")

    def __init__(self, ttl_s: float = 30.0, max_blocks: int = 65_536) -> None:
        if ttl_s <= 0 or max_blocks <= 0:
            raise ValueError("ttl_s and max_blocks must be positive")
        # NOTE: 30 s covers a long queue plus a long CPU prefill; past it the replica has
        # either published the blocks (its index speaks for them) or never will.
        self.ttl_s = ttl_s  # seconds an entry counts without an event confirming it
        self.max_blocks = max_blocks  # bound on entries: the oldest go first
        # NOTE: a dict keeps insertion order, and every deadline is now + ttl_s with a
        # clock that never goes back, so the first entry always expires first.
        self._deadline: dict[BlockHash, float] = {}  # hash -> monotonic deadline

    def __len__(self) -> int:
        return len(self._deadline)

    def __bool__(self) -> bool:
        return bool(self._deadline)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._deadline

    def add(self, block_hashes: Iterable[BlockHash], now: float) -> None:
        """Count ``block_hashes`` as on their way to the replica, from ``now``."""
        d = self._deadline
        deadline = now + self.ttl_s
        for h in block_hashes:
            d.pop(h, None)  # re-routed: moves to the back with the new deadline
            d[h] = deadline
        while len(d) > self.max_blocks:
            del d[next(iter(d))]

    def expire(self, now: float) -> None:
        """Drop the entries whose deadline has passed."""
        d = self._deadline
        while d:
            first = next(iter(d))
            if d[first] > now:
                return
            del d[first]

    def forget(self, block_hashes: Iterable[BlockHash]) -> None:
        """The replica's events named these: its index speaks for them from now on."""
        d = self._deadline
        if d:
            for h in block_hashes:
                d.pop(h, None)

    def clear(self) -> None:
        self._deadline.clear()

    def run(self, block_hashes: Sequence[BlockHash], start: int) -> int:
        """How many of ``block_hashes`` from ``start`` on are routed here, in an unbroken run."""
        d = self._deadline
        n = 0
        for i in range(start, len(block_hashes)):
            if block_hashes[i] not in d:
                break
            n += 1
        return n
