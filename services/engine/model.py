"""A Llama-architecture decoder whose attention reads and writes the paged KV pool.

Module and parameter names follow Hugging Face's ``LlamaForCausalLM`` exactly, so a
checkpoint's tensors load by name; Qwen2's ``Qwen2ForCausalLM`` is the same tree plus
q/k/v biases (``ModelConfig.qkv_bias``). Under tensor parallelism each rank builds the same
module tree with its own shard sizes: q/k/v/gate/up hold a slice of the output rows
(column parallel), o/down a slice of the input columns (row parallel, followed by an
all-reduce); embeddings, norms and lm_head are replicated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cachepoint.engine.attention import paged_attention
from cachepoint.engine.attention_plan import AttentionMetadata
from cachepoint.engine.config import ModelConfig
from cachepoint.engine.kv_pool import KVPool
from cachepoint.engine.layer_ops import add_rms_norm_, rms_norm, rotate, silu_and_mul
from cachepoint.engine.linear import linear
from cachepoint.engine.rotary import Rotary, apply_rotary
from cachepoint.engine.weights import RandomWeights, WeightSource

LayerHook = Callable[[int], None]


def _fused(params: list[torch.Tensor]) -> torch.Tensor:
    """One tensor holding ``params`` stacked along dim 0; each param's data becomes a
    view of its rows, so nothing is held twice."""
    fused = torch.cat([p.detach() for p in params])
    row = 0
    for p in params:
        p.data = fused[row : row + p.shape[0]]
        row += p.shape[0]
    return fused


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward_(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``residual += delta`` in place, then the norm of the sum (one pass on a CPU)."""
        return add_rms_norm_(residual, delta, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp_size: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.head_dim = d = config.head_dim
        self.tp_size = tp_size
        h = config.hidden_size
        # NOTE: Qwen2's q/k/v biases are column parallel like their weights: each rank
        # adds its own heads' slice, so no collective is needed for them.
        bias = config.qkv_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        # q, k and v rows in one tensor (see fuse()); None until then.
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        """Put q, k and v in one tensor, their parameters becoming views of it.

        NOTE: one matmul instead of three. At decode the projections are matrix-vector
        products whose cost on a CPU is partly the per-call overhead, 30 layers deep;
        the parameters stay (as views, no extra memory) so that names, state_dict and
        in-place updates work as before.
        """
        parts = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = _fused([p.weight for p in parts])
        if self.q_proj.bias is not None:
            self.qkv_bias = _fused([p.bias for p in parts])

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_weight is None:
            q = linear(x, self.q_proj.weight, self.q_proj.bias)
            k = linear(x, self.k_proj.weight, self.k_proj.bias)
            v = linear(x, self.v_proj.weight, self.v_proj.bias)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:
            heads = self.num_heads + 2 * self.num_kv_heads
            qkv = linear(x, self.qkv_weight, self.qkv_bias).view(t, heads, self.head_dim)
            # NOTE: q and k sit side by side in the fused output: one rotation for both,
            # in place where the CPU kernel runs (qkv is this call's own buffer).
            qk = rotate(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, self.num_heads + self.num_kv_heads :]
        attn = paged_attention(layer, q, k, v, pool, meta)
        out = linear(attn.reshape(t, self.num_heads * self.head_dim), self.o_proj.weight)
        if self.tp_size > 1:
            dist.all_reduce(out)
        return out


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp_size: int) -> None:
        super().__init__()
        h, inner = config.hidden_size, config.intermediate_size // tp_size
        self.tp_size = tp_size
        self.gate_proj = nn.Linear(h, inner, bias=False)
        self.up_proj = nn.Linear(h, inner, bias=False)
        self.down_proj = nn.Linear(inner, h, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # see fuse()

    def fuse(self) -> None:
        """Gate and up rows in one tensor (as in LlamaAttention.fuse)."""
        self.gate_up_weight = _fused([self.gate_proj.weight, self.up_proj.weight])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            gate, up = linear(x, self.gate_proj.weight), linear(x, self.up_proj.weight)
            inner = F.silu(gate) * up
        else:
            inner = silu_and_mul(linear(x, self.gate_up_weight))
        out = linear(inner, self.down_proj.weight)
        if self.tp_size > 1:
            dist.all_reduce(out)
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp_size: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, tp_size)
        self.mlp = LlamaMLP(config, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One layer over the residual stream ``x``, which is updated in place.

        ``delta`` is the previous layer's MLP output, not yet added to ``x`` (None
        before the first layer); this layer's MLP output is returned the same way.
        NOTE: each residual add is left to the norm that follows it, so that on a CPU
        the add and the norm are one pass (:func:`.layer_ops.add_rms_norm_`).
        """
        if delta is None:
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_forward_(x, delta)
        attn = self.self_attn(layer, h, cos, sin, pool, meta)
        out: torch.Tensor = self.mlp(self.post_attention_layernorm.add_forward_(x, attn))
        return out


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp_size) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its output head; call :meth:`hidden` then :meth:`logits`."""

    def __init__(self, config: ModelConfig, tp_size: int = 1) -> None:
        super().__init__()
        if config.num_kv_heads % tp_size or config.intermediate_size % tp_size:
            raise ValueError(
                f"tensor_parallel_size {tp_size} must divide num_kv_heads "
                f"({config.num_kv_heads}) and intermediate_size ({config.intermediate_size})"
            )
        self.config = config
        self.tp_size = tp_size
        self.model = LlamaModel(config, tp_size)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary: Rotary | None = None

    def finish_init(self, device: torch.device) -> None:
        """Build the non-parameter state on ``device``: rotary frequencies and the
        fused projections (after the weights are loaded)."""
        c = self.config
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling, device)
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        pool: KVPool,
        meta: AttentionMetadata,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[tokens, hidden]`` of a packed batch.

        ``layer_hook(i)`` runs before layer ``i``; whatever it raises aborts the forward
        (the pool may then hold partial K/V in the step's slots, which is harmless:
        the scheduler never publishes blocks of a failed step).
        """
        assert self.rotary is not None, "finish_init() was not called"
        # NOTE: the embedding's output is a fresh tensor, so the layers may add into it.
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            if layer_hook is not None:
                layer_hook(i)
            delta = layer(i, x, delta, cos, sin, pool, meta)
        if delta is None:
            return self.model.norm(x)
        return self.model.norm.add_forward_(x, delta)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[rows, vocab]`` logits of final hidden states."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).to(torch.float32)


def build_model(
    config: ModelConfig,
    source: WeightSource | int = 0,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> LlamaForCausalLM:
    """Build rank ``tp_rank``'s shard of the model with weights from ``source``.

    ``source`` is a :class:`WeightSource`, or an int: the seed of random weights.
    Raises ``KeyError`` for a weight the source lacks and ``ValueError`` for a shape
    that does not match the config.
    """
    if isinstance(source, int):
        source = RandomWeights(config, source)
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp_size)
    model.to_empty(device=device)
    model.to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = source.get(name, tp_rank, tp_size)
            if tensor is None:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)} for this config and tp rank"
                )
            param.copy_(tensor.to(device=device, dtype=dtype))
    model.finish_init(device)
    model.eval()
    model.requires_grad_(False)
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters on its device."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
