"""PrefixIndex: the router's view of one replica's cache, built only from its events."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from .hashing import BlockHash


class PrefixIndex:
    """Which block hashes a replica holds, as far as its events have told us.

    NOTE: chained hashes make a flat set enough: hash k can only equal the prompt's
    hash k if every block before it matched too, so "leading blocks present" needs
    no tree. A block evicted mid-chain simply ends the match there, exactly as the
    replica's own lookup would.
    """

    __slots__ = ("_hashes",)

    def __init__(self, hashes: Iterable[BlockHash] = ()) -> None:
        self._hashes: set[BlockHash] = set(hashes)

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._hashes

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._hashes.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self._hashes.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self._hashes.clear()
        else:
            raise TypeError(f"not a kv event: {event!r}")

    def apply_all(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(event)

    def replace(self, hashes: Iterable[BlockHash]) -> None:
        """Load a snapshot: the replica's full index at some (epoch, seq)."""
        self._hashes = set(hashes)

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        """Number of leading blocks of ``block_hashes`` present."""
        present = self._hashes
        n = 0
        for h in block_hashes:
            if h not in present:
                break
            n += 1
        return n
