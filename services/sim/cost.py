"""The replica cost model: prefill and decode time from the computed and cached tokens.

Time comes from FLOPs and bytes, with the model's shape and the GPU's published
peak figures, scaled by an achieved fraction. The defaults are Llama-3.1-8B in
BF16 on one H100 SXM5; docs/sim.md states every figure and where it comes from.
The FLOP count is the one bench/prefill_bench.py uses, so a measured prefill rate
calibrates ``prefill_mfu`` directly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaCostModel:
    """Seconds of prefill and of one decode step on one replica."""

    name: str = "llama-3.1-8b-bf16-h100-sxm"  # what reports call this model
    num_layers: int = 32  # Llama-3.1-8B config.json
    hidden_size: int = 4096  # model width
    num_heads: int = 32  # query heads
    num_kv_heads: int = 8  # key/value heads (GQA)
    head_dim: int = 128  # per head
    intermediate_size: int = 14336  # SwiGLU width
    vocab_size: int = 128256  # lm_head width
    weight_bytes: float = 16.06e9  # BF16 weights read once per decode step
    peak_flops: float = 989e12  # H100 SXM5 dense BF16, NVIDIA datasheet
    hbm_bytes_per_s: float = 3.35e12  # H100 SXM5 HBM3, NVIDIA datasheet
    prefill_mfu: float = 0.5  # achieved share of peak FLOPs in prefill (assumed)
    decode_bw_efficiency: float = 0.7  # achieved share of HBM bandwidth in decode (assumed)
    prefill_overhead_s: float = 0.004  # per prefill: scheduling, launch, sampling (assumed)
    step_overhead_s: float = 0.002  # per decode step (assumed)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, BF16: 128 KiB a token for Llama-3.1-8B."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @property
    def linear_flops_per_token(self) -> float:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        h = self.hidden_size
        return 2.0 * self.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size)

    def prefill_flops(self, computed: int, cached: int) -> float:
        """FLOPs of computing positions ``cached .. cached + computed - 1``.

        Linear layers cost the same per computed token; the token at position ``p``
        attends to ``p + 1`` keys (the cached prefix included), QK^T and PV each
        ``2 * heads * head_dim`` FLOPs per key; the lm_head runs for the last token.
        """
        if computed <= 0:
            return 0.0
        total = cached + computed
        keys = (total * (total + 1) - cached * (cached + 1)) // 2
        attention = self.num_layers * 4 * self.num_heads * self.head_dim * keys
        lm_head = 2 * self.hidden_size * self.vocab_size
        return self.linear_flops_per_token * computed + attention + lm_head

    def prefill_s(self, computed: int, cached: int) -> float:
        """Wall time of one prefill that computes ``computed`` tokens after ``cached`` ones."""
        flops = self.prefill_flops(max(computed, 1), cached)
        return self.prefill_overhead_s + flops / (self.peak_flops * self.prefill_mfu)

    def decode_step_s(self, context_tokens: int) -> float:
        """One decode step of a batch whose sequences hold ``context_tokens`` in total.

        NOTE: decode is bandwidth-bound: each step reads every weight once and the
        KV of every running sequence; the batch's FLOPs are far below peak.
        """
        read = self.weight_bytes + context_tokens * self.kv_bytes_per_token
        return self.step_overhead_s + read / (self.hbm_bytes_per_s * self.decode_bw_efficiency)

    def prefill_tokens_per_s(self, prompt_tokens: int = 8192) -> float:
        """Cold prefill throughput at a prompt length, for reports."""
        return prompt_tokens / self.prefill_s(prompt_tokens, 0)
