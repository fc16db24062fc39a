"""Model shape and engine settings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachepoint.engine.tokenizer import BYTE_VOCAB_SIZE

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


# Model families whose Hugging Face checkpoints load: HF ``model_type`` -> its class.
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# RoPE variants rotary.py implements (HF ``rope_type``), with the keys each one needs.
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def normalize_rope_scaling(
    scaling: dict[str, Any] | None, max_position_embeddings: int
) -> dict[str, Any] | None:
    """A validated ``{"rope_type": ..., <its keys>}`` dict, or None for plain RoPE.

    Raises ``ValueError`` naming the type for any variant rotary.py cannot compute:
    serving it as plain RoPE would give wrong logits without a word.
    """
    if not scaling:
        return None
    kind = str(scaling.get("rope_type", scaling.get("type", "default")))
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    if float(scaling.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError("partial_rotary_factor other than 1.0 is not supported")
    if kind == "default":
        return None
    out: dict[str, Any] = {"rope_type": kind}
    for key in ROPE_TYPES[kind]:
        value = scaling.get(key)
        # NOTE: transformers falls back to max_position_embeddings for llama3's
        # original length; so do we.
        if value is None and key == "original_max_position_embeddings":
            value = max_position_embeddings
        if value is None:
            raise ValueError(f"rope_type {kind!r} needs {key!r} in its rope parameters")
        out[key] = int(value) if key == "original_max_position_embeddings" else float(value)
    return out


def _hf_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope base, scaling)`` from either Hugging Face config layout.

    transformers 4 writes ``rope_theta`` at the top level and any scaling under
    ``rope_scaling``; transformers 5 writes both under ``rope_parameters`` (with its
    ``rope_type``). Where both appear, ``rope_parameters`` wins, as in transformers.
    """
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(legacy, dict):
        raise ValueError("rope_parameters and rope_scaling must be JSON objects")
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type rope_parameters ({', '.join(params)}) are not supported")
    merged = {**legacy, **params}
    theta = merged.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    if hf.get("partial_rotary_factor") is not None:
        merged.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    max_pos = int(hf.get("max_position_embeddings") or 4096)
    return float(theta), normalize_rope_scaling(merged, max_pos)


def _hf_family(hf: dict[str, Any]) -> str:
    """The checkpoint's family (a FAMILIES key), or ``ValueError`` naming what it is."""
    arch = hf.get("architectures") or []
    for family, cls in FAMILIES.items():
        if cls in arch:
            return family
    model_type = hf.get("model_type", "llama")
    if model_type in FAMILIES:
        return str(model_type)
    raise ValueError(
        f"unsupported architecture: model_type {model_type!r}, architectures {arch} "
        f"(supported: {', '.join(FAMILIES.values())})"
    )


def _required(hf: dict[str, Any], key: str) -> int:
    if hf.get(key) is None:
        raise ValueError(f"config.json lacks {key!r}")
    return int(hf[key])


def eos_ids(raw: Any) -> tuple[int, ...]:
    """EOS ids as a config spells them: an int, a list of ints, or absent (None)."""
    if raw is None:
        return ()
    values = raw if isinstance(raw, list) else [raw]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"eos_token_id must be a token id or a list of them, not {raw!r}")
    return tuple(values)


def generation_eos_ids(folder: Path | str | None) -> tuple[int, ...]:
    """The EOS ids of a checkpoint folder's ``generation_config.json`` (what
    transformers' ``generate`` stops on); () without one, or for a GGUF file."""
    if folder is None:
        return ()
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return ()
    raw = json.loads(path.read_text())
    return eos_ids(raw.get("eos_token_id") if isinstance(raw, dict) else None)


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
    """Shape of a Llama-style decoder (what a HF ``config.json`` describes).

    Covers the FAMILIES: Llama, and Qwen2/Qwen2.5 (Llama plus q/k/v projection biases).
    """

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
    # RoPE scaling as {"rope_type": "linear" | "llama3", <its keys>}; None for plain RoPE.
    rope_scaling: dict[str, Any] | None = field(default=None)
    bos_token_id: int | None = None  # from the checkpoint; None for random models
    eos_token_id: int | None = None  # from the checkpoint; None for random models
    # Every id that ends a turn (config.json's list, generation_config.json's, a GGUF's
    # eot/eom), eos_token_id first; () for random models.
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"  # family, a FAMILIES key (what to_hf_config writes)
    qkv_bias: bool = False  # q/k/v projections carry biases (Qwen2); o/MLP never do

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r} (supported: {', '.join(FAMILIES)})"
            )
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError("hidden_size must be a multiple of num_heads")
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        self.dtype = normalize_dtype(self.dtype)
        # NOTE: eos_token_id stays the canonical first of eos_token_ids, whichever of
        # the two a caller set (replace() re-runs this, so they never drift apart).
        ids = tuple(dict.fromkeys(int(i) for i in self.eos_token_ids))
        if self.eos_token_id is not None:
            ids = (self.eos_token_id, *(i for i in ids if i != self.eos_token_id))
        elif ids:
            self.eos_token_id = ids[0]
        self.eos_token_ids = ids

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
    def from_hf_config(
        cls, hf: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Read a Hugging Face Llama or Qwen2 ``config.json`` (already parsed), and its
        ``generation_config.json`` when given (only its EOS ids are read).

        Raises ``ValueError`` for anything the engine would compute differently from
        the checkpoint's own code (another family, biases, sliding windows, an
        unsupported rope type): refusing beats serving wrong logits silently.
        """
        family = _hf_family(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        if family == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
            # NOTE: Llama's attention_bias also biases o_proj, which we do not model.
            raise ValueError("Llama checkpoints with attention or MLP biases are not supported")
        num_layers = _required(hf, "num_hidden_layers")
        if family == "qwen2":
            # NOTE: Qwen2 slides a window over layers >= max_window_layers, and only
            # when use_sliding_window is set; transformers 5 spells that out in
            # layer_types. Released Qwen2/2.5 checkpoints leave it off.
            layer_types = hf.get("layer_types")
            if layer_types is None:
                first = hf.get("max_window_layers")
                first = 28 if first is None else int(first)  # transformers' default
                sliding = (
                    bool(hf.get("use_sliding_window"))
                    and hf.get("sliding_window") is not None
                    and first < num_layers
                )
            else:
                sliding = "sliding_attention" in layer_types
            if sliding:
                raise ValueError("sliding-window attention (use_sliding_window) is not supported")
        num_heads = _required(hf, "num_attention_heads")
        rope_theta, rope_scaling = _hf_rope(hf)
        eos = (*eos_ids(hf.get("eos_token_id")), *eos_ids((generation or {}).get("eos_token_id")))
        return cls(
            num_layers=num_layers,
            hidden_size=_required(hf, "hidden_size"),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            intermediate_size=_required(hf, "intermediate_size"),
            vocab_size=_required(hf, "vocab_size"),
            rope_theta=rope_theta,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 4096),
            dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            head_dim=int(hf.get("head_dim") or 0),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            bos_token_id=hf.get("bos_token_id"),
            # NOTE: some checkpoints list several EOS ids (Llama 3: end_of_text, eom,
            # eot); any of them ends a turn, and the first is the canonical one.
            eos_token_id=eos[0] if eos else None,
            eos_token_ids=eos,
            model_type=family,
            # NOTE: Qwen2's q/k/v biases are fixed by its code, not a config key.
            qkv_bias=family == "qwen2",
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The inverse of :meth:`from_hf_config` (for writing checkpoint folders).

        Written in the transformers 4 layout (top-level ``rope_theta``), which both
        transformers 4 and 5 read.
        """
        if self.model_type == "llama" and self.qkv_bias:
            raise ValueError("a Llama config.json cannot express q/k/v-only biases")
        family: dict[str, Any] = (
            {"attention_bias": False, "mlp_bias": False}
            if self.model_type == "llama"
            else {
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": self.num_layers,
            }
        )
        return {
            "architectures": [FAMILIES[self.model_type]],
            "model_type": self.model_type,
            **family,
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
            "eos_token_id": (
                list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_id
            ),
            "hidden_act": "silu",
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
            + ((q + 2 * kv) if self.qkv_bias else 0)  # q, k, v biases
        )
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * per_layer + embed + head + self.hidden_size


@dataclass(slots=True)
class EngineConfig:
    """Runtime settings of one replica's engine (not part of the model's identity)."""

    block_size: int = 16  # tokens per KV block (contract §3)
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
    # KV tiers behind the device pool (kv_tiers.py), per rank; all off by default. Size
    # each in blocks (slots) or in bytes (whole blocks of this rank's shard), not both.
    host_kv_slots: int = 0  # blocks of the host-memory tier
    host_kv_bytes: int = 0  # or its budget in bytes
    disk_kv_path: str | None = None  # an existing directory for the disk tier's file
    disk_kv_slots: int = 0  # blocks of the disk tier
    disk_kv_bytes: int = 0  # or its budget in bytes

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.dtype != "auto":
            self.dtype = normalize_dtype(self.dtype)
        for tier in ("host", "disk"):
            slots, size = getattr(self, f"{tier}_kv_slots"), getattr(self, f"{tier}_kv_bytes")
            if slots < 0 or size < 0:
                raise ValueError(f"{tier}_kv_slots and {tier}_kv_bytes must be >= 0")
            if slots and size:
                raise ValueError(f"set {tier}_kv_slots or {tier}_kv_bytes, not both")
        if (self.disk_kv_slots or self.disk_kv_bytes) and not self.disk_kv_path:
            raise ValueError("a disk KV tier needs disk_kv_path")

    def tier_slots(self, tier: str, bytes_per_block: int) -> int:
        """Blocks of the ``"host"`` or ``"disk"`` tier, given one block's bytes."""
        slots: int = getattr(self, f"{tier}_kv_slots")
        size: int = getattr(self, f"{tier}_kv_bytes")
        return slots or size // bytes_per_block
