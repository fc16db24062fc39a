"""The CPU prefill kernel (csrc/paged_prefill.cpp) against a float64 reference, its
input checks, and how it is built, found and switched off.

On a machine that can use it (Linux, AVX-512: this project's CI machines) the kernel
must build: a test here fails, rather than skips, when it does not.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepoint.engine import (
    DecodeRequest,
    Engine,
    EngineConfig,
    ModelConfig,
    PrefillRequest,
    cpu_kernels,
)

pytestmark = pytest.mark.skipif(
    cpu_kernels.why_unavailable() is not None,
    reason=f"CPU kernel not usable here: {cpu_kernels.why_unavailable()}",
)


def reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, cached: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T / sqrt(d) + lower-right causal mask) V in float64, each slot looked
    up through the table one by one; and the log-sum-exp."""
    n, heads, d = q.shape
    kv_heads, _blocks, bs, _ = k_cache.shape
    total = cached + n
    slots = torch.arange(total)
    block, offset = table.long()[slots // bs], slots % bs
    k = k_cache[:, block, offset].double().repeat_interleave(heads // kv_heads, 0)
    v = v_cache[:, block, offset].double().repeat_interleave(heads // kv_heads, 0)
    scores = torch.einsum("nhd,hkd->hnk", q.double(), k) / math.sqrt(d)
    hidden = torch.arange(total)[None, :] > (cached + torch.arange(n))[:, None]
    scores = scores.masked_fill(hidden[None], float("-inf"))
    out = torch.einsum("hnk,hkd->nhd", scores.softmax(-1), v)
    return out, torch.logsumexp(scores, -1).transpose(0, 1)


def test_the_kernel_builds_and_loads_here() -> None:
    assert cpu_kernels.load(), "the kernel must build on a machine that can use it"
    assert cpu_kernels.library_path().exists()
    assert torch.ops.cachepoint.paged_prefill_supports(16)
    assert not torch.ops.cachepoint.paged_prefill_supports(8)


@settings(max_examples=60, deadline=None)
@given(
    head_dim=st.sampled_from([16, 32, 64, 128]),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    block_size=st.sampled_from([1, 5, 8, 16, 32]),
    cached=st.integers(0, 300),
    new=st.integers(1, 90),
    spare=st.integers(0, 20),
    seed=st.integers(0, 2**16),
)
def test_paged_prefill_matches_the_reference_over_random_tables(
    head_dim: int,
    kv_heads: int,
    group: int,
    block_size: int,
    cached: int,
    new: int,
    spare: int,
    seed: int,
) -> None:
    """Random block tables (shuffled pool ids, spare blocks never read), block sizes that
    are not powers of two, cached prefixes that end mid-block, GQA groups: output and
    log-sum-exp within 5e-5 of float64 (scores scaled up to make the softmax peaky)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-(cached + new) // block_size)
    pool = blocks + spare
    k_cache = torch.randn(kv_heads, pool, block_size, head_dim, generator=gen) * 2
    v_cache = torch.randn(kv_heads, pool, block_size, head_dim, generator=gen)
    table = torch.randperm(pool, generator=gen)[:blocks].to(torch.int32)
    q = torch.randn(new, kv_heads * group, head_dim, generator=gen) * 2
    out, lse = cpu_kernels.paged_prefill(q, k_cache, v_cache, table, cached, head_dim**-0.5)
    want_out, want_lse = reference(q, k_cache, v_cache, table, cached)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert (out.double() - want_out).abs().max().item() < 5e-5
    assert (lse.double() - want_lse).abs().max().item() < 5e-5


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("new", [688, 700])
def test_a_long_cold_prefill_over_several_threads_computes_every_row(
    threads: int, new: int
) -> None:
    """The kernel hands its row chunks to threads zigzag (first, last, second, ...) so
    the causal triangle's work is balanced: every chunk is still computed exactly once,
    for an odd (688 tokens x 3 heads: 129 chunks) and an even (700: 132) count."""
    gen = torch.Generator().manual_seed(new)
    kv_heads, group, d, bs = 2, 3, 64, 16
    blocks = -(-new // bs)
    k_cache = torch.randn(kv_heads, blocks, bs, d, generator=gen)
    v_cache = torch.randn(kv_heads, blocks, bs, d, generator=gen)
    table = torch.randperm(blocks, generator=gen).to(torch.int32)
    q = torch.randn(new, kv_heads * group, d, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = cpu_kernels.paged_prefill(q, k_cache, v_cache, table, 0, d**-0.5)
    finally:
        torch.set_num_threads(before)
    want_out, want_lse = reference(q, k_cache, v_cache, table, 0)
    assert (out.double() - want_out).abs().max().item() < 5e-5
    assert (lse.double() - want_lse).abs().max().item() < 5e-5


def test_strided_queries_are_read_as_they_lie() -> None:
    """q as the model hands it over: a view into a fused projection (token stride wider
    than the heads)."""
    torch.manual_seed(1)
    kv_heads, heads, d, bs = 2, 4, 16, 16
    fused = torch.randn(40, (heads + 2 * kv_heads) * d)
    q = fused[:, : heads * d].view(40, heads, d)
    assert not q.is_contiguous()
    k_cache, v_cache = torch.randn(2, kv_heads, 8, bs, d).unbind(0)
    table = torch.tensor([7, 2, 5, 0, 1], dtype=torch.int32)
    out, _ = cpu_kernels.paged_prefill(q, k_cache, v_cache, table, 33, d**-0.5)
    want, _ = reference(q.contiguous(), k_cache, v_cache, table, 33)
    assert (out.double() - want).abs().max().item() < 5e-5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("short_table", "block_table covers 32 slots, but 40 are attended"),
        ("int64_table", "contiguous int32 vector"),
        ("bf16", "float32"),
        ("head_dim", "head_dim 24 is not supported"),
        ("gqa", "multiple of kv_heads"),
    ],
)
def test_bad_inputs_are_refused_with_a_reason(change: str, message: str) -> None:
    kv_heads, heads, d, bs = 2, 4, 16, 16
    q = torch.randn(8, heads, d)
    k_cache = torch.randn(kv_heads, 4, bs, d)
    v_cache = torch.randn(kv_heads, 4, bs, d)
    table = torch.arange(3, dtype=torch.int32)
    cached = 8
    if change == "short_table":
        table, cached = table[:2], 32
    elif change == "int64_table":
        table = table.long()
    elif change == "bf16":
        q = q.bfloat16()
    elif change == "head_dim":
        q = torch.randn(8, heads, 24)
        k_cache, v_cache = torch.randn(2, kv_heads, 4, bs, 24).unbind(0)
    elif change == "gqa":
        q = torch.randn(8, 3, d)
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.paged_prefill(q, k_cache, v_cache, table, cached, d**-0.5)


def test_a_cached_prefill_through_the_kernel_equals_a_cold_one_and_torchs_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tiny model (head_dim 16): a prefill over a cached prefix gives the cold
    prefill's logits to 1e-4, through the kernel and with the kernel switched off."""
    total, cached = 700, 560

    def logits(kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(
            cpu_kernels, "paged_prefill_supported", real if kernel else (lambda *_: False)
        )
        engine = Engine(ModelConfig.tiny(), EngineConfig(block_size=16, device="cpu"), seed=3)
        prompt = [(i * 7) % 250 + 1 for i in range(total)]
        table = list(range(-(-total // 16)))[::-1]  # descending ids: no run to read in place
        cold = engine.prefill([PrefillRequest(prompt, table)], all_logits=True)
        warm = engine.prefill([PrefillRequest(prompt, table, cached)], all_logits=True)
        assert cold.prefill_all_logits is not None and warm.prefill_all_logits is not None
        return cold.prefill_all_logits[0][cached:], warm.prefill_all_logits[0]

    real = cpu_kernels.paged_prefill_supported
    cold_k, warm_k = logits(kernel=True)
    cold_t, warm_t = logits(kernel=False)
    assert (warm_k - cold_k).abs().max().item() < 1e-4
    assert (warm_t - cold_t).abs().max().item() < 1e-4
    assert (warm_k - warm_t).abs().max().item() < 1e-4


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    assert cpu_kernels.why_unavailable() == f"{cpu_kernels.ENV_SWITCH}=0"


def test_the_library_is_named_by_its_source_and_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    name = cpu_kernels.library_name()
    assert cpu_kernels.library_path().name == f"{name}.so"
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert cpu_kernels.library_name() != name
    monkeypatch.setenv(cpu_kernels.ENV_CACHE, str(tmp_path))
    assert cpu_kernels.library_path().parent.parent == tmp_path


def test_every_header_a_source_includes_names_the_library(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    import re

    included = {
        name
        for source in cpu_kernels.SOURCES
        for name in re.findall(r'^#include "([^"]+)"', source.read_text(), re.M)
    }
    assert included == {h.name for h in cpu_kernels.HEADERS}
    # and a header that changes is a new build, not the old binary loaded
    name = cpu_kernels.library_name()
    copy = tmp_path / "vec_math.h"
    copy.write_text(cpu_kernels.HEADERS[0].read_text() + "\n// changed\n")
    monkeypatch.setattr(cpu_kernels, "HEADERS", (copy,))
    assert cpu_kernels.library_name() != name


def test_the_build_command_reports_what_it_finds(tmp_path) -> None:
    """``--check`` on an empty cache says where it would build, and builds nothing; the
    default cache (``make install`` built it) reports the built library."""
    env_empty = {"CACHEPOINT_KERNEL_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "cachepoint.engine.build_kernel"]
    out = subprocess.run(
        [*cmd, "--check"], capture_output=True, text=True, env=env_empty, check=True
    ).stdout
    assert "not built yet" in out and str(tmp_path) in out
    assert not any(tmp_path.iterdir())
    built = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "built" in built and str(cpu_kernels.library_path()) in built


# ------------------------------------------------------------------------ decode


def decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    start: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each lane's row over its keys ``start..length-1``, in float64; a lane with no
    keys gives output 0 and log-sum-exp -inf."""
    lanes, heads, d = q.shape
    kv_heads, _blocks, bs, _ = k_cache.shape
    outs, lses = [], []
    for i in range(lanes):
        slots = torch.arange(start, max(start, int(lengths[i])))
        if not len(slots):
            outs.append(torch.zeros(heads, d, dtype=torch.float64))
            lses.append(torch.full((heads,), float("-inf"), dtype=torch.float64))
            continue
        block, offset = tables[i].long()[slots // bs], slots % bs
        k = k_cache[:, block, offset].double().repeat_interleave(heads // kv_heads, 0)
        v = v_cache[:, block, offset].double().repeat_interleave(heads // kv_heads, 0)
        scores = torch.einsum("hd,hkd->hk", q[i].double(), k) / math.sqrt(d)
        outs.append(torch.einsum("hk,hkd->hd", scores.softmax(-1), v))
        lses.append(torch.logsumexp(scores, -1))
    return torch.stack(outs), torch.stack(lses)


@settings(max_examples=60, deadline=None)
@given(
    head_dim=st.sampled_from([16, 32, 64, 128]),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 4, 7, 16]),
    block_size=st.sampled_from([1, 5, 16]),
    lengths=st.lists(st.integers(1, 1500), min_size=1, max_size=5),
    start=st.integers(0, 40),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_paged_decode_matches_the_reference_over_random_tables(
    head_dim: int,
    kv_heads: int,
    group: int,
    block_size: int,
    lengths: list[int],
    start: int,
    threads: int,
    seed: int,
) -> None:
    """Lanes of different lengths over shuffled tables, a start past some lanes' ends
    (their log-sum-exp -inf, output 0: they weigh nothing in a merge), contexts split
    into chunks across 1 or 2 threads."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lengths) // block_size) + 1
    pool = len(lengths) * width + 3
    k_cache = torch.randn(kv_heads, pool, block_size, head_dim, generator=gen) * 2
    v_cache = torch.randn(kv_heads, pool, block_size, head_dim, generator=gen)
    perm = torch.randperm(pool, generator=gen)[: len(lengths) * width]
    tables = perm.view(len(lengths), width).to(torch.int32)
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=gen) * 2
    n = torch.tensor(lengths)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, n, start, head_dim**-0.5)
    finally:
        torch.set_num_threads(before)
    want_out, want_lse = decode_reference(q, k_cache, v_cache, tables, n, start)
    assert (out.double() - want_out).abs().max().item() < 5e-5
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert (lse.double()[finite] - want_lse[finite]).abs().max().item() < 5e-5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("long_lane", "lane 1 attends 80 keys but its table covers 64"),
        ("int64_tables", "int32 \\[lanes, width\\]"),
        ("int32_lengths", "contiguous int64 vector"),
        ("lanes", "one block table row and one length per lane"),
        ("group", "with 17 query heads per KV head is not supported"),
    ],
)
def test_bad_decode_inputs_are_refused_with_a_reason(change: str, message: str) -> None:
    q = torch.randn(2, 4, 16)
    k_cache, v_cache = torch.randn(2, 2, 8, 16, 16).unbind(0)
    tables = torch.arange(8, dtype=torch.int32).view(2, 4)
    lengths = torch.tensor([10, 30])
    if change == "long_lane":
        lengths = torch.tensor([10, 80])
    elif change == "int64_tables":
        tables = tables.long()
    elif change == "int32_lengths":
        lengths = lengths.int()
    elif change == "lanes":
        lengths = lengths[:1]
    elif change == "group":
        q = torch.randn(2, 34, 16)
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lengths, 0, 0.25)


def test_decode_through_the_kernel_equals_torchs_path() -> None:
    """The tiny model, four lanes sharing a prefix and then their own blocks: the same
    logits through the kernel (with the shared prefix read once, merged in) and through
    the planned runs and gathers it replaces."""
    engine = Engine(ModelConfig.tiny(), EngineConfig(block_size=16, device="cpu"), seed=5)
    runner = engine.runner
    assert runner._cpu_paged_decode
    prompt = [(i * 11) % 250 + 1 for i in range(300)]
    shared = list(range(0, 18))  # the prefix's 18 full blocks, then each lane's own
    lanes = [shared + list(range(100 + 10 * i, 104 + 10 * i)) for i in range(4)]
    for lane in lanes:
        engine.prefill([PrefillRequest(prompt, lane)])
    batch = [DecodeRequest(7, 300 + i, lane) for i, lane in enumerate(lanes)]
    with_kernel = engine.decode(batch)
    runner._cpu_paged_decode = False
    without = engine.decode(batch)
    assert (with_kernel - without).abs().max().item() < 1e-4
    assert runner._cpu_paged_decode is False


# ------------------------------------------------------------------ small matmul


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16])
@pytest.mark.parametrize(("n", "k"), [(7, 5), (33, 70), (961, 576), (577, 1536)])
def test_small_matmul_equals_float64(rows: int, n: int, k: int) -> None:
    """Odd output counts (the last pair has one row), K not a multiple of 16, more
    than one pass of eight rows, with and without a bias."""
    torch.manual_seed(rows * n + k)
    x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    for bias in (None, b):
        got = cpu_kernels.small_matmul(x, w, bias)
        want = torch.nn.functional.linear(
            x.double(), w.double(), None if bias is None else bias.double()
        )
        assert got.shape == (rows, n)
        assert (got.double() - want).abs().max().item() < 1e-4


def test_small_matmul_refuses_what_it_cannot_take() -> None:
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        cpu_kernels.small_matmul(torch.randn(17, 64), torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="K matching x"):
        cpu_kernels.small_matmul(torch.randn(2, 64), torch.randn(32, 63))
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        cpu_kernels.small_matmul(torch.randn(2, 64), torch.randn(32, 64), torch.randn(31))


def test_linear_sends_decode_batches_to_small_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    from cachepoint.engine import linear as lin

    calls: list[int] = []
    real = cpu_kernels.small_matmul

    def counted(x, w, b=None):
        calls.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(cpu_kernels, "small_matmul", counted)
    w = torch.randn(1024, 576)
    for rows in (1, 2, 8, 16, 17):
        x = torch.randn(rows, 576)
        assert (lin.linear(x, w) - torch.nn.functional.linear(x, w)).abs().max() < 1e-3
    assert calls == [2, 8, 16]
    lin.linear(torch.randn(4, 64), torch.randn(128, 64))  # the tiny model's sizes
    lin.linear(torch.randn(4, 576), w.t().contiguous().t())  # columns not contiguous
    assert calls == [2, 8, 16]
