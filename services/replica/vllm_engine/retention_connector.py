"""`RetentionConnector`: vLLM's KV-connector API used to keep managed entries' blocks.

Loaded by vLLM itself, in its engine-core process (the scheduler side) and in each
worker, from the ``kv_transfer_config`` the shim builds (`engine.connector_config`):
``kv_connector="RetentionConnector"``, ``kv_connector_module_path`` this module. It
moves no KV: the worker side does nothing, so the same code runs on the CPU build and
on GPUs, and composes with vLLM's own ``OffloadingConnector`` under ``MultiConnector``.

Scheduler side (vLLM's ``Scheduler`` calls these; docs/vllm.md, "Retention"):

- ``bind_gpu_block_pool``: the pool whose blocks the pins hold references on;
- ``request_finished``: before vLLM frees a finished request's blocks, pin the entries
  its ``kv_transfer_params`` name (`pins.PinTable.finished`); the report goes back in
  the request's output ``kv_transfer_params``;
- ``get_num_new_matched_tokens`` and ``build_connector_meta``: the ticks that release
  due pins, before a waiting request's allocation and after each schedule. An idle
  engine allocates nothing, so a pin that outlives its deadline while idle costs
  nothing;
- ``reset_cache``: vLLM's cache reset (``reset_connector=True``) drops every pin.

NOTE: this module imports vLLM and is only ever imported by vLLM's connector factory.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from cachepoint.replica.vllm_engine.pins import PARAMS_KEY, PinSpec, PinTable

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class RetentionConnector(KVConnectorBase_V1, SupportsHMA):
    """Pins managed entries' blocks in vLLM's GPU (or CPU-build) block pool."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.table: PinTable | None = None  # scheduler side, once the pool is bound
        self.failed: str | None = None  # set when the bookkeeping broke: pinning stops
        # NOTE: scheduler-side seconds spent in this connector's hooks, ever: reported
        # to the replica (/v1/stats connector_seconds) so its cost per step is measured
        # where it runs, inside vLLM's busy loop (bench/vllm_retention_bench.py).
        self.seconds = 0.0

    # ------------------------------------------------------------ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.table = PinTable(gpu_block_pool)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        t0 = time.perf_counter()
        self._tick()
        self.seconds += time.perf_counter() - t0
        return 0, False  # nothing to load: the pinned blocks are vLLM's own hits

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        t0 = time.perf_counter()
        self._tick()
        self.seconds += time.perf_counter() - t0
        return KVConnectorMetadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, self._timed_finish(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # NOTE: managed entries are full-attention prefixes: group 0's blocks.
        return False, self._timed_finish(request, block_ids[0] if block_ids else [])

    def reset_cache(self) -> bool:
        if self.table is not None:
            released = self.table.release_all()
            log.info("cachepoint retention: cache reset released %d pins", released)
        return True

    def shutdown(self) -> None:
        if self.table is not None:
            self.table.release_all()

    def _timed_finish(self, request: Request, block_ids: list[int]) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        params = self._finished(request, block_ids)
        self.seconds += time.perf_counter() - t0
        if params is not None and "error" not in params[PARAMS_KEY]:
            params[PARAMS_KEY]["seconds"] = self.seconds
        return params

    def _finished(self, request: Request, block_ids: list[int]) -> dict[str, Any] | None:
        table = self.table
        if table is None:
            return None
        if self.failed is not None:
            return {PARAMS_KEY: {"error": self.failed}}
        try:
            # NOTE: a report on every request, pins or not: it is how the replica
            # learns what the connector holds after expiries (/v1/stats pinned_blocks).
            specs = PinSpec.parse(request.kv_transfer_params)
            report = table.finished(
                specs, block_ids, int(request.num_computed_tokens), self.block_size
            )
        except Exception as exc:
            # NOTE: a broken table must not take vLLM's engine down with it. Its pins
            # are released (the blocks return to vLLM's LRU) and pinning stops: entries
            # then lapse as on an engine with no connector; never stale KV.
            self.failed = f"retention connector failed: {exc!r}"
            log.exception("cachepoint retention connector failed; pinning stops")
            try:
                table.release_all()
            except Exception:
                log.exception("releasing the pins failed too")
            return {PARAMS_KEY: {"error": self.failed}}
        return report.as_params()

    def _tick(self) -> None:
        if self.table is not None and self.failed is None:
            self.table.expire()

    # --------------------------------------------------------------- worker side
    # NOTE: pins hold blocks where vLLM already keeps them; nothing moves.

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
