"""What one engine step takes and returns.

``seq_id``: a caller that runs a sequence over many steps names it, and the engine
keeps its block table between steps, reading only the blocks appended since (host
work per step linear in the batch, not the context). The caller must call
``Engine.forget(seq_id)`` when the sequence ends or gets other blocks (a preemption);
``None`` rebuilds the table every step.

:class:`StepEngine` is what a driver of those steps needs of an engine (the loop in
:mod:`.generate` types its engine with it, so it need not import the engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cachepoint.engine.tokenizer import Tokenizer


@dataclass(slots=True)
class PrefillRequest:
    """Prefill one prompt whose first ``num_cached_tokens`` positions are in the pool.

    Only positions ``num_cached_tokens..len(token_ids)-1`` are computed. A chunk of a
    long prompt is a prefill whose ``token_ids`` stop at the chunk's end.
    """

    token_ids: Sequence[int]  # the whole prompt (cached part included)
    block_table: Sequence[int]  # block ids covering at least positions 0..len(token_ids)-1
    num_cached_tokens: int = 0  # M: positions 0..M-1 are already in the pool; M < N
    seq_id: int | None = None  # keeps the engine's copy of the table across steps; see below


@dataclass(slots=True)
class DecodeRequest:
    """Feed one token at ``position``; positions ``0..position-1`` are in the pool."""

    token_id: int  # the token at `position` (the last one sampled)
    position: int  # its absolute position
    block_table: Sequence[int]  # block ids covering at least positions 0..position
    seq_id: int | None = None  # keeps the engine's copy of the table across steps; see below


@dataclass(slots=True)
class StepOutput:
    """Logits of one step (float32, on the engine's device)."""

    prefill_logits: torch.Tensor  # [num_prefills, vocab]: each prompt's last token
    decode_logits: torch.Tensor  # [num_decodes, vocab]
    # Per prefill, [computed tokens, vocab] for positions M..N-1; None unless asked for.
    prefill_all_logits: list[torch.Tensor] | None = None


class StepEngine(Protocol):
    """What a loop that drives prefill and decode steps calls on an engine."""

    tokenizer: Tokenizer  # decodes output for stop strings

    @property
    def block_size(self) -> int:
        """Token positions per KV block."""
        ...

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt and output) the engine holds."""
        ...

    @property
    def device(self) -> torch.device:
        """Where logits (and seeded sampling generators) live."""
        ...

    @property
    def eos_ids(self) -> frozenset[int]:
        """Token ids that end a sequence."""
        ...

    def prefill(self, batch: Sequence[PrefillRequest], *, all_logits: bool = False) -> StepOutput:
        """A step of prefills only."""
        ...

    def decode(self, batch: Sequence[DecodeRequest]) -> torch.Tensor:
        """A step of decodes only; ``[batch, vocab]`` float32 logits."""
        ...

    def forget(self, seq_id: int) -> None:
        """Drop what the engine keeps about sequence ``seq_id``."""
        ...
