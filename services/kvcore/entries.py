"""Managed cache entries: what a `cache_control` breakpoint wrote, with its TTL."""

from __future__ import annotations

from dataclasses import dataclass

from .hashing import BlockHash, EntryKey
from .retention import DeadlineHeap, RetentionOwner


@dataclass(slots=True, eq=False)
class CacheEntry:
    """A prefix written at a breakpoint. Its full blocks are retained while it lives."""

    key: EntryKey  # hash of the prefix up to exactly `num_tokens`
    num_tokens: int  # prefix length in tokens (may end mid-block)
    block_hashes: tuple[BlockHash, ...]  # the full blocks under it, in chain order
    ttl: float  # seconds; each hit moves expires_at to now + ttl
    expires_at: float  # clock seconds
    owner: RetentionOwner | None = None  # tenant its blocks' retention is charged to


class EntryTable:
    """Entries by key, with lazy expiry through a deadline heap."""

    __slots__ = ("_deadlines", "_entries")

    def __init__(self) -> None:
        self._entries: dict[EntryKey, CacheEntry] = {}
        self._deadlines: DeadlineHeap[CacheEntry] = DeadlineHeap()

    def __len__(self) -> int:
        return len(self._entries)

    def get_live(self, key: EntryKey, now: float) -> CacheEntry | None:
        entry = self._entries.get(key)
        if entry is None or entry.expires_at <= now:
            return None
        return entry

    def live(self, now: float) -> list[CacheEntry]:
        """Every entry still live at ``now``."""
        return [e for e in self._entries.values() if e.expires_at > now]

    def put(self, entry: CacheEntry) -> None:
        self._entries[entry.key] = entry
        self._deadlines.push(entry.expires_at, entry)

    def extend(self, entry: CacheEntry, expires_at: float) -> None:
        """Move an entry's expiry later (never earlier)."""
        if expires_at > entry.expires_at:
            entry.expires_at = expires_at
            self._deadlines.push(expires_at, entry)

    def drop(self, entry: CacheEntry) -> None:
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]

    def expire(self, now: float) -> int:
        dropped = 0
        for deadline, entry in self._deadlines.pop_due(now):
            if entry.expires_at == deadline and self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
                dropped += 1
        return dropped

    def clear(self) -> None:
        self._entries.clear()
        self._deadlines.clear()
