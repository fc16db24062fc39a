"""vLLM's KV events replayed into the kvcore mirror, with vLLM's own event shapes.

The events are built as vLLM's msgspec structs would decode (same class names and
fields: vllm/distributed/kv_events.py), so `apply` is checked without vLLM installed;
the live path (ZMQ, vLLM's decoder) runs in tests/replica/vllm_engine/test_live.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from cachepoint.kvcore import AllBlocksCleared as OurCleared
from cachepoint.kvcore import BlockStored as OurStored
from cachepoint.kvcore import hash_blocks
from cachepoint.kvcore.mirror import PoolMirror
from cachepoint.replica.vllm_engine.events import apply
from cachepoint.replica.vllm_engine.scope import encode_salt

B = 4
KEYS = ("model:m", "org:org_1")


@dataclass
class BlockStored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[Any]
    medium: str | None = "GPU"


@dataclass
class AllBlocksCleared:
    pass


@dataclass
class Unknown:
    data: list[int] = field(default_factory=list)


def vllm_hashes(tokens: list[int], salt: str | None) -> list[int]:
    """Stand-in for vLLM's sha256 chain: ints, salted on the first block only."""
    out, parent = [], b"seed"
    for i in range(len(tokens) // B):
        extra = salt.encode() if i == 0 and salt else b""
        parent = hashlib.sha256(parent + extra + bytes(tokens[i * B : (i + 1) * B])).digest()
        out.append(int.from_bytes(parent[:8], "big"))
    return out


def test_a_salted_run_and_its_child_get_the_gateways_hashes() -> None:
    tokens = list(range(1, 17))
    salt = encode_salt(KEYS)
    h = vllm_hashes(tokens, salt)
    mirror = PoolMirror(B)
    stats = apply(
        mirror,
        [
            BlockStored(h[:2], None, tokens[:8], B, extra_keys=[(salt,), None]),
            BlockStored(h[2:], h[1], tokens[8:], B, extra_keys=[None, None]),
        ],
    )
    assert stats.stored == 4
    assert set(mirror.cached) == set(hash_blocks(tokens, B, KEYS))


def test_removed_cleared_and_what_is_not_ours() -> None:
    tokens = list(range(1, 9))
    h = vllm_hashes(tokens, None)
    mirror = PoolMirror(B)
    stats = apply(
        mirror,
        [
            BlockStored(h, None, tokens, B, extra_keys=[None, None]),
            # Another block size (a hybrid model's other group), another medium (a KV
            # connector's CPU tier), a LoRA's extra keys: none is this pool's.
            BlockStored([7], None, tokens[:8], 8),
            BlockStored([8], None, tokens[:4], B, medium="CPU"),
            BlockStored([9], None, tokens[:4], B, extra_keys=[("lora", "x")]),
            BlockRemoved([h[1]]),
            BlockRemoved([h[0]], medium="CPU"),
            Unknown(),
        ],
    )
    assert (stats.stored, len(stats.removed), stats.skipped) == (2, 1, 3)
    assert set(mirror.cached) == {hash_blocks(tokens, B)[0]}
    apply(mirror, [AllBlocksCleared()])
    assert len(mirror) == 0
    assert any(isinstance(e, OurCleared) for e in mirror.take_events())


def test_events_come_out_in_kvcore_space_for_the_bus() -> None:
    tokens = list(range(1, 9))
    h = vllm_hashes(tokens, None)
    mirror = PoolMirror(B)
    apply(mirror, [BlockStored(h, None, tokens, B)])
    ours = hash_blocks(tokens, B)
    assert mirror.take_events() == [OurStored(tuple(ours), None)]
