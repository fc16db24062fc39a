"""PoolMirror and MirrorCacheManager: a foreign engine's cache in kvcore's hash space.

The foreign engine here is a stand-in with its own chained hash (sha256 over the
parent, a salt on the first block only, and the tokens: vLLM's scheme), so the tests
check the one property routing and billing rely on: the mirror names every foreign
block by the kvcore hash the gateway computes for the same prefix and keys.
"""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepoint.kvcore import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ManualClock,
    entry_key_at,
    hash_blocks,
)
from cachepoint.kvcore.mirror import MirrorCacheManager, PoolMirror

B = 4
KEYS = ("model:m", "org:a")


def foreign_chain(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """The stand-in engine's block hashes: the salt keys only the first block."""
    out, parent = [], b"none"
    for i in range(len(tokens) // B):
        extra = salt.encode() if (i == 0 and salt) else b""
        parent = hashlib.sha256(parent + extra + bytes(tokens[i * B : (i + 1) * B])).digest()
        out.append(parent)
    return out


def test_a_root_run_is_named_as_the_gateway_names_it() -> None:
    tokens = list(range(1, 13))
    foreign = foreign_chain(tokens, "salt")
    mirror = PoolMirror(B)
    assert mirror.stored(None, foreign, tokens, KEYS) == 3
    ours = hash_blocks(tokens, B, KEYS)
    assert set(mirror.cached) == set(ours)
    assert mirror.take_events() == [BlockStored(tuple(ours), None)]


def test_a_child_run_continues_its_parents_chain_and_keys() -> None:
    tokens = list(range(1, 17))
    foreign = foreign_chain(tokens, "salt")
    mirror = PoolMirror(B)
    mirror.stored(None, foreign[:2], tokens[:8], KEYS)
    mirror.take_events()
    # The child carries no keys of its own: it inherits its chain's.
    mirror.stored(foreign[1], foreign[2:], tokens[8:])
    ours = hash_blocks(tokens, B, KEYS)
    assert mirror.take_events() == [BlockStored(tuple(ours[2:]), ours[1])]
    assert set(mirror.cached) == set(ours)


def test_repeated_stored_events_for_reused_blocks_change_nothing() -> None:
    tokens = list(range(1, 13))
    foreign = foreign_chain(tokens)
    mirror = PoolMirror(B)
    mirror.stored(None, foreign[:2], tokens[:8])
    mirror.take_events()
    # vLLM repeats BlockStored for blocks a request reused: only the new one is news.
    assert mirror.stored(None, foreign, tokens) == 1
    ours = hash_blocks(tokens, B)
    assert mirror.take_events() == [BlockStored((ours[2],), ours[1])]


def test_removed_blocks_leave_and_unknown_ones_are_ignored() -> None:
    tokens = list(range(1, 13))
    foreign = foreign_chain(tokens)
    mirror = PoolMirror(B)
    mirror.stored(None, foreign, tokens)
    mirror.take_events()
    ours = hash_blocks(tokens, B)
    assert mirror.removed([foreign[2], b"never-seen", foreign[2]]) == [ours[2]]
    assert mirror.take_events() == [BlockRemoved((ours[2],))]
    assert ours[2] not in mirror
    assert ours[1] in mirror


def test_a_child_stored_after_its_parent_was_evicted_still_maps() -> None:
    tokens = list(range(1, 13))
    foreign = foreign_chain(tokens)
    mirror = PoolMirror(B)
    mirror.stored(None, foreign[:2], tokens[:8])
    mirror.removed([foreign[1]])
    mirror.stored(foreign[1], foreign[2:], tokens[8:])
    assert hash_blocks(tokens, B)[2] in mirror
    assert mirror.num_unmapped == 0


def test_a_child_of_a_never_seen_parent_is_counted_not_guessed() -> None:
    tokens = list(range(1, 9))
    foreign = foreign_chain(tokens)
    mirror = PoolMirror(B)
    assert mirror.stored(foreign[0], foreign[1:], tokens[4:]) == 0
    assert mirror.num_unmapped == 1
    assert len(mirror) == 0


def test_cleared_forgets_everything() -> None:
    tokens = list(range(1, 9))
    foreign = foreign_chain(tokens)
    mirror = PoolMirror(B)
    mirror.stored(None, foreign, tokens)
    mirror.take_events()
    mirror.cleared()
    assert mirror.take_events() == [AllBlocksCleared()]
    assert len(mirror) == 0
    assert mirror.translate(foreign[0]) is None


def test_two_foreign_blocks_naming_one_of_ours_stay_until_both_go() -> None:
    tokens = list(range(1, 5))
    mirror = PoolMirror(B)
    # The engine keyed something kvcore does not (a LoRA, say): two hashes, one prefix.
    mirror.stored(None, [b"x"], tokens)
    mirror.stored(None, [b"y"], tokens)
    (ours,) = hash_blocks(tokens, B)
    assert [type(e) for e in mirror.take_events()] == [BlockStored]
    mirror.removed([b"x"])
    assert ours in mirror
    mirror.removed([b"y"])
    assert ours not in mirror
    assert mirror.take_events() == [BlockRemoved((ours,))]


def test_bad_token_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="2 blocks need 8 tokens"):
        PoolMirror(B).stored(None, [b"a", b"b"], [1, 2, 3])


def test_translations_are_bounded_but_never_forget_a_present_block() -> None:
    mirror = PoolMirror(B, max_translations=2)
    for i in range(5):
        mirror.stored(None, [bytes([i])], [i + 1] * B)
    for i in range(3):
        mirror.removed([bytes([i])])
    mirror.stored(None, [b"new"], [9] * B)
    # Every present block still maps, so its removal is still reported.
    assert all(mirror.translate(bytes([i])) is not None for i in (3, 4))
    assert len(mirror.removed([bytes([3]), bytes([4]), b"new"])) == 3


# ------------------------------------------------------------- the model check


@settings(max_examples=60)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["store", "remove", "clear"]),
            st.lists(st.integers(1, 3), min_size=1, max_size=6),  # a prompt
            st.sampled_from([None, "org-a", "org-b"]),  # its salt
            st.integers(0, 5),  # blocks to remove / where a stored run starts
        ),
        max_size=40,
    )
)
def test_the_mirror_holds_exactly_the_engines_blocks_in_kvcore_names(ops: list) -> None:
    mirror = PoolMirror(B)
    engine: dict[bytes, bytes] = {}  # foreign hash -> kvcore hash of the same prefix
    for op, prompt, salt, k in ops:
        tokens = [t for t in prompt for _ in range(B)]  # whole blocks
        foreign = foreign_chain(tokens, salt)
        keys = (salt,) if salt else ()
        ours = hash_blocks(tokens, B, keys)
        if op == "store":
            # The engine stores a run starting at some block whose parent it holds.
            start = min(k, len(foreign) - 1)
            if start and foreign[start - 1] not in engine:
                start = 0
            parent = foreign[start - 1] if start else None
            mirror.stored(parent, foreign[start:], tokens[start * B :], keys)
            engine.update(zip(foreign[start:], ours[start:], strict=True))
        elif op == "remove":
            victims = foreign[-k:] if k else []
            mirror.removed(victims)
            for v in victims:
                engine.pop(v, None)
        else:
            mirror.cleared()
            engine.clear()
        assert set(mirror.cached) == set(engine.values())
    # Replaying the events rebuilds the same set (what the gateway's index does).
    held: set[bytes] = set()
    for event in mirror.take_events():
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)
        else:
            held.clear()
    assert held == set(engine.values())


# -------------------------------------------------------------------- entries


def _manager() -> tuple[MirrorCacheManager, ManualClock]:
    clock = ManualClock()
    return MirrorCacheManager(PoolMirror(B), clock=clock), clock


def test_an_entry_is_read_only_when_the_engine_reused_its_blocks() -> None:
    manager, _ = _manager()
    tokens = list(range(1, 23))  # 5 full blocks and 2 tokens
    hashes = hash_blocks(tokens, B, KEYS)
    key = entry_key_at(tokens, 18, hashes, B, KEYS)  # covers 4 full blocks
    manager.write_entry(key, 18, hashes, 300.0)
    assert manager.lookup_entry([key], engine_hit_tokens=12, prompt_tokens=22) is None
    hit = manager.lookup_entry([key], engine_hit_tokens=16, prompt_tokens=22)
    assert hit is not None
    assert (hit.num_tokens, hit.lookback) == (18, 0)


def test_a_whole_prompt_entry_needs_only_the_blocks_before_the_last_token() -> None:
    manager, _ = _manager()
    tokens = list(range(1, 17))  # exactly 4 blocks: the engine recomputes the 4th
    hashes = hash_blocks(tokens, B, KEYS)
    key = entry_key_at(tokens, 16, hashes, B, KEYS)
    manager.write_entry(key, 16, hashes, 300.0)
    assert manager.lookup_entry([key], engine_hit_tokens=12, prompt_tokens=16) is not None


def test_a_hit_refreshes_the_ttl_and_expiry_ends_the_entry() -> None:
    manager, clock = _manager()
    tokens = list(range(1, 9))
    hashes = hash_blocks(tokens, B)
    key = entry_key_at(tokens, 8, hashes, B, ())
    manager.write_entry(key, 8, hashes, 300.0)
    clock.advance(200)
    assert manager.lookup_entry([b"other", key], 8, 9) is not None  # type: ignore[list-item]
    clock.advance(200)  # 400 s after the write, 200 s after the refresh
    assert manager.lookup_entry([key], 8, 9) is not None
    clock.advance(301)
    assert manager.lookup_entry([key], 8, 9) is None
    assert manager.stats().entries == 0


def test_an_entry_whose_blocks_the_engine_evicted_lapses() -> None:
    manager, _ = _manager()
    tokens = list(range(1, 13))
    foreign = foreign_chain(tokens)
    manager.mirror.stored(None, foreign, tokens)
    hashes = hash_blocks(tokens, B)
    short = entry_key_at(tokens, 8, hashes, B, ())  # ends in block 1
    long = entry_key_at(tokens, 12, hashes, B, ())  # ends in block 2
    manager.write_entry(short, 8, hashes, 300.0)
    manager.write_entry(long, 12, hashes, 300.0)
    # The engine evicts the chain's tail: the entry ending there can no longer be read
    # whole; the shorter one still can.
    assert manager.lapse(manager.mirror.removed([foreign[2]])) == 1
    stats = manager.stats()
    assert (stats.entries, stats.lapsed_entries, stats.cached_blocks) == (1, 1, 2)
    assert manager.lookup_entry([long, short], 8, 13) is not None
    assert manager.lapse_all() == 1
    assert manager.stats().entries == 0


def test_rewrites_keep_one_index_list_per_block_short() -> None:
    manager, clock = _manager()
    tokens = list(range(1, 9))
    hashes = hash_blocks(tokens, B)
    key = entry_key_at(tokens, 8, hashes, B, ())
    for _ in range(50):  # written, expired, written again
        manager.write_entry(key, 8, hashes, 300.0)
        clock.advance(301)
    assert len(manager._by_last[hashes[-1]]) == 1
