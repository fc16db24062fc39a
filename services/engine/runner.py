"""One rank's model shard and KV pool, and how a step becomes a forward pass.

Every tensor parallel rank (the driver included) owns a :class:`ModelRunner` and runs
the same :meth:`ModelRunner.execute` on the same requests; only rank 0 computes logits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from cachepoint.engine import cpu_kernels, host_malloc
from cachepoint.engine.attention_cuda import cuda_paged_attention_available
from cachepoint.engine.attention_plan import (
    AttentionMetadata,
    DecodeSpan,
    PrefillSpan,
    bridge_limit,
    plan_decode,
    plan_prefill,
    plan_varlen,
)
from cachepoint.engine.batch import DecodeRequest, PrefillRequest, StepOutput
from cachepoint.engine.block_tables import BlockTables, SeqTable
from cachepoint.engine.config import EngineConfig, ModelConfig
from cachepoint.engine.device import resolve_device, resolve_dtype
from cachepoint.engine.kv_copy import CopyHook
from cachepoint.engine.kv_pool import KVPool, KVPoolShape, blocks_for_budget, cuda_kv_budget
from cachepoint.engine.kv_tiers import STAGING_BYTES, KVTiers, TierError
from cachepoint.engine.model import LayerHook, LlamaForCausalLM, build_model, weight_bytes
from cachepoint.engine.weights import RandomWeights, WeightSource, open_weights

log = logging.getLogger(__name__)


def activation_reserve_bytes(
    config: ModelConfig, engine: EngineConfig, dtype: torch.dtype, tp_size: int
) -> int:
    """A rough upper bound of one forward's live activations on one rank.

    NOTE: on CUDA a profiling forward measures the real figure (``ModelRunner.
    _profile_forward_bytes``); this estimate is its floor, and the reserve elsewhere. It
    counts the widest per-token tensors alive at
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
        if self.device.type == "cpu":
            host_malloc.tune()  # activations stay in the heap between ops and steps
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
        # NOTE: on CUDA one paged varlen kernel reads the block tables itself; where it
        # cannot run (block size, dtype, GPU generation) attention takes the portable
        # path of runs and gathers, and the reason is logged once.
        self.paged_kernel = False
        if self.device.type == "cuda":
            self.paged_kernel, why = cuda_paged_attention_available(config.block_size, self.dtype)
            if not self.paged_kernel:
                log.warning("CUDA paged attention kernel not used: %s", why)
        self._bridge = 0  # foreign blocks a decode view may mask (set with the pool)
        # NOTE: on the CPU our decode kernel reads each lane's table itself (float32);
        # elsewhere, or where it cannot load, decode plans runs, views and gathers.
        self._cpu_paged_decode = self.device.type == "cpu" and self._decode_kernel_fits()
        reserve = 0
        if self.device.type == "cuda":
            reserve = self._profile_forward_bytes()
            if config.tier_slots("host", 1) or config.tier_slots("disk", 1):
                reserve += STAGING_BYTES  # what a tier copy stages on the device
        self.pool = KVPool(self._pool_shape(free_before, reserve), self.device)
        shape = self.pool.shape
        self._bridge = bridge_limit(shape.bytes_per_block // shape.num_layers)
        self.tables = BlockTables(self.pool.num_blocks)  # persistent, keyed by seq_id
        self.tiers = self._build_tiers()

    def _decode_kernel_fits(self) -> bool:
        c, tp = self.model_config, self.tp_size
        if self.dtype != torch.float32:  # the pool shares the model's dtype
            return False
        probe = torch.empty(1, c.num_heads // tp, c.head_dim)
        return cpu_kernels.paged_decode_supported(probe, torch.float32, c.num_kv_heads // tp)

    def _build_tiers(self) -> KVTiers:
        """This rank's host and disk tiers; with TP, every rank fails if one does.

        NOTE: agreed with an all-reduce: a rank whose tier cannot be set up (a full
        disk) would otherwise leave the others waiting for it until the group's
        timeout.
        """
        config, per_block = self.config, self.pool.shape.bytes_per_block
        tiers: KVTiers | None = None
        error: Exception | None = None
        try:
            tiers = KVTiers(
                self.pool,
                host_slots=config.tier_slots("host", per_block),
                disk_path=config.disk_kv_path,
                disk_slots=config.tier_slots("disk", per_block),
                rank=self.tp_rank,
            )
        except Exception as exc:  # NOTE: re-raised below, after the other ranks know
            error = exc
        failed = error is not None
        if self.tp_size > 1:
            flag = torch.tensor([int(failed)], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            failed = bool(flag.item())
        if error is not None:
            raise error
        if failed or tiers is None:
            if tiers is not None:
                tiers.close()
            raise TierError("a KV tier could not be set up on another tensor parallel rank")
        return tiers

    def profile_forward(self) -> KVPool:
        """Run the largest forward a step may run (a ``max_num_batched_tokens`` prefill,
        logits included) on a throwaway pool just big enough; returns that pool.

        The real pool and tables are untouched (the runner's are restored after).
        """
        ec = self.config
        n = min(ec.max_num_batched_tokens, self.max_model_len)
        blocks = math.ceil(n / ec.block_size)
        probe = KVPool(self._shape(blocks), self.device)
        saved = (getattr(self, "pool", None), getattr(self, "tables", None))
        self.pool, self.tables = probe, BlockTables(blocks)
        try:
            prompt = [0] * n
            self.execute([PrefillRequest(prompt, list(range(blocks)))], [])
        finally:
            if saved[0] is not None and saved[1] is not None:
                self.pool, self.tables = saved[0], saved[1]
        return probe

    def _profile_forward_bytes(self) -> int:
        """Peak CUDA memory of :meth:`profile_forward` beyond the weights and its own
        pool: every activation and scratch buffer a step can need."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        probe = self.profile_forward()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base - probe.nbytes
        del probe
        torch.cuda.empty_cache()
        log.info("profiled forward: %.1f MiB of activations and scratch", peak / 2**20)
        return max(0, peak)

    def _build(self, source: WeightSource) -> LlamaForCausalLM:
        return build_model(
            self.model_config,
            source,
            device=self.device,
            dtype=self.dtype,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )

    def _shape(self, num_blocks: int) -> KVPoolShape:
        mc, ec = self.model_config, self.config
        return KVPoolShape(
            num_layers=mc.num_layers,
            num_blocks=num_blocks,
            block_size=ec.block_size,
            num_kv_heads=mc.num_kv_heads // self.tp_size,
            head_dim=mc.head_dim,
            dtype=self.dtype,
        )

    def _pool_shape(self, free_before: int, profiled: int) -> KVPoolShape:
        """The pool's shape: on CUDA from the memory left after the weights and the
        profiled forward (``profiled`` bytes), elsewhere from ``kv_cache_bytes``."""
        mc, ec = self.model_config, self.config
        probe = self._shape(0)
        if self.device.type == "cuda":
            # NOTE: the estimate stays as a floor: allocator fragmentation and the
            # decode steps' shapes are not in one profiling prefill.
            estimate = activation_reserve_bytes(mc, ec, self.dtype, self.tp_size)
            budget = cuda_kv_budget(
                free_before,
                ec.gpu_memory_utilization,
                weight_bytes(self.model),
                max(profiled, estimate),
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
        return self._shape(num_blocks)

    def copy_blocks(self, copies: Sequence[object], hook: CopyHook | None = None) -> None:
        """Run block copies between tiers, in order (see :meth:`KVTiers.copy`); the
        next :meth:`execute` waits for them before its forward."""
        self.tiers.copy(copies, hook)

    def forget(self, seq_ids: Sequence[int]) -> None:
        """Drop the persistent tables of sequences that ended or were reallocated."""
        for seq_id in seq_ids:
            self.tables.forget(seq_id)

    def _metadata(
        self, prefills: Sequence[PrefillRequest], decodes: Sequence[DecodeRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Packed input ids, positions and attention metadata.

        NOTE: host work here is per sequence and per run of blocks, never per cached
        block: tables come from :class:`BlockTables`, which only reads what a sequence
        appended since its last step.
        """
        dev, bs = self.device, self.pool.block_size
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        spans: list[PrefillSpan] = []
        kernel_rows: list[tuple[SeqTable, tuple[int, int]]] = []  # (table, (queries, keys))
        row = 0
        for i, r in enumerate(prefills):
            n, m = len(r.token_ids), r.num_cached_tokens
            table = self.tables.get(r.seq_id, r.block_table, -(-n // bs), f"prefill {i}")
            kernel_rows.append((table, (n - m, n)))
            ids.extend(r.token_ids[m:])
            first = m // bs
            new_blocks = torch.tensor(table.blocks[first : -(-n // bs)], dtype=torch.long)
            pos = torch.arange(m, n, dtype=torch.long)
            slots.append(new_blocks[pos // bs - first] * bs + pos % bs)
            positions.append(pos)
            spans.append(plan_prefill(table, row, row + n - m, m, n, bs, dev))
            row += n - m
        decode: DecodeSpan | None = None
        if decodes:
            tables = [
                self.tables.get(d.seq_id, d.block_table, d.position // bs + 1, f"decode {i}")
                for i, d in enumerate(decodes)
            ]
            at = [d.position for d in decodes]
            kernel_rows.extend((t, (1, p + 1)) for t, p in zip(tables, at, strict=True))
            decode, decode_slots = plan_decode(
                tables, at, row, bs, dev, self._bridge, paged=self._cpu_paged_decode
            )
            ids.extend(d.token_id for d in decodes)
            positions.append(torch.tensor(at, dtype=torch.long))
            slots.append(torch.tensor(decode_slots, dtype=torch.long))
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        meta = AttentionMetadata(torch.cat(slots).to(dev), spans, decode)
        if self.paged_kernel:
            tabs = [t for t, _ in kernel_rows]
            rows = [q for _, (q, _) in kernel_rows]
            keys = [k for _, (_, k) in kernel_rows]
            meta.varlen = plan_varlen(tabs, rows, keys, dev)
        return input_ids, torch.cat(positions).to(dev), meta

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
            # NOTE: this step's block copies land before attention; there are no tiers
            # yet during the profiling forward, which runs before they are built.
            tiers: KVTiers | None = getattr(self, "tiers", None)
            if tiers is not None:
                tiers.wait_ready()
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
            if len(last) == hidden.shape[0]:  # every row samples (a decode-only step)
                logits = self.model.logits(hidden)
            else:
                rows = torch.tensor(last, dtype=torch.long, device=self.device)
                logits = self.model.logits(hidden.index_select(0, rows))
            n_pre = len(meta.prefills)
            every: list[torch.Tensor] | None = None
            if all_logits:
                every = [self.model.logits(hidden[s.start : s.end]) for s in meta.prefills]
            return StepOutput(logits[:n_pre], logits[n_pre:], every)
