"""The replica cost model: prefill and decode time from the computed and cached tokens.

Time comes from FLOPs and bytes, with the model's shape and the GPU's published
peak figures, scaled by an achieved fraction. The defaults are Llama-3.1-8B in
BF16 on one H100 SXM5; docs/sim.md states every figure and where it comes from.
The FLOP count is the one bench/prefill_bench.py uses, so a measured prefill rate
calibrates ``prefill_mfu`` directly. KV tier copies (device <-> host over PCIe, host
<-> disk over NVMe) take bytes over the slowest link on their way, at a datasheet
peak times an achieved fraction; docs/scaling.md states the figures.
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
    pcie_bytes_per_s: float = 63.0e9  # PCIe Gen5 x16, one direction: 32 GT/s x 16 x 128/130 / 8
    pcie_efficiency: float = 0.8  # achieved share in pinned block copies (assumed; ~50 GB/s)
    disk_read_bytes_per_s: float = 6.5e9  # one PCIe Gen4 NVMe drive (Samsung PM9A3 U.2), seq. read
    disk_write_bytes_per_s: float = 3.5e9  # the same drive, sequential write
    disk_efficiency: float = 0.8  # achieved share through memory-mapped files (assumed)

    def __post_init__(self) -> None:
        for name in ("pcie_bytes_per_s", "disk_read_bytes_per_s", "disk_write_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        for name in ("pcie_efficiency", "disk_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be within (0, 1]")

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

    def block_bytes(self, block_size: int) -> int:
        """Bytes of KV one pool block of ``block_size`` tokens holds."""
        return block_size * self.kv_bytes_per_token

    def copy_bytes_per_s(self, src: str, dst: str) -> float:
        """Achieved bandwidth of one block copy from tier ``src`` to tier ``dst``.

        Tiers are named "device", "host", "disk". A copy that touches the device
        crosses PCIe; one that touches the disk crosses the NVMe drive; one that does
        both (disk -> device, staged through host memory) is pipelined, so its rate is
        the slower of the two.
        """
        if src == dst:
            raise ValueError(f"a copy moves a block between two tiers, got {src} -> {dst}")
        rates = []
        if "device" in (src, dst):
            rates.append(self.pcie_bytes_per_s * self.pcie_efficiency)
        if src == "disk":
            rates.append(self.disk_read_bytes_per_s * self.disk_efficiency)
        if dst == "disk":
            rates.append(self.disk_write_bytes_per_s * self.disk_efficiency)
        if not rates:
            raise ValueError(f"unknown tiers in a copy {src} -> {dst}")
        return min(rates)

    @property
    def host_promote_bytes_per_s(self) -> float:
        """Achieved host -> device copy bandwidth (what a host hit's promotion runs at)."""
        return self.copy_bytes_per_s("host", "device")

    @property
    def disk_promote_bytes_per_s(self) -> float:
        """Achieved disk -> device copy bandwidth (what a disk hit's promotion runs at)."""
        return self.copy_bytes_per_s("disk", "device")

    def copy_s(self, src: str, dst: str, nbytes: int) -> float:
        """Seconds to move ``nbytes`` of KV from tier ``src`` to tier ``dst``."""
        return nbytes / self.copy_bytes_per_s(src, dst)
