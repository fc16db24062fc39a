"""Copy bandwidth between KV tiers: device pool, host memory and the disk file.

Batches of ``--blocks`` blocks at SmolLM2-135M's KV shape (30 layers, 3 KV heads,
head_dim 64, float32, 16-token blocks: 720 KiB a block) go through
``KVTiers.copy`` in each direction, with scattered indices (every block its own
copy: kvcore's free lists hand out scattered ids) and consecutive ones (one run).

Disk figures, honestly labelled:

- ``host->disk (page cache)``: the copy into the mapping only dirties page cache;
- ``host->disk (+fsync)``: the same copy plus ``fsync`` of the file (what the disk
  really took);
- ``disk->host (warm)``: the blocks were in the page cache;
- ``disk->host (cold)``: before each round the file is fsynced, the mapping's pages
  dropped (``madvise(MADV_DONTNEED)``) and the page cache evicted
  (``posix_fadvise(POSIX_FADV_DONTNEED)``); the share of the file still resident
  afterwards (``mincore``) is printed, so a cache that did not let go shows.

On a machine without CUDA the "device" is host memory too: device<->host is then a
memcpy between two host buffers, which the ``host->host`` line bounds.

    .venv/bin/python bench/tier_copy_bench.py
    .venv/bin/python bench/tier_copy_bench.py --blocks 512 --rounds 5 --disk-dir /mnt/nvme
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cachepoint.engine.kv_pool import KVPool, KVPoolShape
from cachepoint.engine.kv_tiers import DiskTier, KVTiers

Op = tuple[str, int, str, int]
_libc = ctypes.CDLL(None, use_errno=True)
MADV_DONTNEED = 4


@dataclass(slots=True)
class Result:
    """One direction and index pattern, measured over several rounds."""

    name: str  # what is printed
    nbytes: int  # bytes one round moves
    seconds: list[float] = field(default_factory=list)  # each round's wall time
    note: str = ""  # e.g. how much of the file stayed resident

    def gbps(self, seconds: float) -> float:
        return self.nbytes / seconds / 1e9


def resident_share(tier: DiskTier) -> float:
    """Share of the disk tier's pages resident in memory (``mincore``)."""
    length = tier.nbytes
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(tier.data.data_ptr()), ctypes.c_size_t(length), vec) != 0:
        return float("nan")
    return sum(v & 1 for v in vec) / pages


def drop_disk_cache(tier: DiskTier) -> None:
    """Write the file back, unmap its pages from this process, evict the page cache."""
    fd = os.open(tier.path, os.O_RDWR)
    try:
        os.fsync(fd)
        _libc.madvise(
            ctypes.c_void_p(tier.data.data_ptr()), ctypes.c_size_t(tier.nbytes), MADV_DONTNEED
        )
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsync_file(tier: DiskTier) -> None:
    fd = os.open(tier.path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ops(src: str, src_idx: list[int], dst: str, dst_idx: list[int]) -> list[Op]:
    return [(src, s, dst, d) for s, d in zip(src_idx, dst_idx, strict=True)]


def measure(
    tiers: KVTiers,
    result: Result,
    batch: list[Op],
    rounds: int,
    before: Callable[[], None] | None = None,
    after: Callable[[], None] | None = None,
) -> None:
    tiers.copy(batch)  # warm-up: first touch of pages, allocator, stream
    tiers.synchronize()
    if after is not None:
        after()
    for _ in range(rounds):
        if before is not None:
            before()
        t0 = time.perf_counter()
        tiers.copy(batch)
        tiers.synchronize()
        if after is not None:
            after()
        result.seconds.append(time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=256, help="blocks per batch (default 256)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per line (default 3)")
    parser.add_argument(
        "--device", default="auto", help="pool device: auto (CUDA if present), cpu, cuda:N"
    )
    parser.add_argument(
        "--disk-dir", default=None, help="directory of the disk tier's file (default: tempdir)"
    )
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (default: torch's own)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    n = args.blocks
    slots = 2 * n
    shape = KVPoolShape(
        args.layers,
        slots,
        args.block_size,
        args.kv_heads,
        args.head_dim,
        getattr(torch, args.dtype),
    )
    pool = KVPool(shape, device)
    pool._data.normal_()
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as folder:
        tiers = KVTiers(pool, host_slots=slots, disk_path=folder, disk_slots=slots)
        assert tiers.host is not None and tiers.disk is not None
        disk = tiers.disk
        per_block = shape.bytes_per_block
        nbytes = n * per_block
        rng = random.Random(0)
        scattered = rng.sample(range(slots), n)
        other = rng.sample(range(slots), n)
        run = list(range(n))
        results: list[Result] = []

        def line(name: str, batch: list[Op], **kw: Callable[[], None]) -> Result:
            r = Result(name, nbytes)
            measure(tiers, r, batch, args.rounds, **kw)
            results.append(r)
            print(f"  {name}: {r.gbps(min(r.seconds)):.2f} GB/s best", flush=True)
            return r

        dev = "device" if device.type == "cuda" else "device(cpu)"
        line(f"{dev}->host scattered", ops("device", scattered, "host", other))
        line(f"{dev}->host consecutive", ops("device", run, "host", run))
        line(f"host->{dev} scattered", ops("host", other, "device", scattered))
        line(f"host->{dev} consecutive", ops("host", run, "device", run))
        line("host->host consecutive (memcpy ref.)", ops("host", run, "host", [n + i for i in run]))
        line("host->disk scattered (page cache)", ops("host", other, "disk", scattered))
        line(
            "host->disk scattered (+fsync)",
            ops("host", other, "disk", scattered),
            after=lambda: fsync_file(disk),
        )
        line(
            "host->disk consecutive (+fsync)",
            ops("host", run, "disk", run),
            after=lambda: fsync_file(disk),
        )
        line("disk->host scattered (warm)", ops("disk", scattered, "host", other))
        cold = line(
            "disk->host scattered (cold)",
            ops("disk", scattered, "host", other),
            before=lambda: drop_disk_cache(disk),
        )
        drop_disk_cache(disk)
        cold.note = f"{resident_share(disk):.0%} of the file resident after a drop"
        line(
            "disk->host consecutive (cold)",
            ops("disk", run, "host", run),
            before=lambda: drop_disk_cache(disk),
        )
        tiers.close()

    print(
        f"tier copy bandwidth: {n} blocks of {per_block / 2**10:.0f} KiB per batch "
        f"({nbytes / 2**20:.0f} MiB), {args.rounds} rounds; pool on {device}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads on "
        f"{os.cpu_count()} CPUs (load {os.getloadavg()[0]:.1f}), {platform.machine()}"
    )
    print(f"{'copy':42} {'best GB/s':>10} {'median GB/s':>12}  note")
    for r in results:
        best, med = min(r.seconds), statistics.median(r.seconds)
        print(f"{r.name:42} {r.gbps(best):10.2f} {r.gbps(med):12.2f}  {r.note}")


if __name__ == "__main__":
    main()
