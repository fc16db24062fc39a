"""The loader reproduces a trace's sharing exactly in kvcore's chained hashes."""

from __future__ import annotations

import itertools

import pytest

from cachepoint.kvcore import hash_blocks
from cachepoint.sim.content import BlockContent, TraceHasher, extra_keys_for

from .conftest import tiny_trace

# Hand-built: equal id prefixes must share, anything else must not (even equal ids
# after a different prefix, or the same ids under another tenant).
REQUESTS = [
    {"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 1, "input_length": 14, "output_length": 1, "hash_ids": [1, 2, 5, 6]},
    {"timestamp": 2, "input_length": 16, "output_length": 1, "hash_ids": [9, 2, 3, 4]},
    {"timestamp": 3, "input_length": 16, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
    {
        "timestamp": 4,
        "input_length": 16,
        "output_length": 1,
        "hash_ids": [1, 2, 3, 4],
        "tenant": "b",
    },
    {"timestamp": 5, "input_length": 11, "output_length": 1, "hash_ids": [1, 2, 7]},
]


def _id_prefixes(req, upto: int) -> tuple[object, ...]:
    return (req.tenant, *req.hash_ids[:upto])


@pytest.mark.parametrize("block_size", [4, 2, 1])
def test_equal_id_prefixes_and_nothing_else_share_block_hashes(block_size: int):
    trace = tiny_trace(REQUESTS)
    hasher = TraceHasher(trace.block_tokens, block_size)
    prepared = hasher.prepare_all(trace)
    per_block = trace.block_tokens // block_size
    for (ra, pa), (rb, pb) in itertools.product(
        zip(trace.requests, prepared, strict=True), repeat=2
    ):
        for i, ha in enumerate(pa.block_hashes):
            for j, hb in enumerate(pb.block_hashes):
                same_pos = i == j
                # kvcore block i lies in trace block i // per_block; equal hashes need the
                # same position and the same (tenant, ids) up to and including that block.
                k = i // per_block
                expect = same_pos and _id_prefixes(ra, k + 1) == _id_prefixes(rb, k + 1)
                assert (ha == hb) == expect, (ra.hash_ids, rb.hash_ids, i, j)


def test_memoised_hashes_equal_hashing_the_whole_prompt():
    trace = tiny_trace(REQUESTS)
    content = BlockContent(trace.block_tokens)
    hasher = TraceHasher(trace.block_tokens, 2)
    for req in trace.requests:
        prep = hasher.prepare(req)
        tokens = content.prompt(req)
        assert len(tokens) == req.input_length
        assert list(prep.block_hashes) == hash_blocks(tokens, 2, extra_keys_for(req.tenant))


def test_partial_last_block_is_content_but_never_a_full_block():
    trace = tiny_trace(REQUESTS)
    prepared = TraceHasher(4, 4).prepare_all(trace)
    assert len(prepared[1].block_hashes) == 3  # 14 tokens: three full 4-token blocks
    assert len(prepared[5].block_hashes) == 2  # 11 tokens
    assert prepared[1].nodes[3] not in prepared[0].nodes


def test_nodes_intern_prefix_identity():
    trace = tiny_trace(REQUESTS)
    hasher = TraceHasher(4, 4)
    nodes = [hasher.nodes(r) for r in trace.requests]
    assert nodes[0] == nodes[3]  # the same ids, same tenant
    assert nodes[0][:2] == nodes[1][:2]
    assert nodes[0][1:] != nodes[2][1:]  # equal ids after a different first block
    assert not set(nodes[4]) & set(nodes[0])  # another tenant shares nothing
    assert hasher.num_nodes == 4 + 2 + 4 + 4 + 1


def test_content_is_injective_and_in_vocabulary():
    content = BlockContent(4)
    seen = {tuple(content.tokens(i)) for i in [0, 1, 2, 128_255, 128_256, 10**9, 10**12]}
    assert len(seen) == 7
    assert all(0 <= t < 128_256 for block in seen for t in block)
    with pytest.raises(ValueError, match="outside"):
        content.tokens(-1)


def test_block_size_must_divide_the_trace_block():
    with pytest.raises(ValueError, match="must divide"):
        TraceHasher(512, 384)
