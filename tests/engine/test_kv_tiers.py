"""KV tiers: block copies between the device pool, host memory and a disk file.

Copies are bit-exact, keep one-by-one semantics however they are batched, validate
before moving anything, and a prefix demoted and promoted back gives the logits of a
prefill from scratch.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepoint.engine import (
    BlockAllocator,
    Engine,
    EngineConfig,
    ModelConfig,
    PrefillRequest,
    kv_tiers,
)
from cachepoint.engine.kv_copy import CopyGroup, plan_groups, runs
from cachepoint.engine.kv_pool import KVPool, KVPoolShape
from cachepoint.engine.kv_tiers import DiskTier, KVTiers, TierError

from .helpers import TOL, blocks_for, max_rel_err, random_prompt

SLOTS = 24


class Tier(StrEnum):
    """Like kvcore's Tier: the engine takes it by value, without importing kvcore."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


@dataclass(slots=True, frozen=True)
class BlockCopy:
    """The shape of kvcore's BlockCopy (duck-typed by the engine)."""

    src_tier: Tier
    src_index: int
    dst_tier: Tier
    dst_index: int


D, H, K = Tier.DEVICE, Tier.HOST, Tier.DISK


def tiered_config(folder: Path, **overrides: object) -> EngineConfig:
    params: dict[str, object] = {
        "block_size": 16,
        "device": "cpu",
        "kv_cache_bytes": 4 << 20,
        "host_kv_slots": SLOTS,
        "disk_kv_path": str(folder),
        "disk_kv_slots": SLOTS,
    }
    params.update(overrides)
    return EngineConfig(**params)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvdisk")


@pytest.fixture(scope="module")
def tiered(disk_dir: Path) -> Iterator[Engine]:
    """The tiny model of the other engine tests, with host and disk tiers."""
    with Engine(ModelConfig.tiny(), tiered_config(disk_dir), seed=1234) as eng:
        yield eng


def device_block(eng: Engine, block: int) -> torch.Tensor:
    return eng.runner.pool._data[:, :, :, block].clone()


def tier_data(eng: Engine, tier: str) -> torch.Tensor:
    tiers = eng.runner.tiers
    if tier == "device":
        return eng.runner.pool._data
    store = tiers.host if tier == "host" else tiers.disk
    assert store is not None
    return store.data


def snapshot(eng: Engine) -> list[torch.Tensor]:
    return [tier_data(eng, t).clone() for t in ("device", "host", "disk")]


def fill_blocks(eng: Engine, alloc: BlockAllocator, n_blocks: int, seed: int) -> list[int]:
    """Fresh blocks holding real K/V (a prefill of ``16 * n_blocks`` tokens)."""
    n = n_blocks * eng.block_size
    table = blocks_for(eng, alloc, n)
    eng.prefill([PrefillRequest(random_prompt(seed, n, eng.vocab_size), table, 0)])
    return table


# -- round trips --------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [(H,), (H, K), (K,), (K, H)],
    ids=["host", "host-disk", "disk", "disk-host"],
)
def test_round_trip_into_other_blocks_is_bit_exact(tiered: Engine, path: tuple[Tier, ...]) -> None:
    eng = tiered
    alloc = BlockAllocator(eng.num_blocks)
    src = fill_blocks(eng, alloc, 6, seed=11)
    want = [device_block(eng, b) for b in src]
    # Scattered and consecutive slots, so runs of several blocks and single ones mix.
    slots = {H: [3, 4, 5, 17, 9, 10], K: [20, 0, 1, 2, 7, 13]}
    ops = [BlockCopy(D, b, path[0], s) for b, s in zip(src, slots[path[0]], strict=True)]
    for a, b in itertools.pairwise(path):
        ops += [BlockCopy(a, x, b, y) for x, y in zip(slots[a], slots[b], strict=True)]
    dst = alloc(6)
    last = slots[path[-1]]
    ops += [BlockCopy(path[-1], s, D, b) for s, b in zip(last, dst, strict=True)]
    eng.copy_blocks(ops)
    for i, b in enumerate(dst):
        assert b not in src
        assert torch.equal(device_block(eng, b), want[i])
        # Each tier on the way holds the block as the pool does.
        for tier in path:
            assert torch.equal(tier_data(eng, tier)[slots[tier][i]], want[i])


@pytest.mark.parametrize("path", [(H,), (H, K), (K,)], ids=["host", "host-disk", "disk"])
def test_reuse_equals_recompute_through_demote_and_promote(
    tiered: Engine, path: tuple[Tier, ...]
) -> None:
    eng = tiered
    alloc = BlockAllocator(eng.num_blocks)
    n, m = 75, 64  # 4 full blocks cached, 11 tokens computed
    prompt = random_prompt(5, n, eng.vocab_size)
    scratch = eng.prefill([PrefillRequest(prompt, blocks_for(eng, alloc, n), 0)]).prefill_logits

    first = blocks_for(eng, alloc, m)
    eng.prefill([PrefillRequest(prompt[:m], first, 0)])
    slots = {H: [6, 2, 3, 12], K: [15, 16, 17, 1]}
    demote = [BlockCopy(D, b, path[0], s) for b, s in zip(first, slots[path[0]], strict=True)]
    if len(path) == 2:
        demote += [BlockCopy(H, a, K, b) for a, b in zip(slots[H], slots[K], strict=True)]
    eng.copy_blocks(demote)
    # The device blocks are reused by another sequence: only the tier keeps the prefix.
    eng.prefill([PrefillRequest(random_prompt(6, m, eng.vocab_size), first, 0)])

    table = blocks_for(eng, alloc, n)
    promote = [BlockCopy(path[-1], s, D, b) for s, b in zip(slots[path[-1]], table, strict=False)]
    out = eng.step([PrefillRequest(prompt, table, m)], copies=promote).prefill_logits
    assert max_rel_err(out, scratch) <= TOL


def test_demote_then_promote_into_the_same_block_in_one_call(tiered: Engine) -> None:
    eng = tiered
    alloc = BlockAllocator(eng.num_blocks)
    x, y = fill_blocks(eng, alloc, 2, seed=21)
    old_x, old_y = device_block(eng, x), device_block(eng, y)
    eng.copy_blocks([BlockCopy(D, y, H, 8)])  # host slot 8 holds y
    # Demote x to slot 11, then promote slot 8 into x: the demotion must read x first.
    eng.copy_blocks([BlockCopy(D, x, H, 11), BlockCopy(H, 8, D, x)])
    assert torch.equal(tier_data(eng, "host")[11], old_x)
    assert torch.equal(device_block(eng, x), old_y)
    # A block read after an earlier op wrote it, and a slot written twice in a row
    # (the later write wins): slot 11 ends with old_x, which op 0 put back into x.
    eng.copy_blocks([BlockCopy(H, 11, D, x), BlockCopy(D, y, H, 11), BlockCopy(D, x, H, 11)])
    assert torch.equal(device_block(eng, x), old_x)
    assert torch.equal(tier_data(eng, "host")[11], old_x)


# -- ordering semantics of batching --------------------------------------------------


def run_one_by_one(data: dict[str, list[int]], ops: list[tuple[str, int, str, int]]) -> None:
    for st_, s, dt, d in ops:
        data[dt][d] = data[st_][s]


def run_grouped(data: dict[str, list[int]], groups: list[CopyGroup]) -> None:
    """What the CUDA path does with a group: gather every source, then write."""
    for g in groups:
        values = [data[g.src_tier][s] for s in g.src]
        for d, v in zip(g.dst, values, strict=True):
            data[g.dst_tier][d] = v


op_strategy = st.tuples(
    st.sampled_from(["device", "host"]),
    st.integers(0, 3),
    st.sampled_from(["device", "host"]),
    st.integers(0, 3),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op_strategy, max_size=12))
def test_groups_copied_all_at_once_keep_one_by_one_semantics(
    ops: list[tuple[str, int, str, int]],
) -> None:
    start = {"device": [0, 1, 2, 3], "host": [10, 11, 12, 13]}
    want = {k: list(v) for k, v in start.items()}
    run_one_by_one(want, ops)
    got = {k: list(v) for k, v in start.items()}
    groups = plan_groups(ops)
    run_grouped(got, groups)
    assert got == want
    assert [
        (g.src_tier, s, g.dst_tier, d) for g in groups for s, d in zip(g.src, g.dst, strict=True)
    ] == ops


def test_plan_splits_only_where_a_group_reads_or_rewrites_what_it_wrote() -> None:
    ops = [
        ("device", 1, "device", 2),
        ("device", 3, "device", 1),  # rewrites op 0's source: fine in one group
        ("device", 2, "device", 4),  # reads what op 0 wrote: a new group
        ("device", 5, "host", 0),
        ("device", 6, "host", 0),  # writes slot 0 again: a new group
    ]
    assert [g.first for g in plan_groups(ops)] == [0, 2, 3, 4]


def test_runs_merge_consecutive_indices_across_tiers_only() -> None:
    across = CopyGroup("device", "host", 5, [7, 8, 9, 2, 3], [0, 1, 2, 3, 9])
    assert [(r.first, r.src, r.dst, r.length) for r in runs(across)] == [
        (5, 7, 0, 3),
        (8, 2, 3, 1),
        (9, 3, 9, 1),
    ]
    within = CopyGroup("device", "device", 0, [3, 4], [4, 5])
    assert [r.length for r in runs(within)] == [1, 1]


def small_tiers() -> tuple[KVTiers, dict[str, list[torch.Tensor]]]:
    """Four device blocks and four host slots of distinct values, and a copy of each."""
    shape = KVPoolShape(2, 4, 2, 1, 2, torch.float32)
    pool = KVPool(shape, torch.device("cpu"))
    tiers = KVTiers(pool, host_slots=4)
    pool._data.copy_(torch.arange(pool._data.numel(), dtype=torch.float32).view_as(pool._data))
    assert tiers.host is not None
    host = tiers.host.data
    host.copy_(-torch.arange(host.numel(), dtype=torch.float32).view_as(host))
    blocks = {
        "device": [pool._data[:, :, :, b].clone() for b in range(4)],
        "host": [host[s].clone() for s in range(4)],
    }
    return tiers, blocks


def assert_tiers_hold(tiers: KVTiers, blocks: dict[str, list[torch.Tensor]]) -> None:
    assert tiers.host is not None
    for b in range(4):
        assert torch.equal(tiers.pool._data[:, :, :, b], blocks["device"][b])
        assert torch.equal(tiers.host.data[b], blocks["host"][b])


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(op_strategy, max_size=10))
def test_tier_copies_equal_one_by_one_copies(ops: list[tuple[str, int, str, int]]) -> None:
    tiers, blocks = small_tiers()
    for st_, s, dt, d in ops:
        blocks[dt][d] = blocks[st_][s]
    tiers.copy(ops)
    assert_tiers_hold(tiers, blocks)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(op_strategy, max_size=10))
def test_the_cuda_paths_gathers_and_scatters_equal_one_by_one_copies(
    ops: list[tuple[str, int, str, int]],
) -> None:
    """The CUDA path's gather-then-write code, run on CPU tensors (no stream), with
    chunks of at most 3 blocks."""
    tiers, blocks = small_tiers()
    for st_, s, dt, d in ops:
        blocks[dt][d] = blocks[st_][s]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv_tiers, "STAGING_BYTES", 3 * tiers.bytes_per_block)
        for g in plan_groups(ops):
            pair = {g.src_tier, g.dst_tier}
            if pair == {"device", "host"}:
                tiers._device_host(g, None)
            elif pair == {"device"}:
                tiers._device_device(g, None)
            else:
                tiers._copy_runs(g, None)
    assert_tiers_hold(tiers, blocks)


# -- validation and faults ------------------------------------------------------------


class Fields:
    """An op given as a plain object, with fields of any type."""

    def __init__(self, src_tier: object, src_index: object, dst_tier: object, dst_index: object):
        self.src_tier, self.src_index = src_tier, src_index
        self.dst_tier, self.dst_index = dst_tier, dst_index


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (BlockCopy(D, -1, H, 0), "source device index -1"),
        (Fields("device", 10**6, "host", 0), "source device index 1000000"),
        (BlockCopy(D, 0, H, SLOTS), f"destination host index {SLOTS} outside 0..{SLOTS - 1}"),
        (BlockCopy(K, SLOTS + 5, D, 0), "source disk index"),
        (Fields("gpu", 0, "host", 0), "unknown tier 'gpu'"),
        (Fields("device", True, "host", 0), "index must be an int"),
        (Fields("device", 1.0, "host", 0), "index must be an int"),
        (("device", 0, "host"), "expected src_tier"),
    ],
)
def test_bad_copies_raise_before_anything_is_copied(
    tiered: Engine, bad: object, message: str
) -> None:
    eng = tiered
    alloc = BlockAllocator(eng.num_blocks)
    src = fill_blocks(eng, alloc, 1, seed=31)[0]
    before = snapshot(eng)
    good = BlockCopy(D, src, H, 1)
    with pytest.raises(ValueError, match=message):
        eng.copy_blocks([good, bad])
    prompt = random_prompt(32, 20, eng.vocab_size)
    table = blocks_for(eng, alloc, 20)
    with pytest.raises(ValueError, match=message):
        eng.step([PrefillRequest(prompt, table, 0)], copies=[good, bad])
    after = snapshot(eng)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_bad_request_runs_no_copy(tiered: Engine) -> None:
    eng = tiered
    alloc = BlockAllocator(eng.num_blocks)
    src = fill_blocks(eng, alloc, 1, seed=33)[0]
    before = snapshot(eng)
    bad = PrefillRequest([1, 2, 3], [eng.num_blocks], 0)
    with pytest.raises(ValueError, match="block"):
        eng.step([bad], copies=[BlockCopy(D, src, H, 2)])
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(eng), strict=True))


def test_an_engine_without_tiers_refuses_tier_copies(engine: Engine) -> None:
    assert engine.host_kv_slots == engine.disk_kv_slots == 0
    assert engine.host_kv_bytes == engine.disk_kv_bytes == 0
    with pytest.raises(ValueError, match="no host tier"):
        engine.copy_blocks([BlockCopy(D, 0, H, 0)])
    engine.copy_blocks([])  # nothing to do is fine


class CopyFault(RuntimeError):
    pass


@pytest.mark.parametrize("fail_at", [0, 2, 4])
def test_a_fault_mid_copy_raises_before_the_forward(tiered: Engine, fail_at: int) -> None:
    eng = tiered
    alloc = BlockAllocator(eng.num_blocks)
    src = fill_blocks(eng, alloc, 5, seed=40 + fail_at)
    slots = [0, 19, 4, 22, 8]  # scattered: each op is its own unit of copying
    ops = [BlockCopy(D, b, H, s) for b, s in zip(src, slots, strict=True)]
    host_before = tier_data(eng, "host").clone()
    prompt = random_prompt(50, 40, eng.vocab_size)
    table = blocks_for(eng, alloc, 40)
    pool_before = eng.runner.pool._data.clone()
    layers: list[int] = []

    def copy_hook(pos: int) -> None:
        if pos == fail_at:
            raise CopyFault(f"op {pos}")

    eng.copy_fault_hook, eng.fault_hook = copy_hook, layers.append
    try:
        with pytest.raises(CopyFault, match=f"op {fail_at}"):
            eng.step([PrefillRequest(prompt, table, 0)], copies=ops)
    finally:
        eng.copy_fault_hook = eng.fault_hook = None
    assert layers == []  # the forward never started
    assert torch.equal(eng.runner.pool._data, pool_before)  # no K/V written
    host = tier_data(eng, "host")
    for i, (b, s) in enumerate(zip(src, slots, strict=True)):
        expected = device_block(eng, b) if i < fail_at else host_before[s]
        assert torch.equal(host[s], expected), f"op {i}"
    # The engine is usable: the same step, retried, runs.
    out = eng.step([PrefillRequest(prompt, table, 0)], copies=ops).prefill_logits
    assert out.isfinite().all()


# -- configuration and the disk file --------------------------------------------------


def test_sizes_and_bytes_follow_the_config(tiered: Engine, disk_dir: Path) -> None:
    eng = tiered
    assert eng.host_kv_slots == eng.disk_kv_slots == SLOTS
    assert eng.kv_block_bytes == 2 * 2 * 2 * 16 * 16 * 4  # layers, K/V, heads, B, head_dim
    assert eng.host_kv_bytes == eng.disk_kv_bytes == SLOTS * eng.kv_block_bytes
    (path,) = disk_dir.glob("cachepoint-kv-rank0-*.bin")
    assert path.stat().st_size == eng.disk_kv_bytes


def test_tiers_sized_in_bytes_take_whole_blocks(tmp_path: Path) -> None:
    per_block = 2 * 2 * 2 * 16 * 16 * 4
    config = tiered_config(
        tmp_path,
        host_kv_slots=0,
        host_kv_bytes=10 * per_block + 5,
        disk_kv_slots=0,
        disk_kv_bytes=3 * per_block,
    )
    with Engine(ModelConfig.tiny(), config, seed=1) as eng:
        assert (eng.host_kv_slots, eng.disk_kv_slots) == (10, 3)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"host_kv_bytes": 4096}, "host_kv_slots or host_kv_bytes, not both"),
        ({"disk_kv_path": None}, "needs disk_kv_path"),
        ({"host_kv_slots": -1}, "must be >= 0"),
    ],
)
def test_bad_tier_config_is_refused(
    tmp_path: Path, overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        tiered_config(tmp_path, **overrides)


def test_the_disk_file_is_created_and_removed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 5, (2, 2, 1, 4, 8), torch.float32)
    path = Path(tier.path)
    assert path.parent == tmp_path and path.stat().st_size == 5 * 2 * 2 * 4 * 8 * 4
    tier.data[3].fill_(7.0)
    assert torch.equal(
        torch.from_file(str(path), size=tier.data.numel())[3 * 128 : 4 * 128],
        torch.full((128,), 7.0),
    )  # written through to the file
    tier.close()
    assert not path.exists()
    tier.close()  # idempotent

    with Engine(ModelConfig.tiny(), tiered_config(tmp_path), seed=1) as eng:
        files = list(tmp_path.iterdir())
        assert len(files) == 1 and files[0].stat().st_size == eng.disk_kv_bytes
    assert list(tmp_path.iterdir()) == []


def test_unusable_disk_paths_give_clear_errors(tmp_path: Path) -> None:
    shape = (2, 2, 1, 4, 8)
    a_file = tmp_path / "file"
    a_file.write_bytes(b"")
    with pytest.raises(TierError, match="is not an existing directory"):
        DiskTier(a_file, 4, shape, torch.float32)
    with pytest.raises(TierError, match="is not an existing directory"):
        DiskTier(tmp_path / "missing", 4, shape, torch.float32)
    # /proc refuses new files even to root, which os.access would not tell.
    with pytest.raises(TierError, match="is not writable"):
        DiskTier("/proc", 4, shape, torch.float32)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    too_many = free // (2 * 2 * 4 * 8 * 4) + 1000
    with pytest.raises(TierError, match="GiB free; lower disk_kv_slots"):
        DiskTier(tmp_path, too_many, shape, torch.float32)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]
    with pytest.raises(ValueError, match="not writable"):
        Engine(ModelConfig.tiny(), tiered_config(Path("/proc")), seed=1)
