"""Prefill-then-decode to completion: the loop tests and benchmarks use.

The scheduler runs its own loop (continuous batching, kvcore allocation, publishing);
this one drives a fixed set of sequences with a plain block allocator callback.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cachepoint.engine.batch import DecodeRequest, PrefillRequest, StepEngine
from cachepoint.engine.sampling import SamplingParams, StopChecker, make_generator, sample

Allocator = Callable[[int], list[int]]
"""Returns ``n`` free block ids (or raises when there are none)."""


class BlockAllocator:
    """A trivial free list of block ids, for tests and benchmarks (no caching, no LRU)."""

    __slots__ = ("_free",)

    def __init__(self, num_blocks: int) -> None:
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def __call__(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} blocks requested, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, block_ids: Sequence[int]) -> None:
        self._free.extend(reversed(block_ids))


@dataclass(slots=True)
class GenerationRequest:
    """One sequence to generate, optionally continuing from cached blocks."""

    prompt_ids: list[int]  # the whole prompt
    params: SamplingParams = field(default_factory=SamplingParams)  # sampling and stopping
    block_table: list[int] = field(default_factory=list)  # blocks already holding the prefix
    num_cached_tokens: int = 0  # prompt positions already in those blocks


@dataclass(slots=True)
class GenerationResult:
    """What one sequence produced, and where its K/V lives."""

    token_ids: list[int]  # generated ids (a final EOS included)
    text: str  # decoded output, cut before a matched stop string
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stop_sequence: str | None  # the stop string that ended it, if any
    block_table: list[int]  # blocks holding prompt + output K/V
    num_kv_tokens: int  # positions 0..num_kv_tokens-1 are in the pool


@dataclass(slots=True)
class _Seq:
    req: GenerationRequest
    table: list[int]
    stop: StopChecker
    out: list[int] = field(default_factory=list)
    finish: str | None = None


def _cover(table: list[int], num_tokens: int, block_size: int, allocate: Allocator) -> None:
    need = math.ceil(num_tokens / block_size) - len(table)
    if need > 0:
        table.extend(allocate(need))


def generate(
    engine: StepEngine, requests: Sequence[GenerationRequest], allocate: Allocator
) -> list[GenerationResult]:
    """Batched prefill of every prompt, then batched decode steps until all finish."""
    bs, eos = engine.block_size, engine.eos_ids
    seqs: list[_Seq] = []
    for r in requests:
        seq = _Seq(r, list(r.block_table), StopChecker(engine.tokenizer, r.params.stop))
        _cover(seq.table, len(r.prompt_ids), bs, allocate)
        seqs.append(seq)
    base = id(seqs)
    try:
        gens = [make_generator(s.req.params, engine.device) for s in seqs]
        # NOTE: seq ids let the engine keep each table between steps; they are forgotten
        # at the end, so ids may repeat across calls.
        logits = engine.prefill(
            [
                PrefillRequest(s.req.prompt_ids, s.table, s.req.num_cached_tokens, base + i)
                for i, s in enumerate(seqs)
            ]
        ).prefill_logits
        active = list(range(len(seqs)))
        while active:
            tokens = sample(logits, [seqs[i].req.params for i in active], [gens[i] for i in active])
            still: list[int] = []
            for i, tok in zip(active, tokens, strict=True):
                s = seqs[i]
                s.out.append(tok)
                position = len(s.req.prompt_ids) + len(s.out) - 1  # where `tok` would go
                p = s.req.params
                if (
                    (tok in eos and not p.ignore_eos)
                    or tok in p.stop_token_ids
                    or s.stop.append(tok) is not None
                ):
                    s.finish = "stop"
                elif len(s.out) >= p.max_tokens or position >= engine.max_model_len:
                    s.finish = "length"
                else:
                    _cover(s.table, position + 1, bs, allocate)
                    still.append(i)
            active = still
            if active:
                logits = engine.decode(
                    [
                        DecodeRequest(
                            seqs[i].out[-1],
                            len(seqs[i].req.prompt_ids) + len(seqs[i].out) - 1,
                            seqs[i].table,
                            base + i,
                        )
                        for i in active
                    ]
                )
    finally:
        for i in range(len(seqs)):
            engine.forget(base + i)
    return [
        GenerationResult(
            token_ids=s.out,
            text=s.stop.text,
            finish_reason=s.finish or "length",
            stop_sequence=s.stop.stopped_on,
            block_table=s.table,
            num_kv_tokens=len(s.req.prompt_ids) + len(s.out) - 1,
        )
        for s in seqs
    ]
