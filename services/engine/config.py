"""Model shape and engine settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .tokenizer import BYTE_VOCAB_SIZE

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# NOTE: HF configs spell dtypes several ways; we normalise to the torch attribute name
# so `getattr(torch, dtype)` always works downstream.
_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def normalize_dtype(name: str) -> str:
    """Canonical dtype name (``float32``, ``bfloat16`` or ``float16``)."""
    try:
        return _DTYPE_ALIASES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use float32, bfloat16 or float16") from None


def dtype_bytes(name: str) -> int:
    return _DTYPE_BYTES[normalize_dtype(name)]


@dataclass(slots=True)
class ModelConfig:
    """Shape of a Llama-architecture decoder (what a HF ``config.json`` describes)."""

    num_layers: int  # decoder layers
    hidden_size: int  # model width
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA); divides num_heads
    intermediate_size: int  # SwiGLU inner width
    vocab_size: int  # embedding rows / logits width
    rope_theta: float = 10000.0  # rotary base
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    max_position_embeddings: int = 4096  # longest position the model was trained for
    dtype: str = "float32"  # dtype the weights are stored in
    head_dim: int = 0  # per-head width; 0 derives hidden_size // num_heads
    tie_word_embeddings: bool = False  # lm_head shares embed_tokens' weight
    # HF ``rope_scaling`` dict (llama3 / linear), None for plain RoPE.
    rope_scaling: dict[str, Any] | None = field(default=None)
    bos_token_id: int | None = None  # from the checkpoint; None for random models
    eos_token_id: int | None = None  # from the checkpoint; None for random models

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError("hidden_size must be a multiple of num_heads")
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        self.dtype = normalize_dtype(self.dtype)

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A 2-layer toy model over the byte tokenizer: runs in milliseconds on a CPU."""
        params: dict[str, Any] = {
            "num_layers": 2,
            "hidden_size": 64,
            "num_heads": 4,
            "num_kv_heads": 2,
            "intermediate_size": 128,
            "vocab_size": BYTE_VOCAB_SIZE,
            "max_position_embeddings": 8192,
        }
        params.update(overrides)
        return cls(**params)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face Llama ``config.json`` (already parsed)."""
        arch = hf.get("architectures") or []
        if hf.get("model_type", "llama") != "llama" and "LlamaForCausalLM" not in arch:
            raise ValueError(f"not a Llama-architecture checkpoint: {hf.get('model_type')}")
        # NOTE: biases change the weight layout; refusing beats silently dropping them.
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError("checkpoints with attention or MLP biases are not supported")
        num_heads = int(hf["num_attention_heads"])
        eos = hf.get("eos_token_id")
        return cls(
            num_layers=int(hf["num_hidden_layers"]),
            hidden_size=int(hf["hidden_size"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            intermediate_size=int(hf["intermediate_size"]),
            vocab_size=int(hf["vocab_size"]),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            head_dim=int(hf.get("head_dim") or 0),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=hf.get("rope_scaling"),
            bos_token_id=hf.get("bos_token_id"),
            # NOTE: some checkpoints list several EOS ids; the first is the canonical one.
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The inverse of :meth:`from_hf_config` (for writing checkpoint folders)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.dtype,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_scaling": self.rope_scaling,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }

    def kv_bytes_per_token(self, dtype: str | None = None, tp_size: int = 1) -> int:
        """KV bytes one token takes across all layers on one TP rank (K and V)."""
        width = dtype_bytes(dtype or self.dtype)
        return 2 * self.num_layers * (self.num_kv_heads // tp_size) * self.head_dim * width

    def num_parameters(self) -> int:
        """Total parameter count of the unsharded model."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = (
            self.hidden_size * (q + 2 * kv)  # q, k, v
            + q * self.hidden_size  # o
            + 3 * self.hidden_size * self.intermediate_size  # gate, up, down
            + 2 * self.hidden_size  # the two norms
        )
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * per_layer + embed + head + self.hidden_size


@dataclass(slots=True)
class EngineConfig:
    """Runtime settings of one replica's engine (not part of the model's identity)."""

    block_size: int = 16  # tokens per KV block (DESIGN §3)
    device: str = "auto"  # "auto" (CUDA when available), "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # compute + KV dtype; auto = float32 on CPU, bfloat16 on CUDA
    kv_cache_bytes: int = 256 * 2**20  # KV budget per rank on the CPU
    gpu_memory_utilization: float = 0.9  # share of free device memory the engine may use
    max_model_len: int | None = None  # longest sequence; None = max_position_embeddings
    # Largest step the scheduler should send (computed tokens of all its requests); it
    # sizes the GPU activation reserve. The engine does not refuse bigger steps.
    max_num_batched_tokens: int = 8192
    tensor_parallel_size: int = 1  # ranks that split heads and MLP
    dist_timeout_s: float = 300.0  # a collective waiting longer than this fails the group

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.dtype != "auto":
            self.dtype = normalize_dtype(self.dtype)
