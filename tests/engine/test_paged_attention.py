"""Paged prefill and decode attention against a plain float64 reference.

The reference is the textbook formula, softmax(Q K^T / sqrt(d) + lower-right causal
mask) V, over each sequence's whole context, with no pool, no block tables and no SDPA.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from cachepoint.engine import (
    EngineConfig,
    ModelConfig,
    PrefillRequest,
    attention,
    attention_plan,
    cpu_kernels,
)
from cachepoint.engine.attention import paged_attention
from cachepoint.engine.attention_cuda import reference_paged_attention
from cachepoint.engine.batch import DecodeRequest
from cachepoint.engine.runner import ModelRunner

BLOCK = 4


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``q`` ``[n, H, D]`` over ``k``/``v`` ``[N, Hkv, D]`` (positions ``N-n..N-1``)."""
    n, h, d = q.shape
    total, hkv, _ = k.shape
    group = h // hkv
    kk = k.double().repeat_interleave(group, 1).transpose(0, 1)  # [H, N, D]
    vv = v.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kk.transpose(1, 2) / math.sqrt(d)  # [H, n, N]
    keys = torch.arange(total)
    queries = torch.arange(total - n, total)
    scores = scores.masked_fill(keys[None, :] > queries[:, None], float("-inf"))
    return (scores.softmax(-1) @ vv).transpose(0, 1)  # [n, H, D]


def assert_decode_lanes_match(
    layer: int, pool, meta, q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]
) -> None:
    """Run a decode-only step's attention (each lane's last K/V is its new token's) and
    check every lane against the float64 reference over its whole context."""
    k_new = torch.stack([k[-1] for k in ks])
    v_new = torch.stack([v[-1] for v in vs])
    with torch.inference_mode():
        out = paged_attention(layer, q, k_new, v_new, pool, meta)
    for i in range(q.shape[0]):
        expected = reference(q[i : i + 1], ks[i], vs[i])
        assert (out[i : i + 1].double() - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("path", ["cpu_flash", "math", "kernel"])
@pytest.mark.parametrize("layout", ["shuffled", "runs"])
def test_paged_attention_matches_reference(
    monkeypatch: pytest.MonkeyPatch, heads: int, kv_heads: int, seed: int, path: str, layout: str
) -> None:
    """A packed batch of several prefills (cached prefixes 0, unaligned, aligned) and
    decodes equals the float64 reference per sequence.

    ``shuffled`` block ids leave no run long enough to read in place: everything is
    gathered. ``runs`` allocates consecutive ids with random breaks (and a low
    ``MIN_RUN``), and the decode lanes share a prefix of blocks, so in-place runs, the
    shared cascade segment, per-lane runs and gathered leftovers all take part.
    ``math`` forces the float32 fallback that devices without the CPU flash kernel
    take, in query chunks that cut sequences. ``kernel`` runs every prefill (cold or
    cached) through our CPU kernel, which reads the block table itself (where it is
    built).
    """
    d = 8
    calls: list[int] = []
    if path == "kernel":
        if cpu_kernels.why_unavailable() is not None:
            pytest.skip(f"CPU kernel not usable here: {cpu_kernels.why_unavailable()}")
        d = 16  # its smallest head size
        real = cpu_kernels.paged_prefill

        def counted(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(cpu_kernels, "paged_prefill", counted)
    else:
        monkeypatch.setattr(cpu_kernels, "paged_prefill_supported", lambda *_: False)
    if path == "math":
        monkeypatch.setattr(attention, "_CPU_FLASH", None)
        monkeypatch.setattr(attention, "QUERY_CHUNK", 7)
    if layout == "runs":
        monkeypatch.setattr(attention_plan, "MIN_RUN", 2)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    config = ModelConfig.tiny(num_heads=heads, num_kv_heads=kv_heads, hidden_size=heads * d)
    runner = ModelRunner(
        config, EngineConfig(block_size=BLOCK, device="cpu", kv_cache_bytes=8 << 20), seed=seed
    )
    pool, layer = runner.pool, 1
    free = list(range(pool.num_blocks))
    if layout == "shuffled":
        rng.shuffle(free)
    else:
        free.reverse()

    def take(n: int) -> list[int]:
        if layout == "runs" and rng.random() < 0.5:
            free.pop()  # a gap: the next blocks start a new run
        return [free.pop() for _ in range(n)]

    # (context length N, cached prefix M): M = 0, block-unaligned, aligned, and long.
    prefill_shapes = [(rng.randrange(1, 40), 0), (37, 13), (24, 8), (150, 149), (90, 3)]
    decode_positions = [rng.randrange(0, 60) for _ in range(4)] + [0, 77]
    seqs: list[tuple[int, int, list[int]]] = []  # (N, first computed position, blocks)
    for total, cached in prefill_shapes:
        seqs.append((total, cached, take(-(-total // BLOCK))))
    # Decode lanes share their first `common` blocks when the layout allows it.
    common = 0 if layout == "shuffled" else 6
    shared_blocks = take(common)
    decode_positions = [p + common * BLOCK for p in decode_positions]
    for pos in decode_positions:
        # Decode tables of uneven length: the batch pads them and masks the padding.
        own = take(-(-(pos + 1) // BLOCK) + 1 - common)
        seqs.append((pos + 1, pos, shared_blocks + own))

    # Every sequence's full context K/V; the cached part goes into the pool beforehand.
    shared_k = torch.randn(common * BLOCK, kv_heads, d)
    shared_v = torch.randn(common * BLOCK, kv_heads, d)
    n_pre = len(prefill_shapes)
    ks = [torch.randn(total, kv_heads, d) for total, _, _ in seqs]
    vs = [torch.randn(total, kv_heads, d) for total, _, _ in seqs]
    for i in range(n_pre, len(seqs)):
        ks[i][: common * BLOCK] = shared_k
        vs[i][: common * BLOCK] = shared_v
    for (_total, first, blocks), k, v in zip(seqs, ks, vs, strict=True):
        if first:
            slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(first)])
            pool.write(layer, slots, k[:first], v[:first])

    prefills = [PrefillRequest([1] * total, blocks, first) for total, first, blocks in seqs[:n_pre]]
    decodes = [DecodeRequest(1, first, blocks) for _total, first, blocks in seqs[n_pre:]]
    _ids, _pos, meta = runner._metadata(prefills, decodes)
    if layout == "runs":
        assert meta.decode is not None and meta.decode.shared  # the cascade path ran
        assert any(span.segments for span in meta.prefills)

    qs = [torch.randn(total - first, heads, d) for total, first, _ in seqs]
    q = torch.cat(qs)
    k_new = torch.cat([k[first:] for (_t, first, _b), k in zip(seqs, ks, strict=True)])
    v_new = torch.cat([v[first:] for (_t, first, _b), v in zip(seqs, vs, strict=True)])
    with torch.inference_mode():
        out = paged_attention(layer, q, k_new, v_new, pool, meta)

    row = 0
    for qi, k, v in zip(qs, ks, vs, strict=True):
        expected = reference(qi, k, v)
        got = out[row : row + qi.shape[0]].double()
        assert (got - expected).abs().max().item() <= 1e-5
        row += qi.shape[0]
    assert row == out.shape[0]
    if path == "kernel":  # every prefill, cold ones included, one call a layer each
        assert len(calls) == len(prefill_shapes)


_MEMORY_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from cachepoint.engine import Engine, EngineConfig, ModelConfig, PrefillRequest

    total, cached = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(2)
    engine = Engine(
        ModelConfig.tiny(max_position_embeddings=total),
        EngineConfig(block_size=16, device="cpu", kv_cache_bytes=(total // 16 + 8) * 8192),
        seed=0,
    )
    table = list(range(-(-total // 16)))
    prompt = [i % 200 + 1 for i in range(total)]
    # Warm up every code path on a short cached prefill (kernels, allocator pools).
    engine.prefill([PrefillRequest(prompt[:300], table, 200)])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # NOTE: the pool is never filled: attention's memory does not depend on K/V values.
    engine.prefill([PrefillRequest(prompt, table, cached)])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_bytes": (after - before) * 1024}))
    """
)


def test_long_cached_prefill_has_no_quadratic_mask() -> None:
    """A 32k-token prompt over a 31k cached prefix: peak RSS growth stays far below the
    ``[n, N]`` bool mask an explicit lower-right mask needs (and SDPA's float copy of it,
    four times larger)."""
    total, cached = 32768, 31000
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(total), str(cached)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    growth = json.loads(proc.stdout.strip().splitlines()[-1])["growth_bytes"]
    mask_bytes = (total - cached) * total  # one bool per (query, key)
    assert growth < mask_bytes, (growth, mask_bytes)


def test_fragmented_decode_lane_is_gathered_by_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lane whose blocks form many runs is gathered from its persistent id row (no
    per-run Python), and still equals the reference; a lane with few runs is split."""
    monkeypatch.setattr(attention_plan, "MAX_SPLIT_RUNS", 2)
    config = ModelConfig.tiny(num_heads=4, num_kv_heads=2, hidden_size=32)
    runner = ModelRunner(
        config, EngineConfig(block_size=BLOCK, device="cpu", kv_cache_bytes=8 << 20)
    )
    pool, layer = runner.pool, 0
    positions = [41, 30]
    tables = [list(range(0, 2 * 11, 2)), list(range(100, 108))]  # every other block; one run
    ks = [torch.randn(p + 1, 2, 8) for p in positions]
    vs = [torch.randn(p + 1, 2, 8) for p in positions]
    for p, table, k, v in zip(positions, tables, ks, vs, strict=True):
        slots = torch.tensor([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(p)])
        pool.write(layer, slots, k[:p], v[:p])
    decodes = [
        DecodeRequest(1, p, t, seq_id=i)
        for i, (p, t) in enumerate(zip(positions, tables, strict=True))
    ]
    _ids, _pos, meta = runner._metadata([], decodes)
    assert meta.decode is not None and meta.decode.rest is not None
    assert meta.decode.rest[0, :11].tolist() == tables[0]  # the whole fragmented row
    assert_decode_lanes_match(layer, pool, meta, torch.randn(2, 4, 8), ks, vs)


@pytest.mark.parametrize("paged", [True, False])
def test_a_fragmented_shared_prefix_is_read_with_each_lanes_blocks(paged: bool) -> None:
    """Lanes sharing a system prompt whose blocks came from a pool in LRU order: the
    cascade reads the prefix's leading long run once for all lanes and stops at its
    first short run (one attention call a run, a layer, a step made a 4-lane decode
    3.5x slower); the rest is each lane's, and every lane still equals the reference.
    ``paged``: the CPU decode kernel reads the lanes' tables; else runs and gathers."""
    head_dim = 16  # the kernel's smallest
    if paged and cpu_kernels.why_unavailable() is not None:
        pytest.skip(f"CPU kernel not usable here: {cpu_kernels.why_unavailable()}")
    config = ModelConfig.tiny(num_heads=4, num_kv_heads=2, hidden_size=4 * head_dim)
    runner = ModelRunner(
        config, EngineConfig(block_size=BLOCK, device="cpu", kv_cache_bytes=8 << 20)
    )
    runner._cpu_paged_decode = paged
    pool, layer = runner.pool, 0
    long_run = list(range(10, 10 + attention_plan.MIN_RUN))  # 8 consecutive blocks
    scattered = [61, 57, 53, 49, 45, 41]  # then one block at a time
    shared = long_run + scattered
    tables = [shared + list(range(100 + 20 * i, 100 + 20 * i + 3)) for i in range(3)]
    positions = [len(t) * BLOCK - 1 - i for i, t in enumerate(tables)]
    prefix_k = torch.randn(len(shared) * BLOCK, 2, head_dim)
    prefix_v = torch.randn(len(shared) * BLOCK, 2, head_dim)
    ks, vs = [], []
    for p, table in zip(positions, tables, strict=True):
        k, v = torch.randn(p + 1, 2, head_dim), torch.randn(p + 1, 2, head_dim)
        k[: len(shared) * BLOCK], v[: len(shared) * BLOCK] = prefix_k, prefix_v
        slots = torch.tensor([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(p)])
        pool.write(layer, slots, k[:p], v[:p])
        ks.append(k)
        vs.append(v)
    decodes = [
        DecodeRequest(1, p, t, seq_id=i)
        for i, (p, t) in enumerate(zip(positions, tables, strict=True))
    ]
    _ids, _pos, meta = runner._metadata([], decodes)
    assert meta.decode is not None
    assert [(s.block, s.tokens) for s in meta.decode.shared] == [(10, len(long_run) * BLOCK)]
    if paged:
        assert meta.decode.key_start == len(long_run) * BLOCK
    assert_decode_lanes_match(layer, pool, meta, torch.randn(3, 4, head_dim), ks, vs)

    # a prefix that starts fragmented has no cascade at all
    tables = [scattered + long_run + t[len(shared) :] for t in tables]
    decodes = [
        DecodeRequest(1, p, t, seq_id=10 + i)
        for i, (p, t) in enumerate(zip(positions, tables, strict=True))
    ]
    _ids, _pos, meta = runner._metadata([], decodes)
    assert meta.decode is not None and meta.decode.shared == []


@pytest.mark.parametrize("path", ["cpu_flash", "math"])
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_lane_runs_bridge_small_gaps_with_the_gap_masked(
    monkeypatch: pytest.MonkeyPatch, path: str, batch: int
) -> None:
    """A lane's cached run and the run allocated after it, a few foreign blocks apart,
    are one masked view (one kernel call), and the foreign blocks, filled with large
    values, weigh nothing. A gap too wide to bridge stays two segments."""
    if path == "math":
        monkeypatch.setattr(attention, "_CPU_FLASH", None)
    # A block's K and V in one layer are 4 x 2 x 2 x 8 x 4 = 512 bytes: 10 may be hidden.
    monkeypatch.setattr(attention_plan, "BRIDGE_BYTES", 10 * 512)
    config = ModelConfig.tiny(num_heads=4, num_kv_heads=2, hidden_size=32)
    runner = ModelRunner(
        config, EngineConfig(block_size=BLOCK, device="cpu", kv_cache_bytes=8 << 20)
    )
    pool, layer = runner.pool, 0
    # Lane i: 40 blocks from 200 * i, a gap of 3 foreign blocks, then 10 more; the last
    # lane's gap (30 blocks) is too wide to bridge.
    tables = []
    for i in range(batch):
        gap = 30 if i == batch - 1 and batch > 1 else 3
        base = 200 * i
        tables.append(list(range(base, base + 40)) + list(range(base + 40 + gap, base + 50 + gap)))
    positions = [len(t) * BLOCK - 2 - i for i, t in enumerate(tables)]
    foreign = torch.full((BLOCK * 30, 2, 8), 50.0)
    ks = [torch.randn(p + 1, 2, 8) for p in positions]
    vs = [torch.randn(p + 1, 2, 8) for p in positions]
    for p, table, k, v in zip(positions, tables, ks, vs, strict=True):
        gap_slots = torch.arange(table[39] + 1, table[40]) * BLOCK
        gap_slots = (gap_slots[:, None] + torch.arange(BLOCK)).flatten()
        pool.write(layer, gap_slots, foreign[: len(gap_slots)], foreign[: len(gap_slots)])
        slots = torch.tensor([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(p)])
        pool.write(layer, slots, k[:p], v[:p])
    decodes = [
        DecodeRequest(1, p, t, seq_id=i)
        for i, (p, t) in enumerate(zip(positions, tables, strict=True))
    ]
    _ids, _pos, meta = runner._metadata([], decodes)
    assert meta.decode is not None and not meta.decode.shared
    per_lane: dict[int, list[attention_plan.Segment]] = {}
    for lane, seg in meta.decode.lane_segments:
        per_lane.setdefault(lane, []).append(seg)
    for lane in range(batch):
        segs = per_lane[lane]
        if lane == batch - 1 and batch > 1:
            assert len(segs) == 2 and all(s.bias is None for s in segs)  # not bridged
        else:
            (seg,) = segs  # bridged: one view over both runs and the gap
            assert seg.bias is not None and seg.tokens == positions[lane] + 1 + 3 * BLOCK
            hidden = torch.isinf(seg.bias.flatten()).nonzero().flatten()
            assert hidden.tolist() == list(range(40 * BLOCK, 43 * BLOCK))
    assert_decode_lanes_match(layer, pool, meta, torch.randn(batch, 4, 8), ks, vs)


def test_bridge_joins_ascending_runs_only_across_small_gaps() -> None:
    """Runs join across a gap only when the hidden blocks stay within the limit and
    fewer than the visible ones; a run that goes back in the pool never joins."""
    run = attention_plan.Run
    joined, gaps = attention_plan._bridge([run(0, 10, 20), run(20, 33, 5), run(25, 40, 8)], 8)
    assert [(r.block, r.count) for r in joined] == [(10, 38)]
    assert gaps == [[(20, 3), (28, 2)]]
    # Over the limit (3 + 2 > 4): the second gap stays a boundary.
    joined, gaps = attention_plan._bridge([run(0, 10, 20), run(20, 33, 5), run(25, 40, 8)], 4)
    assert [(r.block, r.count) for r in joined] == [(10, 28), (40, 8)]
    # Hiding as many blocks as it shows: not joined. Descending: not joined.
    joined, _ = attention_plan._bridge([run(0, 10, 4), run(4, 22, 4)], 100)
    assert len(joined) == 2
    joined, _ = attention_plan._bridge([run(0, 50, 20), run(20, 10, 20)], 100)
    assert len(joined) == 2
    # Two short runs far apart (the joined view under MIN_RUN blocks) stay gathered.
    joined, _ = attention_plan._bridge([run(0, 10, 2), run(2, 13, 2)], 100)
    assert len(joined) == 2


def test_merge_of_partials_equals_attention_over_the_union() -> None:
    """Partials over disjoint key sets, some rows with no keys in a part (log-sum-exp
    -inf, output 0), merge to the attention over all keys, whatever the part order."""
    torch.manual_seed(3)
    q = torch.randn(1, 2, 5, 8)
    k = torch.randn(1, 2, 30, 8)
    v = torch.randn(1, 2, 30, 8)
    full = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1) @ v
    cuts = [(0, 7), (7, 20), (20, 30)]
    parts = [attention._math_partial(q, k[:, :, a:b], v[:, :, a:b], False, None) for a, b in cuts]
    # A part in which rows 1 and 3 see no key at all.
    bias = torch.zeros(1, 1, 5, 10)
    bias[:, :, [1, 3]] = float("-inf")
    empty_rows = attention._math_partial(q, k[:, :, 20:], v[:, :, 20:], False, bias)
    assert torch.isinf(empty_rows[1][0, :, [1, 3]]).all()
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        got = attention.merge([parts[i] for i in order])
        assert (got - full).abs().max().item() <= 1e-5
    # Rows 1 and 3 take everything from the first two parts.
    first_two = torch.softmax(q @ k[:, :, :20].transpose(-1, -2) / math.sqrt(8), -1) @ v[:, :, :20]
    got = attention.merge([empty_rows, parts[0], parts[1]])
    assert (got[:, :, [1, 3]] - first_two[:, :, [1, 3]]).abs().max().item() <= 1e-5


def test_varlen_metadata_drives_the_reference_to_the_same_output() -> None:
    """The metadata the CUDA kernel would get (built from the persistent tables), fed
    to the float64 paged reference, gives what the CPU path computes for the same step:
    the wiring of the GPU path, checked without a GPU."""
    config = ModelConfig.tiny(num_heads=4, num_kv_heads=2, hidden_size=32)
    runner = ModelRunner(
        config, EngineConfig(block_size=BLOCK, device="cpu", kv_cache_bytes=8 << 20)
    )
    pool, layer = runner.pool, 0
    rng = random.Random(5)
    free = list(range(pool.num_blocks))
    rng.shuffle(free)
    shapes = [(30, 9), (17, 0)]  # prefills: (N, cached)
    positions = [22, 5]  # decodes
    seqs = [(n, m, [free.pop() for _ in range(-(-n // BLOCK))]) for n, m in shapes]
    seqs += [(p + 1, p, [free.pop() for _ in range(p // BLOCK + 1)]) for p in positions]
    for _n, m, blocks in seqs:  # the cached K/V, as earlier steps left it
        slots = torch.tensor([blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(m)])
        if m:
            pool.write(layer, slots, torch.randn(m, 2, 8), torch.randn(m, 2, 8))
    prefills = [PrefillRequest([1] * n, b, m, seq_id=i) for i, (n, m, b) in enumerate(seqs[:2])]
    decodes = [DecodeRequest(1, m, b, seq_id=9 + i) for i, (_n, m, b) in enumerate(seqs[2:])]
    runner.paged_kernel = True  # as on a GPU whose kernel can run
    _ids, _pos, meta = runner._metadata(prefills, decodes)
    vm = meta.varlen
    assert vm is not None
    assert vm.cu_seqlens_q.tolist() == [0, 21, 38, 39, 40]
    assert vm.seq_lens.tolist() == [30, 17, 23, 6]
    for row, (_n, _m, blocks) in zip(vm.block_tables.tolist(), seqs, strict=True):
        assert row[: len(blocks)] == blocks
    tokens = 40
    q, k, v = torch.randn(tokens, 4, 8), torch.randn(tokens, 2, 8), torch.randn(tokens, 2, 8)
    meta.varlen = None  # the CPU path for the same step
    with torch.inference_mode():
        out = paged_attention(layer, q, k, v, pool, meta)  # also writes the new K/V
    k_cache, v_cache = pool.head_major(layer)
    expected = reference_paged_attention(
        q, k_cache, v_cache, vm.cu_seqlens_q, vm.seq_lens, vm.block_tables, vm.max_q, vm.max_k
    )
    assert (out.double() - expected.double()).abs().max().item() <= 1e-5
