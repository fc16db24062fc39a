"""One rank's model shard and KV pool, and how a step becomes a forward pass.

Every tensor parallel rank (the driver included) owns a :class:`ModelRunner` and runs
the same :meth:`ModelRunner.execute` on the same requests; only rank 0 computes logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from .attention import AttentionMetadata, DecodeSpan, PrefillSpan
from .batch import DecodeRequest, PrefillRequest, StepOutput
from .config import EngineConfig, ModelConfig
from .device import resolve_device, resolve_dtype
from .kv_pool import KVPool, KVPoolShape, blocks_for_budget, cuda_kv_budget, slot_mapping
from .model import LayerHook, LlamaForCausalLM, build_model, weight_bytes
from .weights import RandomWeights, WeightSource, open_weights


def activation_reserve_bytes(
    config: ModelConfig, engine: EngineConfig, dtype: torch.dtype, tp_size: int
) -> int:
    """A rough upper bound of one forward's live activations on one rank.

    NOTE: an estimate rather than a profiling run: a profiling forward at start-up
    would need the pool it is sizing. It counts the widest per-token tensors alive at
    once (residual, norms, q/k/v, the MLP's gate and up) plus float32 logits.
    """
    width = torch.empty((), dtype=dtype).element_size()
    d = config.head_dim
    per_token = (
        6 * config.hidden_size
        + (config.num_heads + 2 * config.num_kv_heads) * d // tp_size
        + 3 * config.intermediate_size // tp_size
    )
    logits = 256 * config.vocab_size * 4
    return engine.max_num_batched_tokens * per_token * width + logits


class ModelRunner:
    """A rank's model shard plus its KV pool, sized at construction."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        *,
        model_dir: Path | None = None,
        seed: int = 0,
        tp_rank: int = 0,
    ) -> None:
        self.model_config = model_config
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = config.tensor_parallel_size
        self.device = resolve_device(config.device, tp_rank)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        free_before = 0
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            free_before, _total = torch.cuda.mem_get_info(self.device)
        source: WeightSource
        if model_dir is None:
            source = RandomWeights(model_config, seed)
            self.model = self._build(source)
        else:
            st = open_weights(model_dir, model_config)
            try:
                self.model = self._build(st)
            finally:
                st.close()
        self.pool = KVPool(self._pool_shape(free_before), self.device)

    def _build(self, source: WeightSource) -> LlamaForCausalLM:
        return build_model(
            self.model_config,
            source,
            device=self.device,
            dtype=self.dtype,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )

    def _pool_shape(self, free_before: int) -> KVPoolShape:
        mc, ec = self.model_config, self.config
        probe = KVPoolShape(
            num_layers=mc.num_layers,
            num_blocks=0,
            block_size=ec.block_size,
            num_kv_heads=mc.num_kv_heads // self.tp_size,
            head_dim=mc.head_dim,
            dtype=self.dtype,
        )
        if self.device.type == "cuda":
            budget = cuda_kv_budget(
                free_before,
                ec.gpu_memory_utilization,
                weight_bytes(self.model),
                activation_reserve_bytes(mc, ec, self.dtype, self.tp_size),
            )
        else:
            budget = ec.kv_cache_bytes
        min_blocks = math.ceil(self.max_model_len / ec.block_size)
        num_blocks = blocks_for_budget(budget, probe.bytes_per_block, min_blocks)
        if self.tp_size > 1:
            # NOTE: one logical block table for the whole group, so every rank must
            # have the same number of blocks: the smallest GPU decides.
            n = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MIN)
            num_blocks = int(n.item())
        return KVPoolShape(
            num_layers=probe.num_layers,
            num_blocks=num_blocks,
            block_size=probe.block_size,
            num_kv_heads=probe.num_kv_heads,
            head_dim=probe.head_dim,
            dtype=probe.dtype,
        )

    def _metadata(
        self, prefills: Sequence[PrefillRequest], decodes: Sequence[DecodeRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Packed input ids, positions and attention metadata, built with index tensors."""
        dev, bs = self.device, self.pool.block_size
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        spans: list[PrefillSpan] = []
        row = 0
        for r in prefills:
            n, m = len(r.token_ids), r.num_cached_tokens
            table = torch.tensor(r.block_table[: math.ceil(n / bs)], dtype=torch.long, device=dev)
            ids.extend(r.token_ids[m:])
            positions.append(torch.arange(m, n, dtype=torch.long, device=dev))
            slots.append(slot_mapping(table, m, n, bs))
            spans.append(PrefillSpan(row, row + n - m, n, table))
            row += n - m
        decode: DecodeSpan | None = None
        if decodes:
            length = max(d.position for d in decodes) + 1
            nb = math.ceil(length / bs)
            # NOTE: shorter tables are padded with block 0; the mask hides those lanes.
            table = torch.tensor(
                [
                    list(d.block_table[:nb]) + [0] * (nb - min(nb, len(d.block_table)))
                    for d in decodes
                ],
                dtype=torch.long,
                device=dev,
            )
            # NOTE: attention reads whole blocks (nb * bs positions); the mask hides the
            # tail of each lane's last block and the padded lanes' blocks.
            lane = torch.arange(nb * bs, dtype=torch.long, device=dev)
            pos = torch.tensor([d.position for d in decodes], dtype=torch.long, device=dev)
            mask = (lane[None, :] <= pos[:, None])[:, None, None, :]
            ids.extend(d.token_id for d in decodes)
            positions.append(pos)
            slots.append(table.gather(1, (pos // bs)[:, None]).squeeze(1) * bs + pos % bs)
            decode = DecodeSpan(row, table, mask)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        meta = AttentionMetadata(torch.cat(slots), spans, decode)
        return input_ids, torch.cat(positions), meta

    def execute(
        self,
        prefills: Sequence[PrefillRequest],
        decodes: Sequence[DecodeRequest],
        *,
        all_logits: bool = False,
        layer_hook: LayerHook | None = None,
    ) -> StepOutput | None:
        """Run one packed forward; rank 0 returns logits, other ranks None.

        Requests must already be validated (the driver's :class:`Engine` does it).
        """
        with torch.inference_mode():
            input_ids, positions, meta = self._metadata(prefills, decodes)
            hidden = self.model.hidden(input_ids, positions, self.pool, meta, layer_hook)
            if self.device.type == "cuda":
                # NOTE: kernels run asynchronously; waiting here makes a device error
                # surface from this step, before the scheduler publishes its blocks.
                torch.cuda.synchronize(self.device)
            if self.tp_rank != 0:
                return None
            last = [s.end - 1 for s in meta.prefills]
            if meta.decode is not None:
                last.extend(range(meta.decode.start, hidden.shape[0]))
            rows = torch.tensor(last, dtype=torch.long, device=self.device)
            logits = self.model.logits(hidden.index_select(0, rows))
            n_pre = len(meta.prefills)
            every: list[torch.Tensor] | None = None
            if all_logits:
                every = [self.model.logits(hidden[s.start : s.end]) for s in meta.prefills]
            return StepOutput(logits[:n_pre], logits[n_pre:], every)
