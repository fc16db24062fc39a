"""KV tiers behind the device pool: host memory and a local disk file, and the block
copies between the three.

A lower tier is ``num_slots`` blocks, each exactly one pool block: ``[layers, 2,
kv_heads, block_size, head_dim]`` of this rank's shard, in the pool's dtype. Slots are
slot-major (``[num_slots, layers, 2, kv_heads, block_size, head_dim]``), so one block is
one contiguous range: one DMA to or from the GPU, one range of the disk file. Which
slot holds which block is kvcore's business (``TierStore``); the engine copies what it
is told to, in the order it is told (:mod:`.kv_copy`).

Memory budget, per rank (a TP group has one of each per rank):

- the device pool (``KVPool``): HBM on CUDA, sized from ``gpu_memory_utilization``;
  host RAM on the CPU, ``kv_cache_bytes``;
- the host tier: ``host_kv_slots * kv_block_bytes`` of host RAM, in addition to the
  pool. On the CPU the pool and the host tier are both host RAM: the replica's KV takes
  ``kv_cache_bytes`` plus the host tier. On CUDA the host tier is page-locked
  (``cudaHostRegister``): it is never swapped, and counts in full toward the process's
  resident memory and a container's memory limit from the start;
- the disk tier: a file of ``disk_kv_slots * kv_block_bytes`` under ``disk_kv_path``,
  allocated on disk at start. Its pages go through the page cache, which the kernel may
  drop (while resident they count toward a cgroup's memory usage, reclaimably); on a
  tmpfs the "disk" is RAM;
- copies on CUDA stage at most :data:`STAGING_BYTES` on the device (the runner adds it
  to the activation reserve when a tier is configured).

Copies on CUDA run on a side stream, after the work already queued on the compute
stream; the compute stream waits for them (an event) just before the next forward, so
they overlap the step's host-side preparation and finish before its attention reads
or writes the pool. On the CPU they are plain strided copies.

Failure: an exception mid-batch (a fault hook, an I/O error) leaves the destinations
of the batch's ops partly written: garbage that must not be published. The engine
raises before the forward, and the caller drops the batch (kvcore's
``finish_copies(ok=False)``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from cachepoint.engine.kv_copy import Copy, CopyGroup, CopyHook, as_copies, plan_groups, runs
from cachepoint.engine.kv_pool import KVPool

STAGING_BYTES = 64 * 2**20  # device memory one CUDA copy chunk may stage


class TierError(ValueError):
    """A lower tier cannot be set up as configured (path, size, pinning)."""


def _cudart() -> Any:
    """The CUDA runtime bindings (untyped)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class _SlotTensor:
    """What both tiers are: ``data``, one block per slot along dim 0."""

    __slots__ = ("data",)

    data: torch.Tensor

    @property
    def num_slots(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class HostTier(_SlotTensor):
    """``num_slots`` blocks in host memory (page-locked when the pool is on CUDA)."""

    __slots__ = ("_pinned",)

    def __init__(
        self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, *, pin: bool
    ) -> None:
        # NOTE: zeros, like the pool: a slot promoted by mistake must not carry NaN
        # garbage into attention (masked scores still multiply V).
        self.data = torch.zeros((num_slots, *block_shape), dtype=dtype)
        self._pinned = False
        if pin and num_slots:
            # NOTE: registered, not ``pin_memory=True``: the caching host allocator
            # rounds every pinned allocation up to a power of two (a 48 GiB tier
            # would take 64 GiB).
            err = int(_cudart().cudaHostRegister(self.data.data_ptr(), self.nbytes, 0))
            if err != 0:
                raise TierError(
                    f"cannot page-lock the host KV tier ({self.nbytes / 2**30:.2f} GiB): "
                    f"cudaHostRegister failed with error {err}; lower host_kv_slots or the "
                    "memlock limit"
                )
            self._pinned = True

    def close(self) -> None:
        if self._pinned:
            _cudart().cudaHostUnregister(self.data.data_ptr())
            self._pinned = False
        self.data = torch.empty((0, *self.data.shape[1:]), dtype=self.data.dtype)


class DiskTier(_SlotTensor):
    """``num_slots`` blocks in a memory-mapped file under ``directory``.

    The file is created (and its blocks allocated) on construction and removed by
    :meth:`close`, or when the tier is garbage-collected or the process exits.
    """

    __slots__ = ("__weakref__", "_finalizer", "path")

    def __init__(
        self,
        directory: str | os.PathLike[str],
        num_slots: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        rank: int = 0,
    ) -> None:
        folder = Path(directory)
        if not folder.is_dir():
            raise TierError(f"disk KV tier path {str(folder)!r} is not an existing directory")
        width = torch.empty((), dtype=dtype).element_size()
        numel = num_slots * int(torch.Size(block_shape).numel())
        size = numel * width
        try:
            fd, name = tempfile.mkstemp(
                prefix=f"cachepoint-kv-rank{rank}-", suffix=".bin", dir=folder
            )
        except OSError as exc:
            raise TierError(
                f"disk KV tier path {str(folder)!r} is not writable: {exc.strerror}"
            ) from None
        self.path = name  # the backing file (removed on close)
        self._finalizer = weakref.finalize(self, _remove, name)
        try:
            free = shutil.disk_usage(folder).free
            if size > free:
                raise TierError(
                    f"disk KV tier needs {size / 2**30:.2f} GiB ({num_slots} slots) but "
                    f"{str(folder)!r} has {free / 2**30:.2f} GiB free; lower disk_kv_slots"
                )
            # NOTE: allocated now, not sparse: a write through the mapping into a
            # sparse file on a full disk is a SIGBUS that kills the process.
            if size:
                os.posix_fallocate(fd, 0, size)
        except TierError:
            self._finalizer()
            raise
        except OSError as exc:
            self._finalizer()
            raise TierError(
                f"cannot allocate {size / 2**30:.2f} GiB for the disk KV tier in "
                f"{str(folder)!r}: {exc.strerror}"
            ) from None
        finally:
            os.close(fd)
        flat = torch.from_file(name, shared=True, size=numel, dtype=dtype)
        self.data = flat.view(num_slots, *block_shape)

    def close(self) -> None:
        """Unmap (once no other view is left) and remove the file."""
        self.data = torch.empty((0, *self.data.shape[1:]), dtype=self.data.dtype)
        self._finalizer()


class KVTiers:
    """One rank's tiers (its pool, host and disk) and the copies between them."""

    __slots__ = ("_cuda", "_event", "_stream", "disk", "host", "pool")

    def __init__(
        self,
        pool: KVPool,
        *,
        host_slots: int = 0,
        disk_path: str | os.PathLike[str] | None = None,
        disk_slots: int = 0,
        rank: int = 0,
    ) -> None:
        self.pool = pool
        s = pool.shape
        shape = (s.num_layers, 2, s.num_kv_heads, s.block_size, s.head_dim)
        self._cuda = pool.device.type == "cuda"
        self.host = HostTier(host_slots, shape, s.dtype, pin=self._cuda) if host_slots else None
        self.disk: DiskTier | None = None
        if disk_slots:
            if disk_path is None:
                raise TierError("disk_kv_slots needs disk_kv_path")
            self.disk = DiskTier(disk_path, disk_slots, shape, s.dtype, rank=rank)
        self._stream: torch.cuda.Stream | None = None
        self._event: torch.cuda.Event | None = None
        if self._cuda and (self.host is not None or self.disk is not None):
            self._stream = torch.cuda.Stream(pool.device)  # type: ignore[no-untyped-call]

    # -- geometry ---------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        return self.pool.shape.bytes_per_block

    @property
    def sizes(self) -> dict[str, int]:
        """Blocks (slots) per tier; 0 for a tier that is not configured."""
        return {
            "device": self.pool.num_blocks,
            "host": 0 if self.host is None else self.host.num_slots,
            "disk": 0 if self.disk is None else self.disk.num_slots,
        }

    def _blocks(self, tier: str, start: int, count: int) -> torch.Tensor:
        """``[count, layers, 2, kv_heads, block_size, head_dim]``: a view of blocks
        ``start..start+count-1`` of ``tier``."""
        if tier == "device":
            # NOTE: the pool's whole tensor (head-major, blocks on dim 3); KVPool has
            # no public accessor for it.
            return self.pool.data[:, :, :, start : start + count].movedim(3, 0)
        store = self.host if tier == "host" else self.disk
        assert store is not None, f"no {tier} tier"  # as_copies checked it
        return store.data[start : start + count]

    # -- copies -----------------------------------------------------------------------

    def check(self, copies: Iterable[object]) -> list[Copy]:
        """Validated plain tuples, or ``ValueError`` (see :func:`.kv_copy.as_copies`)."""
        return as_copies(copies, self.sizes)

    def copy(self, copies: Iterable[object], hook: CopyHook | None = None) -> None:
        """Run ``copies`` in order: finished on the CPU; on CUDA queued on the copy
        stream, which the next forward waits for (:meth:`wait_ready`) and
        :meth:`synchronize` waits for.

        Every op is validated before the first byte moves. ``hook(pos)`` runs before
        each unit of copying, with the batch position of its first op; whatever it
        raises propagates, with the ops before ``pos`` done and the rest not started.
        """
        ops = self.check(copies)
        if not ops:
            return
        with torch.no_grad():
            if self._stream is None:
                for group in plan_groups(ops):
                    self._copy_runs(group, hook)
                return
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(self.pool.device))
            try:
                with torch.cuda.stream(stream):
                    for group in plan_groups(ops):
                        self._copy_group_cuda(group, hook)
            except BaseException:
                # NOTE: nothing of a failed batch may still be in flight when the
                # caller reuses its blocks.
                stream.synchronize()
                raise
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
            self._event = event

    def wait_ready(self) -> None:
        """Make the current stream wait for the queued copies (before a forward)."""
        if self._event is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(self._event)
            self._event = None

    def synchronize(self) -> None:
        """Block until every queued copy has finished (before publishing its blocks)."""
        if self._stream is not None:
            self._stream.synchronize()
        self._event = None

    def _chunk(self) -> int:
        return max(1, STAGING_BYTES // self.bytes_per_block)

    def _copy_runs(self, group: CopyGroup, hook: CopyHook | None) -> None:
        """Each run as one strided copy between views (no staging); on CUDA a copy
        with a CPU side is synchronous.

        NOTE: on the CPU this beats one gather and one scatter per group: measured
        single-threaded at SmolLM2-135M's block shape, a copy per scattered block ran
        at about 4 GB/s and ``index_select`` + ``index_copy_`` at 0.8 GB/s (two
        passes, and a fresh staging tensor whose pages fault in).
        """
        chunk = self._chunk()
        for run in runs(group):
            for k in range(0, run.length, chunk):
                if hook is not None:
                    hook(run.first + k)
                n = min(chunk, run.length - k)
                dst = self._blocks(group.dst_tier, run.dst + k, n)
                dst.copy_(self._blocks(group.src_tier, run.src + k, n))

    def _copy_group_cuda(self, group: CopyGroup, hook: CopyHook | None) -> None:
        tiers = {group.src_tier, group.dst_tier}
        assert self._stream is not None
        if "device" not in tiers:
            # NOTE: CPU copies between host and disk: the DMAs queued before may
            # still read or write the same host slots.
            self._stream.synchronize()
            self._copy_runs(group, hook)
        elif tiers == {"device", "host"}:
            self._device_host(group, hook)
        elif tiers == {"device"}:
            self._device_device(group, hook)
        else:
            # Device <-> disk: the file is pageable memory, so torch's copy is
            # synchronous on the copy stream (disk bandwidth bounds it anyway).
            self._copy_runs(group, hook)

    def _subgroups(self, group: CopyGroup) -> Iterable[CopyGroup]:
        chunk = self._chunk()
        for k in range(0, len(group.src), chunk):
            yield CopyGroup(
                group.src_tier,
                group.dst_tier,
                group.first + k,
                group.src[k : k + chunk],
                group.dst[k : k + chunk],
            )

    def _device_host(self, group: CopyGroup, hook: CopyHook | None) -> None:
        """One gather (or scatter) over the pool's block dimension for all layers at
        once, and one async DMA per run of consecutive host slots."""
        data, device = self.pool.data, self.pool.device
        assert self.host is not None
        host = self.host.data
        for sub in self._subgroups(group):
            if hook is not None:
                hook(sub.first)
            if sub.src_tier == "device":
                index = torch.tensor(sub.src, dtype=torch.long, device=device)
                stage = data.index_select(3, index).movedim(3, 0).contiguous()
                for r in runs(sub):
                    k = r.first - sub.first
                    host[r.dst : r.dst + r.length].copy_(stage[k : k + r.length], non_blocking=True)
            else:
                shape = (len(sub.src), *host.shape[1:])
                stage = torch.empty(shape, dtype=data.dtype, device=device)
                for r in runs(sub):
                    k = r.first - sub.first
                    stage[k : k + r.length].copy_(host[r.src : r.src + r.length], non_blocking=True)
                index = torch.tensor(sub.dst, dtype=torch.long, device=device)
                data.index_copy_(3, index, stage.movedim(0, 3))

    def _device_device(self, group: CopyGroup, hook: CopyHook | None) -> None:
        data, device = self.pool.data, self.pool.device
        for sub in self._subgroups(group):
            if hook is not None:
                hook(sub.first)
            src = torch.tensor(sub.src, dtype=torch.long, device=device)
            dst = torch.tensor(sub.dst, dtype=torch.long, device=device)
            data.index_copy_(3, dst, data.index_select(3, src))

    # -- lifetime ---------------------------------------------------------------------

    @property
    def host_bytes(self) -> int:
        return 0 if self.host is None else self.host.nbytes

    @property
    def disk_bytes(self) -> int:
        return 0 if self.disk is None else self.disk.nbytes

    def close(self) -> None:
        """Release the host tier and remove the disk tier's file (idempotent)."""
        self.synchronize()
        if self.host is not None:
            self.host.close()
            self.host = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None
