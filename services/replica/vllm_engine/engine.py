"""One vLLM ``AsyncLLM`` with its KV events on, and the facts the core needs of it.

vLLM starts its engine core (and, on the CPU, a worker) as spawned processes, which
re-import the parent's main module: every entry point that can get here keeps its
start-up under ``if __name__ == "__main__"`` (cachepoint.replica.cli does).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachepoint.replica.settings import ReplicaSettings
from cachepoint.replica.vllm_engine.checkpoint import Checkpoint

log = logging.getLogger(__name__)

# NOTE: vLLM's CPU attention kernels take blocks in multiples of 32 and head sizes from
# this list (vllm/v1/attention/backends/cpu_attn.py); refused up front, by name, rather
# than as a traceback from a spawned worker.
CPU_BLOCK_MULTIPLE = 32
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class VllmConfigError(ValueError):
    """Settings vLLM cannot run with (or the shim refuses): a usage error."""


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What vLLM decided at start-up."""

    num_blocks: int  # KV blocks in its pool
    block_size: int  # tokens per block
    max_model_len: int  # longest sequence
    kv_bytes_per_token: int  # K and V of one token, every layer and TP rank
    device: str  # "cpu" or "cuda"
    version: str  # vLLM's version
    connector: str | None = None  # the KV connector vLLM runs (retention, host tier)


def check_geometry(settings: ReplicaSettings, device: str, head_dim: int | None) -> None:
    """Refuse block and head sizes vLLM's CPU kernels do not take."""
    if device != "cpu":
        return
    if settings.block_size % CPU_BLOCK_MULTIPLE:
        raise VllmConfigError(
            f"block_size {settings.block_size}: vLLM's CPU attention takes multiples of "
            f"{CPU_BLOCK_MULTIPLE} (try --block-size {CPU_BLOCK_MULTIPLE}; give the gateway "
            "the same --block-size)"
        )
    if head_dim is not None and head_dim not in CPU_HEAD_SIZES:
        hint = " (try --model-preset small)" if settings.model_dir is None else ""
        raise VllmConfigError(
            f"head size {head_dim}: vLLM's CPU attention takes {list(CPU_HEAD_SIZES)}{hint}"
        )


def resolve_device(settings: ReplicaSettings) -> str:
    import torch

    if settings.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return settings.device.split(":", 1)[0]


def event_endpoints(name: str) -> tuple[str, str]:
    """ZMQ endpoints (publish, replay) private to this replica process."""
    base = Path(tempfile.gettempdir()) / f"cachepoint-vllm-{name}-{os.getpid()}"
    return f"ipc://{base}.kv", f"ipc://{base}.replay"


def engine_kwargs(settings: ReplicaSettings, folder: Path, device: str) -> dict[str, Any]:
    """``AsyncEngineArgs``' keywords but the event config: plain values, so what the
    isolation and billing contract depends on is tested without vLLM installed."""
    eager = settings.vllm_enforce_eager
    return {
        "model": str(folder),
        "served_model_name": settings.model_name,
        # NOTE: the gateway renders and tokenizes; the shim decodes with the same
        # tokenizer, so vLLM's own tokenizer (and its start-up cost) is not needed.
        "skip_tokenizer_init": True,
        "dtype": "float32" if settings.dtype == "auto" and device == "cpu" else settings.dtype,
        "block_size": settings.block_size,
        # NOTE: always on, whatever vLLM's default becomes: the engine hit is billed.
        "enable_prefix_caching": True,
        # NOTE: collision resistant: the cache_salt keeps tenants apart only as long
        # as nobody can craft a prefix with another's hash (xxhash is refused).
        "prefix_caching_hash_algo": "sha256",
        # NOTE: -1 is vLLM's auto-fit: the model's context if the KV budget holds
        # one sequence that long, else the longest that fits (the torch engine
        # sizes the random model's context to its budget the same way).
        "max_model_len": settings.max_model_len or -1,
        "max_num_seqs": settings.max_num_seqs,
        # NOTE: the request's priority means what it means on the torch engine:
        # lower runs first, FIFO among equals (vLLM's "fcfs" would ignore it).
        "scheduling_policy": "priority",
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "kv_cache_memory_bytes": settings.kv_cache_bytes if device == "cpu" else None,
        "enforce_eager": (device == "cpu") if eager is None else eager,
        "seed": settings.seed,
        "disable_log_stats": True,
    }


RETENTION_CONNECTOR = "RetentionConnector"
RETENTION_MODULE = "cachepoint.replica.vllm_engine.retention_connector"
GIB = 1 << 30


def connector_config(settings: ReplicaSettings, device: str) -> dict[str, Any] | None:
    """``KVTransferConfig``'s keywords: the retention connector, and vLLM's own host tier
    (``OffloadingConnector``) behind it when ``kv_host_bytes`` is set; None = neither.

    Plain values, so what a GPU member would run is tested where no GPU is (the
    operator renders the flags this reads).
    """
    host = settings.kv_host_bytes
    if host and device == "cpu":
        # NOTE: vLLM's OffloadingConnector refuses the CPU build ("CPU Offloading is
        # currently only supported on CUDA-alike and XPU GPUs"); said before it starts.
        raise VllmConfigError(
            "kv_host_bytes: vLLM's host tier (its OffloadingConnector) runs on GPUs only; "
            "the CPU build has none (drop --kv-host-bytes, or run on a GPU)"
        )
    retention: dict[str, Any] | None = None
    if settings.vllm_retention:
        retention = {
            "kv_connector": RETENTION_CONNECTOR,
            "kv_connector_module_path": RETENTION_MODULE,
            "kv_role": "kv_both",
        }
    offload: dict[str, Any] | None = None
    if host:
        # NOTE: what vLLM's own --kv-offloading-size builds (config/vllm.py), in bytes.
        offload = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": host},
        }
    if retention and offload:
        # NOTE: the retention connector first: MultiConnector asks its children in
        # order, and only the offloader ever loads; both see every finished request.
        return {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [retention, offload]},
        }
    return retention or offload


class VllmEngine:
    """One AsyncLLM. Built in a worker thread (start-up takes seconds to minutes)."""

    def __init__(
        self, settings: ReplicaSettings, checkpoint: Checkpoint, endpoints: tuple[str, str]
    ):
        from vllm import __version__
        from vllm.config.kv_events import KVEventsConfig
        from vllm.config.kv_transfer import KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        device = resolve_device(settings)
        hf = _read_config(checkpoint.folder)
        check_geometry(settings, device, _head_dim(hf))
        transfer = connector_config(settings, device)
        args = AsyncEngineArgs(
            **engine_kwargs(settings, checkpoint.folder, device),
            kv_transfer_config=None if transfer is None else KVTransferConfig(**transfer),
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=endpoints[0],
                replay_endpoint=endpoints[1],
            ),
        )
        self.llm: Any = AsyncLLM.from_engine_args(args)
        config = self.llm.vllm_config
        cache = config.cache_config
        model = config.model_config
        self.facts = EngineFacts(
            num_blocks=int(cache.num_gpu_blocks or 0),
            block_size=int(cache.block_size),
            max_model_len=int(model.max_model_len),
            kv_bytes_per_token=_kv_bytes_per_token(model, config.parallel_config),
            device=device,
            version=__version__,
            connector=None if transfer is None else str(transfer["kv_connector"]),
        )

    @property
    def errored(self) -> bool:
        return bool(self.llm.errored)

    def generate(
        self, token_ids: list[int], salt: str | None, params: Any, request_id: str, priority: int
    ) -> AsyncIterator[Any]:
        """Stream one request's outputs (token deltas, vLLM's cache counts and, on the
        last, the connector's report in ``kv_transfer_params``)."""
        prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
        if salt is not None:
            prompt["cache_salt"] = salt
        it: AsyncIterator[Any] = self.llm.generate(prompt, params, request_id, priority=priority)
        return it

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def reset_prefix_cache(self) -> bool:
        """Drop vLLM's prefix cache and every pin. NOTE: vLLM resets its pool before
        the connector, and a pinned block keeps the pool from resetting: the first call
        releases the pins, the second then empties the pool."""
        if await self.llm.reset_prefix_cache(reset_connector=True):
            return True
        return bool(await self.llm.reset_prefix_cache(reset_connector=True))

    def pids(self) -> list[int]:
        """The engine core processes (for tests and logs)."""
        manager = getattr(self.llm.engine_core.resources, "engine_manager", None)
        procs = getattr(manager, "processes", None) or []
        return [p.pid for p in procs if getattr(p, "pid", None)]

    def shutdown(self) -> None:
        try:
            self.llm.shutdown()
        except Exception:  # a dead engine may fail its own teardown
            log.exception("vLLM shutdown failed")


def sampling_params(
    *,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop_token_ids: list[int],
    kv_transfer_params: dict[str, Any] | None = None,
) -> Any:
    """vLLM's SamplingParams for one request: streamed token ids, no detokenizing."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        # NOTE: EOS is ours to decide (the shim applies the same turn-end rule as the
        # torch scheduler); vLLM stops on exactly the ids the shim would stop on.
        ignore_eos=True,
        stop_token_ids=stop_token_ids,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        # NOTE: how a request reaches the KV connector (vllm/v1/request.py reads it).
        extra_args=None
        if kv_transfer_params is None
        else {"kv_transfer_params": kv_transfer_params},
    )


def _read_config(folder: Path) -> dict[str, Any]:
    import json

    raw: dict[str, Any] = json.loads((folder / "config.json").read_text())
    return raw


def _head_dim(hf: dict[str, Any]) -> int | None:
    text = hf.get("text_config") or hf
    if text.get("head_dim"):
        return int(text["head_dim"])
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    return int(hidden) // int(heads) if heads and hidden else None


def _kv_bytes_per_token(model: Any, parallel: Any) -> int:
    try:
        layers = model.get_num_layers(parallel)
        heads = model.get_num_kv_heads(parallel) * parallel.tensor_parallel_size
        head = model.get_head_size()
        itemsize = {"float32": 4}.get(str(model.dtype).removeprefix("torch."), 2)
        return int(2 * layers * heads * head * itemsize)
    except Exception:  # a family whose geometry vLLM reports otherwise: not priced
        return 0
