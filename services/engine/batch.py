"""What one engine step takes and returns.

``seq_id``: a caller that runs a sequence over many steps names it, and the engine
keeps its block table between steps, reading only the blocks appended since (host
work per step linear in the batch, not the context). The caller must call
``Engine.forget(seq_id)`` when the sequence ends or gets other blocks (a preemption);
``None`` rebuilds the table every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
