"""Tensor parallel workers: ranks 1..N-1 as processes that follow rank 0's plan.

The driver process (the scheduler, or a test) is rank 0. :class:`TPWorkers` spawns
the other ranks with ``torch.multiprocessing`` (spawn start method), and all of them
join one ``torch.distributed`` group over TCP on 127.0.0.1: gloo on the CPU, NCCL on
CUDA. Each step rank 0 broadcasts a :class:`StepPlan` (the requests: token ids, block
tables, cached counts) with ``broadcast_object_list``; every rank then runs the same
forward on its own heads, and the row-parallel layers all-reduce.

Block copies between KV tiers travel in the plan as plain tuples, and every rank runs
them on its own shard before the forward. Whether they succeeded everywhere is agreed
with one all-reduce, so a failed copy on any rank makes every rank skip the forward.

Failure: a fault hook raising on rank 0 is announced to the workers at that layer (a
one-element broadcast per layer, only while a hook is set), so the whole group leaves
the forward together and stays usable. A real crash inside a collective (a worker
dying, an OOM mid-layer) cannot be recovered that way: the group fails after
``EngineConfig.dist_timeout_s`` and the replica must restart with a new epoch.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import pickle
import socket
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cachepoint.engine.batch import DecodeRequest, PrefillRequest
from cachepoint.engine.config import EngineConfig, ModelConfig
from cachepoint.engine.device import resolve_device
from cachepoint.engine.kv_copy import Copy
from cachepoint.engine.model import LayerHook
from cachepoint.engine.runner import ModelRunner

log = logging.getLogger(__name__)


class StepAborted(RuntimeError):
    """Rank 0 aborted the step at a layer; the worker drops it and waits for the next."""


@dataclass(slots=True)
class StepPlan:
    """What rank 0 tells the workers to do next."""

    stop: bool = False  # leave the worker loop and exit
    prefills: list[PrefillRequest] = field(default_factory=list)  # this step's prefills
    decodes: list[DecodeRequest] = field(default_factory=list)  # this step's decodes
    check_faults: bool = False  # rank 0 broadcasts an abort flag before every layer
    forget: list[int] = field(default_factory=list)  # seq ids to drop before this step
    # Block copies between tiers to run, in order, before the forward (validated by rank 0).
    copies: list[Copy] = field(default_factory=list)


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def init_group(rank: int, world: int, port: int, device: torch.device, timeout_s: float) -> None:
    """Join the TP process group (the default group of this process)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def broadcast_plan(plan: StepPlan | None, device: torch.device) -> StepPlan:
    """Rank 0 passes its plan, the others None; every rank returns rank 0's plan.

    NOTE: our own pickle-over-two-broadcasts instead of ``broadcast_object_list``,
    which needs numpy to unpickle (the replica image does not ship it). The peers are
    this replica's own processes, so unpickling their bytes is safe.
    """
    if plan is not None:
        payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if plan is not None:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        dist.broadcast(buf, src=0)
        return plan
    n = int(size.item())
    buf = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0)
    host = buf.cpu()
    received: StepPlan = pickle.loads(ctypes.string_at(host.data_ptr(), n))
    return received


def _abort_flag(value: int, device: torch.device) -> int:
    flag = torch.tensor([value], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)
    return int(flag.item())


def copies_failed_anywhere(failed: bool, device: torch.device) -> bool:
    """Every rank passes whether its copies failed; all learn whether any rank's did.

    NOTE: an all-reduce, not rank 0's broadcast: a worker's copy can fail too (an I/O
    error on its disk file), and then no rank may run the forward.
    """
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def driver_layer_hook(user_hook: LayerHook, device: torch.device) -> LayerHook:
    """Wrap rank 0's fault hook so that the workers abort at the same layer."""

    def hook(layer: int) -> None:
        error: BaseException | None = None
        try:
            user_hook(layer)
        except BaseException as exc:  # NOTE: re-raised below, after the workers know
            error = exc
        if _abort_flag(1 if error is not None else 0, device):
            assert error is not None
            raise error

    return hook


def worker_layer_hook(device: torch.device) -> LayerHook:
    """The workers' half of :func:`driver_layer_hook`."""

    def hook(layer: int) -> None:
        if _abort_flag(0, device):
            raise StepAborted(f"rank 0 aborted the step at layer {layer}")

    return hook


def worker_main(
    rank: int,
    port: int,
    model_config: ModelConfig,
    config: EngineConfig,
    model_dir: Path | None,
    seed: int,
) -> None:
    """Entry point of TP rank ``rank`` (>= 1): build the shard, then follow rank 0."""
    world = config.tensor_parallel_size
    device = resolve_device(config.device, rank)
    if device.type == "cpu":
        # NOTE: all ranks share the host's cores; without this each would spawn one
        # thread per core and they would thrash each other.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_group(rank, world, port, device, config.dist_timeout_s)
    runner: ModelRunner | None = None
    try:
        runner = ModelRunner(model_config, config, model_dir=model_dir, seed=seed, tp_rank=rank)
        hook = worker_layer_hook(runner.device)
        while True:
            plan = broadcast_plan(None, runner.device)
            if plan.stop:
                break
            runner.forget(plan.forget)
            if plan.copies:
                failed = False
                try:
                    runner.copy_blocks(plan.copies)
                except Exception:
                    log.exception("TP rank %d: block copies failed", rank)
                    failed = True
                if copies_failed_anywhere(failed, runner.device):
                    continue
            if not plan.prefills and not plan.decodes:
                continue
            try:
                runner.execute(
                    plan.prefills, plan.decodes, layer_hook=hook if plan.check_faults else None
                )
            except StepAborted:
                continue
    finally:
        if runner is not None:
            runner.tiers.close()
        dist.destroy_process_group()


class TPWorkers:
    """Ranks 1..N-1 of a TP group, spawned and joined by the driver (rank 0).

    Usage (the :class:`~cachepoint.engine.engine.Engine` does this itself)::

        workers = TPWorkers.spawn(model_config, config, model_dir, seed)
        init_group(0, world, workers.port, device, timeout)  # rank 0 joins
        ...  # broadcast_plan(...) each step
        workers.stop()
    """

    __slots__ = ("_procs", "_stopped", "device", "port")

    def __init__(self, procs: list[BaseProcess], port: int, device: torch.device) -> None:
        self._procs = procs
        self.port = port  # the group's rendezvous port on 127.0.0.1
        self.device = device  # rank 0's device (where its collectives run)
        self._stopped = False

    @classmethod
    def spawn(
        cls,
        model_config: ModelConfig,
        config: EngineConfig,
        model_dir: Path | None,
        seed: int,
    ) -> TPWorkers:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs: list[BaseProcess] = []
        for rank in range(1, config.tensor_parallel_size):
            proc = ctx.Process(
                target=worker_main,
                args=(rank, port, model_config, config, model_dir, seed),
                name=f"cachepoint-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        return cls(procs, port, resolve_device(config.device, 0))

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def stop(self, send_stop: bool = True, timeout_s: float = 30.0) -> None:
        """Tell the workers to exit (when the group is up), then join them.

        A worker that does not exit in time is terminated.
        """
        if self._stopped:
            return
        self._stopped = True
        if send_stop and dist.is_initialized():
            with contextlib.suppress(RuntimeError):
                broadcast_plan(StepPlan(stop=True), self.device)
        for p in self._procs:
            p.join(timeout_s)
            if p.is_alive():
                p.terminate()
                p.join(5.0)
        if dist.is_initialized():
            dist.destroy_process_group()
