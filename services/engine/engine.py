"""The engine the scheduler drives: batched prefill-with-reuse and decode over block ids.

The engine does not own block allocation: the scheduler (through kvcore's
``BlockPool``) hands it block tables of ids ``0..num_blocks-1``, and the engine reads
and writes exactly the slots those tables name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import torch

from cachepoint.engine.batch import DecodeRequest, PrefillRequest, StepOutput
from cachepoint.engine.config import EngineConfig, ModelConfig, generation_eos_ids
from cachepoint.engine.device import resolve_device
from cachepoint.engine.generate import Allocator, GenerationRequest, GenerationResult, generate
from cachepoint.engine.kv_copy import Copy, CopyHook
from cachepoint.engine.model import LayerHook
from cachepoint.engine.runner import ModelRunner
from cachepoint.engine.tokenizer import Tokenizer, load_tokenizer
from cachepoint.engine.tp import (
    StepPlan,
    TPWorkers,
    broadcast_plan,
    copies_failed_anywhere,
    driver_layer_hook,
    init_group,
)
from cachepoint.engine.weights import read_model_config


class Engine:
    """A replica's model and KV pool (rank 0 of its TP group when ``tensor_parallel_size > 1``).

    Build it from a config (random weights from ``seed``) or a HF checkpoint folder::

        engine = Engine(ModelConfig.tiny(), EngineConfig(kv_cache_bytes=64 << 20))
        engine = Engine(config=EngineConfig(), model_dir=Path("/models/llama"))

    With ``tensor_parallel_size > 1`` the constructor spawns the other ranks and
    :meth:`close` (or leaving a ``with`` block) stops them.

    ``fault_hook``, when set, is called with each layer index before that layer runs,
    in every forward; whatever it raises propagates out of :meth:`step`.
    ``copy_fault_hook``, when set, is called before each unit of a batch of block
    copies with the batch position of its first op (see :mod:`.kv_tiers`); whatever it
    raises propagates out of :meth:`step` (before the forward runs: no KV is written by
    it) or :meth:`copy_blocks`. The destinations of a failed batch hold garbage and
    must not be published (kvcore's ``finish_copies(ok=False)``).

    KV tiers (``EngineConfig.host_kv_slots``/``disk_kv_*``): a host-memory tier and a
    disk-file tier behind the pool, per rank; blocks move between them only through
    the copies passed to :meth:`step` or :meth:`copy_blocks`. What memory each takes
    is in :mod:`.kv_tiers`.

    NOTE: not thread-safe: one driver thread calls :meth:`step` at a time (the
    scheduler's engine loop), which is also what keeps TP ranks in lockstep.
    """

    def __init__(
        self,
        model_config: ModelConfig | None = None,
        config: EngineConfig | None = None,
        *,
        model_dir: Path | str | None = None,
        seed: int = 0,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """``tokenizer``: a random model's (default: the checkpoint's, or bytes)."""
        self.config = config = config or EngineConfig()
        folder = None if model_dir is None else Path(model_dir)
        if model_config is None:
            model_config = ModelConfig.tiny() if folder is None else read_model_config(folder)
        self.model_config = model_config
        self.model_dir = folder  # None for a random-weight model
        self.tokenizer: Tokenizer = tokenizer or load_tokenizer(folder)
        if self.tokenizer.vocab_size > model_config.vocab_size:
            raise ValueError(
                f"tokenizer has {self.tokenizer.vocab_size} ids but the model only "
                f"{model_config.vocab_size} embeddings"
            )
        # NOTE: every id that ends a turn: the tokenizer's EOS (what generation has
        # always stopped on), the config's list, and generation_config.json's, which
        # weights.read_model_config does not read.
        ids = (self.tokenizer.eos_id, *model_config.eos_token_ids, *generation_eos_ids(folder))
        self._eos_ids = frozenset(i for i in ids if i is not None)
        self.fault_hook: LayerHook | None = None  # see the class docstring
        self.copy_fault_hook: CopyHook | None = None  # see the class docstring
        self._workers: TPWorkers | None = None
        self._forgotten: list[int] = []  # seq ids the TP workers have yet to forget
        self._threads_before: int | None = None
        if config.tensor_parallel_size == 1:
            self.runner = ModelRunner(model_config, config, model_dir=folder, seed=seed)
        else:
            self.runner = self._start_tp(model_config, config, folder, seed)

    def _start_tp(
        self, model_config: ModelConfig, config: EngineConfig, folder: Path | None, seed: int
    ) -> ModelRunner:
        world = config.tensor_parallel_size
        device = resolve_device(config.device, 0)
        self._workers = TPWorkers.spawn(model_config, config, folder, seed)
        if device.type == "cpu":
            # NOTE: the workers take their share of the cores; so does this process
            # while it is rank 0 (restored by close()).
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, self._threads_before // world))
        try:
            init_group(0, world, self._workers.port, device, config.dist_timeout_s)
            return ModelRunner(model_config, config, model_dir=folder, seed=seed, tp_rank=0)
        except BaseException:
            self.close()
            raise

    # -- facts the scheduler sizes kvcore's BlockPool from --------------------------

    @property
    def num_blocks(self) -> int:
        """Block ids are ``0..num_blocks-1`` (the same on every TP rank)."""
        return self.runner.pool.num_blocks

    @property
    def block_size(self) -> int:
        return self.runner.pool.block_size

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def eos_id(self) -> int | None:
        eos = self.tokenizer.eos_id
        return self.model_config.eos_token_id if eos is None else eos

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every id that ends a sequence (unless ``ignore_eos``): ``eos_id`` and the
        checkpoint's other EOS ids."""
        eos = self.eos_id
        return self._eos_ids if eos is None or eos in self._eos_ids else self._eos_ids | {eos}

    @property
    def kv_pool_bytes(self) -> int:
        """KV bytes held on this rank."""
        return self.runner.pool.nbytes

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one block takes on this rank (in every tier)."""
        return self.runner.pool.shape.bytes_per_block

    @property
    def host_kv_slots(self) -> int:
        """Blocks the host tier holds (0: none); slot ids ``0..host_kv_slots-1``."""
        return self.runner.tiers.sizes["host"]

    @property
    def disk_kv_slots(self) -> int:
        """Blocks the disk tier holds (0: none); slot ids ``0..disk_kv_slots-1``."""
        return self.runner.tiers.sizes["disk"]

    @property
    def host_kv_bytes(self) -> int:
        """Host memory the host tier takes on this rank."""
        return self.runner.tiers.host_bytes

    @property
    def disk_kv_bytes(self) -> int:
        """Disk the disk tier's file takes on this rank."""
        return self.runner.tiers.disk_bytes

    # -- steps -----------------------------------------------------------------------

    def _check_table(
        self, seq_id: int | None, table: Sequence[int], num_tokens: int, what: str
    ) -> None:
        # NOTE: through the driver's persistent tables, which validate each block once,
        # when it is appended: by the time the step is broadcast to TP workers, every
        # block id they will read has been checked here.
        self.runner.tables.get(seq_id, table, math.ceil(num_tokens / self.block_size), what)

    def _check_tokens(self, ids: Sequence[int], what: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise ValueError(f"{what}: token ids must be in 0..{self.vocab_size - 1}")

    def validate(
        self, prefills: Sequence[PrefillRequest], decodes: Sequence[DecodeRequest]
    ) -> None:
        """Raise ``ValueError`` for a request the forward pass could not run."""
        if not prefills and not decodes:
            raise ValueError("a step needs at least one prefill or decode")
        for i, p in enumerate(prefills):
            what, n = f"prefill {i}", len(p.token_ids)
            if not 0 <= p.num_cached_tokens < n:
                raise ValueError(
                    f"{what}: num_cached_tokens {p.num_cached_tokens} must be in 0..{n - 1} "
                    "(the last token is always computed, for its logits)"
                )
            if n > self.max_model_len:
                raise ValueError(f"{what}: {n} tokens exceed max_model_len {self.max_model_len}")
            self._check_tokens(p.token_ids, what)
            self._check_table(p.seq_id, p.block_table, n, what)
        for i, d in enumerate(decodes):
            what = f"decode {i}"
            if not 0 <= d.position < self.max_model_len:
                raise ValueError(f"{what}: position {d.position} outside the model's context")
            self._check_tokens([d.token_id], what)
            self._check_table(d.seq_id, d.block_table, d.position + 1, what)

    def step(
        self,
        prefills: Sequence[PrefillRequest] = (),
        decodes: Sequence[DecodeRequest] = (),
        *,
        copies: Sequence[object] = (),
        all_logits: bool = False,
    ) -> StepOutput:
        """Block copies between tiers, then one forward over prefills and decodes
        together (continuous batching).

        ``copies`` (objects with ``src_tier``, ``src_index``, ``dst_tier`` and
        ``dst_index``, e.g. kvcore's ``BlockCopy``) run in order on every rank before
        the forward, which reads their destinations; a later copy may overwrite the
        source of an earlier one. Everything, copies included, is validated before
        anything runs.

        Each prefill computes positions ``num_cached_tokens..N-1`` against the K/V of
        ``0..num_cached_tokens-1`` read from its blocks, and writes the new K/V into its
        blocks; each decode writes and attends the same way for one token. Logits come
        back for each prefill's last token and each decode (and, with ``all_logits``,
        for every computed prefill token).
        """
        prefills, decodes = list(prefills), list(decodes)
        ops = self.runner.tiers.check(copies)
        self.validate(prefills, decodes)
        hook = self.fault_hook
        if self._workers is not None:
            forget, self._forgotten = self._forgotten, []
            plan = StepPlan(
                prefills=prefills,
                decodes=decodes,
                check_faults=hook is not None,
                forget=forget,
                copies=ops,
            )
            broadcast_plan(plan, self.device)
            if hook is not None:
                hook = driver_layer_hook(hook, self.device)
        self._run_copies(ops)
        out = self.runner.execute(prefills, decodes, all_logits=all_logits, layer_hook=hook)
        assert out is not None, "rank 0 always returns logits"
        return out

    def copy_blocks(self, copies: Sequence[object]) -> None:
        """Run block copies between tiers without a forward, on every rank; they have
        finished on this rank when it returns (the caller may publish them then)."""
        ops = self.runner.tiers.check(copies)
        if not ops:
            return
        if self._workers is not None:
            forget, self._forgotten = self._forgotten, []
            broadcast_plan(StepPlan(forget=forget, copies=ops), self.device)
        self._run_copies(ops)
        self.runner.tiers.synchronize()

    def _run_copies(self, ops: list[Copy]) -> None:
        """Rank 0's copies; with TP, every rank learns whether all of them succeeded."""
        if not ops:
            return
        error: BaseException | None = None
        try:
            self.runner.copy_blocks(ops, self.copy_fault_hook)
        except BaseException as exc:  # NOTE: re-raised below, after the workers know
            error = exc
        failed = error is not None
        if self._workers is not None:
            failed = copies_failed_anywhere(failed, self.device)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError("block copies failed on a tensor parallel worker; step not run")

    def forget(self, seq_id: int) -> None:
        """Drop what the engine keeps about sequence ``seq_id`` (its block table): call
        it when the sequence ends or is given other blocks."""
        self.runner.forget([seq_id])
        if self._workers is not None:
            self._forgotten.append(seq_id)  # the workers drop it before the next step

    def prefill(self, batch: Sequence[PrefillRequest], *, all_logits: bool = False) -> StepOutput:
        """A step of prefills only."""
        return self.step(batch, (), all_logits=all_logits)

    def decode(self, batch: Sequence[DecodeRequest]) -> torch.Tensor:
        """A step of decodes only; ``[batch, vocab]`` float32 logits."""
        return self.step((), batch).decode_logits

    def generate(
        self, requests: Sequence[GenerationRequest], allocate: Allocator
    ) -> list[GenerationResult]:
        """Prefill then decode to completion (a convenience for tests and benchmarks)."""
        return generate(self, requests, allocate)

    # -- lifetime --------------------------------------------------------------------

    def close(self) -> None:
        """Stop the TP workers (if any) and release the KV tiers (the disk tier's file
        is removed). A single-rank engine without a disk tier needs no closing."""
        runner: ModelRunner | None = getattr(self, "runner", None)  # None if __init__ failed
        if runner is not None:
            runner.tiers.close()
        if self._workers is not None:
            self._workers.stop()
            self._workers = None
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
