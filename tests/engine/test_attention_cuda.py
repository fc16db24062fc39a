"""The CUDA paged-attention backend (services/engine/attention_cuda.py).

On the CPU: the float64 reference against a naive per-token implementation, the
conversion of the engine's metadata into the kernel's inputs (checked by reading the
pool back through the kernel's own addressing rule), the kernel's argument shapes on
meta tensors, and the availability reasons. With a CUDA device: the kernel itself
against the reference.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from cachepoint.engine.attention_cuda import (
    PAGE_MULTIPLE,
    cuda_paged_attention,
    cuda_paged_attention_available,
    paged_kernel_inputs,
    reference_paged_attention,
)


def _case(
    seed: int,
    *,
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    queries: list[int],
    contexts: list[int],
    dtype: torch.dtype = torch.float64,
    device: str = "cpu",
) -> dict[str, torch.Tensor | int]:
    """Random pool, block tables (a random permutation of blocks, 0-padded) and queries."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / bs) for n in contexts]
    num_blocks = sum(need) + 3  # a few blocks no sequence owns
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    max_blocks = max(need) + 1  # padded tables, as the engine sends them
    tables = torch.zeros(len(contexts), max_blocks, dtype=torch.int32)
    at = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = torch.tensor(ids[at : at + nb], dtype=torch.int32)
        at += nb
    k = torch.randn(hkv, num_blocks, bs, d, generator=gen, dtype=torch.float64)
    v = torch.randn(hkv, num_blocks, bs, d, generator=gen, dtype=torch.float64)
    q = torch.randn(sum(queries), hq, d, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "q": q.to(device, dtype),
        "k_cache": k.to(device, dtype),
        "v_cache": v.to(device, dtype),
        "cu_seqlens_q": cu.to(device),
        "seq_lens": torch.tensor(contexts, dtype=torch.int32, device=device),
        "block_tables": tables.to(device),
        "max_q": max(queries),
        "max_k": max(contexts),
    }


def _naive(case: dict[str, torch.Tensor | int]) -> torch.Tensor:
    """Per sequence: read K/V token by token through the block table, then SDPA with an
    explicit boolean mask (a different route from the reference's block gather)."""
    q, kc, vc = case["q"], case["k_cache"], case["v_cache"]
    assert isinstance(q, torch.Tensor) and isinstance(kc, torch.Tensor)
    assert isinstance(vc, torch.Tensor)
    cu = case["cu_seqlens_q"].tolist()  # type: ignore[union-attr]
    lens = case["seq_lens"].tolist()  # type: ignore[union-attr]
    tables = case["block_tables"].tolist()  # type: ignore[union-attr]
    bs = kc.shape[2]
    out = torch.empty_like(q, dtype=torch.float64)
    for i, total in enumerate(lens):
        n = cu[i + 1] - cu[i]
        k = torch.stack([kc[:, tables[i][p // bs], p % bs] for p in range(total)], dim=1)
        v = torch.stack([vc[:, tables[i][p // bs], p % bs] for p in range(total)], dim=1)
        mask = torch.tensor(
            [[j <= total - n + r for j in range(total)] for r in range(n)], dtype=torch.bool
        )
        res = F.scaled_dot_product_attention(
            q[cu[i] : cu[i + 1]].double().transpose(0, 1)[None],
            k.double()[None],
            v.double()[None],
            attn_mask=mask,
            enable_gqa=True,
        )
        out[cu[i] : cu[i + 1]] = res[0].transpose(0, 1)
    return out


MIXES = [
    # (hq, hkv, d, bs, queries, contexts): prefills (some with a cached prefix) then decodes
    (4, 4, 8, 4, [5], [5]),  # one cold prefill, MHA
    (8, 2, 16, 4, [3, 1, 1], [10, 7, 1]),  # cached prefill, then decodes (one at position 0)
    (6, 3, 8, 8, [9, 4, 1, 1, 1], [9, 21, 16, 17, 33]),  # block-aligned and ragged lengths
    (4, 1, 32, 16, [1, 1], [40, 3]),  # decode only, MQA
]


@pytest.mark.parametrize("mix", MIXES)
def test_reference_matches_naive(mix: tuple[int, int, int, int, list[int], list[int]]) -> None:
    hq, hkv, d, bs, queries, contexts = mix
    case = _case(len(contexts), hq=hq, hkv=hkv, d=d, bs=bs, queries=queries, contexts=contexts)
    got = reference_paged_attention(**case)  # type: ignore[arg-type]
    torch.testing.assert_close(got, _naive(case), rtol=1e-10, atol=1e-10)


def test_reference_random_mixes() -> None:
    rng = random.Random(7)
    for seed in range(12):
        hkv = rng.choice([1, 2, 4])
        hq = hkv * rng.choice([1, 2, 3])
        bs = rng.choice([1, 2, 4, 16])
        prefills, decodes = rng.randint(0, 3), rng.randint(0, 4)
        if prefills + decodes == 0:
            decodes = 1
        contexts = [rng.randint(1, 50) for _ in range(prefills + decodes)]
        queries = [rng.randint(1, c) for c in contexts[:prefills]] + [1] * decodes
        case = _case(seed, hq=hq, hkv=hkv, d=8, bs=bs, queries=queries, contexts=contexts)
        got = reference_paged_attention(**case)  # type: ignore[arg-type]
        torch.testing.assert_close(got, _naive(case), rtol=1e-10, atol=1e-10)


def test_reference_keeps_dtype_and_rejects_bad_metadata() -> None:
    case = _case(1, hq=4, hkv=2, d=8, bs=4, queries=[2], contexts=[6], dtype=torch.bfloat16)
    assert reference_paged_attention(**case).dtype == torch.bfloat16  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="queries over"):
        reference_paged_attention(**{**case, "seq_lens": torch.tensor([1], dtype=torch.int32)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exceeds max_q/max_k"):
        reference_paged_attention(**{**case, "max_k": 5})  # type: ignore[arg-type]


def _read_like_the_kernel(
    key: torch.Tensor, table: torch.Tensor, seqused: int, head: int
) -> torch.Tensor:
    """FA2's paged addressing (flash_fwd_kernel.h): row p of a sequence lives at
    ``table[p // page] * k.stride(0) + (p % page) * k.stride(-3) + head * k.stride(-2)``,
    read here through the raw storage and the view's strides."""
    page = key.shape[1]
    flat = key.as_strided((key.untyped_storage().nbytes() // key.element_size(),), (1,), 0)
    rows = []
    for p in range(seqused):
        base = (
            int(table[p // page]) * key.stride(0)
            + (p % page) * key.stride(-3)
            + head * key.stride(-2)
            + key.storage_offset()
        )
        rows.append(flat[base : base + key.shape[-1]])
    return torch.stack(rows)


def test_kernel_inputs_address_the_pool_like_the_engine() -> None:
    case = _case(3, hq=4, hkv=2, d=8, bs=4, queries=[3, 1], contexts=[11, 6])
    kc, vc = case["k_cache"], case["v_cache"]
    assert isinstance(kc, torch.Tensor) and isinstance(vc, torch.Tensor)
    seq_lens, tables = case["seq_lens"], case["block_tables"]
    assert isinstance(seq_lens, torch.Tensor) and isinstance(tables, torch.Tensor)
    inp = paged_kernel_inputs(kc, vc, seq_lens.long(), tables.long())
    # Layout the kernel expects, as a view of the pool (no copy), head_dim contiguous.
    assert inp.key.shape == (kc.shape[1], kc.shape[2], kc.shape[0], kc.shape[3])
    assert inp.key.data_ptr() == kc.data_ptr() and inp.value.data_ptr() == vc.data_ptr()
    assert inp.key.stride(-1) == 1 and inp.key.stride() == inp.value.stride()
    # Metadata dtypes and contents.
    assert inp.cu_seqlens_k.dtype == inp.seqused_k.dtype == inp.block_table.dtype == torch.int32
    assert inp.cu_seqlens_k.tolist() == [0, 11, 17]
    assert inp.seqused_k.tolist() == [11, 6]
    assert inp.block_table.is_contiguous() and inp.block_table.tolist() == tables.tolist()
    # Reading through the kernel's addressing gives each position's K/V in the pool.
    bs = kc.shape[2]
    for i, total in enumerate(seq_lens.tolist()):
        for h in range(kc.shape[0]):
            for pool, view in ((kc, inp.key), (vc, inp.value)):
                want = torch.stack([pool[h, int(tables[i, p // bs]), p % bs] for p in range(total)])
                got = _read_like_the_kernel(view, inp.block_table[i], total, h)
                assert torch.equal(got, want)


def test_kernel_inputs_reject_bad_layouts() -> None:
    k = torch.zeros(2, 3, 4, 8)
    lens, tables = torch.tensor([4]), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim"):
        paged_kernel_inputs(k.transpose(2, 3), k.transpose(2, 3), lens, tables)
    with pytest.raises(ValueError, match="must both be"):
        paged_kernel_inputs(k, k[:1], lens, tables)
    with pytest.raises(ValueError, match="block tables for"):
        paged_kernel_inputs(k, k, torch.tensor([4, 4]), tables)
    with pytest.raises(ValueError, match=r"\[num_seqs, max_blocks\]"):
        paged_kernel_inputs(k, k, lens, tables[0])


def test_kernel_arguments_pass_torch_checks_on_meta_tensors() -> None:
    """varlen_attn's Python-side checks and its fake kernel accept the converted inputs
    (head counts read from key.size(2) in the paged layout): shapes only, no GPU."""
    import inspect

    import torch.nn.attention.varlen as varlen

    # NOTE: the project pins a torch whose varlen_attn takes block tables; a torch
    # without them must fail here, not skip (the CUDA path would silently fall back).
    params = inspect.signature(varlen.varlen_attn).parameters
    assert "block_table" in params and "seqused_k" in params, torch.__version__
    hq, hkv, d = 32, 8, 128
    kc = torch.empty(hkv, 10, PAGE_MULTIPLE, d, device="meta", dtype=torch.bfloat16)
    q = torch.empty(7, hq, d, device="meta", dtype=torch.bfloat16)
    inp = paged_kernel_inputs(
        kc,
        kc,
        torch.empty(3, dtype=torch.int32, device="meta"),
        torch.empty(3, 4, dtype=torch.int32, device="meta"),
    )
    out = varlen.varlen_attn(
        q,
        inp.key,
        inp.value,
        torch.empty(4, dtype=torch.int32, device="meta"),
        inp.cu_seqlens_k,
        5,
        1000,
        window_size=(-1, 0),
        enable_gqa=True,
        seqused_k=inp.seqused_k,
        block_table=inp.block_table,
    )
    assert out.shape == q.shape and out.dtype == q.dtype


def test_availability_names_the_reason() -> None:
    ok, why = cuda_paged_attention_available(16, torch.bfloat16)
    assert not ok and ("256" in why or "varlen" in why)
    ok, why = cuda_paged_attention_available(256, torch.float32)
    assert not ok and ("float32" in why or "varlen" in why)
    if not torch.cuda.is_available():
        ok, why = cuda_paged_attention_available(256, torch.bfloat16)
        assert not ok and ("CUDA" in why or "varlen" in why)
        case = _case(0, hq=4, hkv=2, d=8, bs=4, queries=[1], contexts=[3], dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="unavailable"):
            cuda_paged_attention(**case)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_matches_reference(dtype: torch.dtype) -> None:
    ok, why = cuda_paged_attention_available(PAGE_MULTIPLE, dtype)
    if not ok:
        pytest.fail(f"CUDA present but the paged kernel cannot run: {why}")
    case = _case(
        11,
        hq=32,
        hkv=8,
        d=128,
        bs=PAGE_MULTIPLE,
        queries=[300, 17, 1, 1, 1],
        contexts=[300, 1000, 257, 1, 2048],
        dtype=dtype,
        device="cuda",
    )
    got = cuda_paged_attention(**case)  # type: ignore[arg-type]
    want = reference_paged_attention(**case)  # type: ignore[arg-type]
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2)
