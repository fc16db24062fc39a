"""Admission: from a request's tokens and entry spans to a plan, and back to a report.

Pure kvcore logic with no I/O, so every billing-relevant number is unit-testable:
the hash walk, the managed-entry lookup (A), the writes after a successful prefill
(B, C), and the retention refusals.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from cachepoint.billing import cache_writes
from cachepoint.kvcore import (
    MAX_LOOKBACK_BOUNDARIES,
    TTL_SECONDS,
    UNATTRIBUTED,
    BlockHash,
    ExtraKeys,
    KeySpan,
    KVCacheManager,
    RetentionOwner,
    entry_key_at,
    hash_blocks,
)


@dataclass(frozen=True, slots=True)
class EntrySpan:
    """The prefix one managed entry covers: a request's `cache_control` marker, resolved.

    NOTE: not the gateway's breakpoint (gateway/contract/breakpoints.py) nor the
    simulator's: this one carries the keys and owner its entry is written under.
    """

    position: int  # prefix length in tokens
    ttl_label: str  # "5m" | "1h" | "24h"
    extra_keys: ExtraKeys  # keys its entry is hashed under
    boundaries: tuple[int, ...] = ()  # earlier content-block ends, nearest first
    owner: RetentionOwner = UNATTRIBUTED  # tenant its entry's retention is charged to

    @property
    def ttl_s(self) -> float:
        return TTL_SECONDS[self.ttl_label]


@dataclass(slots=True)
class AdmissionPlan:
    """Everything admission decided before the forward pass."""

    tokens: array[int]  # the prompt as int32 (kvcore hashes it without converting)
    block_hashes: list[BlockHash]  # chain hashes of every full block
    entry_spans: list[EntrySpan]  # sorted by position
    entry_hit_tokens: int = 0  # A
    entry_hit_lookback: int | None = None  # for the trace / report
    # Filled after the prefill succeeded:
    written: list[tuple[int, str]] = field(default_factory=list)  # (position, ttl) written
    refusal_reason: str | None = None  # first retention refusal, if any


def retention_owner(key: str | None, share: float | None) -> RetentionOwner:
    """The tenant a request's entries are charged to (docs/kvcore.md, Retention).

    NOTE: requests that name no owner share one, so an old gateway or a direct caller
    is held to a single tenant's quota rather than bypassing every quota.
    """
    return RetentionOwner(key or UNATTRIBUTED.key, share)


def key_schedule(spans: Sequence[tuple[int, Sequence[str]]]) -> list[KeySpan]:
    """The gateway's key spans as kvcore's; no spans means no extra keys at all."""
    if not spans:
        return [KeySpan(0, ())]
    return [KeySpan(start, tuple(keys)) for start, keys in spans]


def keys_at_block(schedule: Sequence[KeySpan], block: int) -> ExtraKeys:
    keys: ExtraKeys = ()
    for span in schedule:
        if span.start_block > block:
            break
        keys = span.extra_keys
    return keys


def plan(
    manager: KVCacheManager,
    tokens: Sequence[int],
    schedule: Sequence[KeySpan],
    entry_spans: Sequence[EntrySpan],
    hashes: list[BlockHash] | None = None,
) -> AdmissionPlan:
    """Hash the prompt (unless ``hashes`` are given: its chain hashes under
    ``schedule``) and find the longest live managed entry (A) among the entry spans.

    A hit refreshes the entry's TTL and its blocks' retention (kvcore does this in
    ``lookup_entry``), so a returning request keeps its prefix alive.
    """
    toks = tokens if isinstance(tokens, array) else array("i", tokens)
    if hashes is None:
        hashes = hash_blocks(toks, manager.block_size, schedule)
    cp = AdmissionPlan(toks, hashes, sorted(entry_spans, key=lambda b: b.position))
    for span in cp.entry_spans:
        positions = (span.position, *span.boundaries)[:MAX_LOOKBACK_BOUNDARIES]
        keys = [
            entry_key_at(toks, p, hashes, manager.block_size, span.extra_keys) for p in positions
        ]
        hit = manager.lookup_entry(keys)
        if hit is not None and hit.num_tokens > cp.entry_hit_tokens:
            cp.entry_hit_tokens = hit.num_tokens
            cp.entry_hit_lookback = hit.lookback
    return cp


def write_entries(manager: KVCacheManager, cp: AdmissionPlan) -> None:
    """After a successful prefill and commit: write an entry at every entry span past A.

    Ascending order matters: each retain covers a superset of the blocks of the one
    before, so a refusal stops at the first span that no longer fits and the
    shorter entries before it stay written.
    """
    for span in cp.entry_spans:
        if span.position <= cp.entry_hit_tokens:
            continue  # read, not written: the hit refreshed what covers it
        key = entry_key_at(
            cp.tokens, span.position, cp.block_hashes, manager.block_size, span.extra_keys
        )
        result = manager.write_entry(key, span.position, cp.block_hashes, span.ttl_s, span.owner)
        if result.written:
            cp.written.append((span.position, span.ttl_label))
        elif cp.refusal_reason is None:
            cp.refusal_reason = result.refused_reason


def written_tokens(cp: AdmissionPlan) -> tuple[int, int]:
    """(5m, 1h) written tokens of the plan's writes past its hit: cachepoint.billing's
    A/B/C rule (``cache_writes``), the one the gateway's buckets assume."""
    return cache_writes(cp.entry_hit_tokens, cp.written)
