from __future__ import annotations

import subprocess
import sys
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachepoint.kvcore import (
    ROOT_HASH,
    KeySpan,
    encode_tokens,
    entry_key,
    entry_key_at,
    hash_block,
    hash_blocks,
)

tokens_st = st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=16, max_size=200)


def test_hash_blocks_only_full_blocks():
    assert len(hash_blocks(list(range(47)), 16)) == 2
    assert len(hash_blocks(list(range(48)), 16)) == 3
    assert hash_blocks(list(range(15)), 16) == []


def test_hash_blocks_matches_reference_chain():
    toks = list(range(100, 164))
    hs = hash_blocks(toks, 16, ("m",))
    parent = ROOT_HASH
    for k, h in enumerate(hs):
        parent = hash_block(parent, toks[k * 16 : (k + 1) * 16], ("m",))
        assert h == parent
    assert all(len(h) == 16 for h in hs)


def test_hash_blocks_array_input_equals_list_input():
    toks = list(range(1000))
    assert hash_blocks(array("i", toks), 16, ("m",)) == hash_blocks(toks, 16, ("m",))


def test_encode_tokens_is_little_endian_int32():
    assert encode_tokens([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    with pytest.raises(OverflowError):
        encode_tokens([2**31])


@given(tokens_st, st.data())
def test_hash_blocks_position_sensitive(toks, data):
    """Changing one token changes its block's hash and every hash after it."""
    hs = hash_blocks(toks, 16)
    i = data.draw(st.integers(0, len(hs) * 16 - 1))
    changed = list(toks)
    changed[i] = (changed[i] + 1) % 2**31
    hs2 = hash_blocks(changed, 16)
    k = i // 16
    assert hs[:k] == hs2[:k]
    assert all(a != b for a, b in zip(hs[k:], hs2[k:], strict=True))


def test_hash_blocks_same_content_other_position_differs():
    block = list(range(16))
    hs = hash_blocks(block * 3, 16)
    assert len(set(hs)) == 3


@given(tokens_st)
def test_hash_blocks_isolated_by_extra_keys(toks):
    a = hash_blocks(toks, 16, ("model", "org-a"))
    b = hash_blocks(toks, 16, ("model", "org-b"))
    assert not set(a) & set(b)
    # Length-prefixed: key boundaries matter, not just the concatenation.
    assert hash_blocks(toks, 16, ("ab", "c")) != hash_blocks(toks, 16, ("a", "bc"))


def test_hash_blocks_global_then_org_switch():
    """Global prefix blocks are shared across orgs; blocks after the switch are not."""
    toks = list(range(16 * 6))
    g = ("model", "scope:global")

    def spans(org: str) -> list[KeySpan]:
        return [KeySpan(0, g), KeySpan(3, ("model", f"org:{org}"))]

    a = hash_blocks(toks, 16, spans("a"))
    b = hash_blocks(toks, 16, spans("b"))
    all_global = hash_blocks(toks, 16, g)
    assert a[:3] == b[:3] == all_global[:3]
    assert not set(a[3:]) & set(b[3:])
    assert a[3:] != all_global[3:]


def test_hash_blocks_rejects_bad_schedules():
    with pytest.raises(ValueError, match="start at block 0"):
        hash_blocks(list(range(32)), 16, [KeySpan(1, ("x",))])
    with pytest.raises(ValueError, match="strictly increasing"):
        hash_blocks(list(range(32)), 16, [KeySpan(0, ("x",)), KeySpan(0, ("y",))])
    with pytest.raises(TypeError):
        hash_blocks(list(range(32)), 16, [])
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks(list(range(32)), 0)


def test_hash_blocks_continue_chain_from_parent():
    toks = list(range(64))
    whole = hash_blocks(toks, 16)
    tail = hash_blocks(toks[32:], 16, parent=whole[1])
    assert whole[2:] == tail


def test_entry_key_depends_on_tail_and_differs_from_blocks():
    toks = list(range(40))
    hs = hash_blocks(toks, 16)
    k40 = entry_key_at(toks, 40, hs, 16, ("m",))
    k39 = entry_key_at(toks, 39, hs, 16, ("m",))
    k32 = entry_key_at(toks, 32, hs, 16, ("m",))
    assert len({k40, k39, k32}) == 3
    assert k32 == entry_key(hs[1], [], ("m",))
    assert k32 not in hs
    with pytest.raises(ValueError, match="outside"):
        entry_key_at(toks, 41, hs, 16, ("m",))


def test_hash_blocks_stable_across_processes():
    """PYTHONHASHSEED differs per process; our hashes must not."""
    code = (
        "from cachepoint.kvcore import hash_blocks, entry_key_at;"
        "t=list(range(7, 7+80));h=hash_blocks(t, 16, ('m','org'));"
        "print(','.join(x.hex() for x in h), entry_key_at(t, 70, h, 16, ('m',)).hex())"
    )
    toks = list(range(7, 87))
    hs = hash_blocks(toks, 16, ("m", "org"))
    expected = f"{','.join(h.hex() for h in hs)} {entry_key_at(toks, 70, hs, 16, ('m',)).hex()}"
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout.strip()
        assert out == expected


def test_hash_blocks_known_vector():
    """Pins the wire-level hash: changing the scheme must be a deliberate, versioned act."""
    h = hash_blocks(list(range(16)), 16, ("m",))[0]
    assert h == hash_block(ROOT_HASH, list(range(16)), ("m",))
    assert h.hex() == KNOWN_VECTOR


KNOWN_VECTOR = "d27dc585a5d6c0dce550fb201d80392c"
