"""KV tiers under tensor parallelism: every rank copies its own shard, in step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from cachepoint.engine import BlockAllocator, Engine, PrefillRequest

from .helpers import TOL, max_rel_err, random_prompt
from .test_kv_tiers import BlockCopy, D, H, K
from .test_tp import MODEL, config


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvdisk_tp")


@pytest.fixture(scope="module")
def engines(disk_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    single = Engine(MODEL, config(1), seed=3)
    tiered = config(2)
    tiered.host_kv_slots, tiered.disk_kv_path, tiered.disk_kv_slots = 8, str(disk_dir), 8
    with Engine(MODEL, tiered, seed=3) as pair:
        yield single, pair
    assert not dist.is_initialized()
    assert list(disk_dir.iterdir()) == []  # both ranks removed their files


def test_tp2_each_rank_has_its_own_disk_file(
    engines: tuple[Engine, Engine], disk_dir: Path
) -> None:
    _, pair = engines
    names = sorted(p.name.split("-")[2] for p in disk_dir.iterdir())
    assert names == ["rank0", "rank1"]
    assert pair.host_kv_bytes == 8 * pair.kv_block_bytes


def test_tp2_reuse_through_host_and_disk_equals_tp1_recompute(
    engines: tuple[Engine, Engine],
) -> None:
    single, pair = engines
    alloc = BlockAllocator(pair.num_blocks)
    n, m = 70, 48  # 3 full blocks of 16 cached
    prompt = random_prompt(60, n, MODEL.vocab_size)
    want = single.prefill([PrefillRequest(prompt, list(range(5)), 0)]).prefill_logits

    first = alloc(3)
    pair.prefill([PrefillRequest(prompt[:m], first, 0)])
    pair.copy_blocks(
        [
            BlockCopy(D, first[0], H, 5),
            BlockCopy(D, first[1], H, 1),
            BlockCopy(D, first[2], K, 7),
            BlockCopy(H, 1, K, 2),
        ]
    )
    # The device blocks are overwritten: only the tiers keep the prefix, on each rank.
    pair.prefill([PrefillRequest(random_prompt(61, m, MODEL.vocab_size), first, 0)])
    table = alloc(5)
    promote = [
        BlockCopy(H, 5, D, table[0]),
        BlockCopy(K, 2, D, table[1]),
        BlockCopy(K, 7, D, table[2]),
    ]
    got = pair.step([PrefillRequest(prompt, table, m)], copies=promote).prefill_logits
    assert max_rel_err(got, want) <= TOL


def test_tp2_copy_fault_stops_every_rank_and_the_group_survives(
    engines: tuple[Engine, Engine],
) -> None:
    single, pair = engines
    prompt = random_prompt(62, 40, MODEL.vocab_size)
    table = list(range(60, 63))

    def hook(pos: int) -> None:
        raise KeyboardInterrupt  # even a BaseException must not strand the workers

    pair.copy_fault_hook = hook
    try:
        with pytest.raises(KeyboardInterrupt):
            pair.step([PrefillRequest(prompt, table, 0)], copies=[BlockCopy(D, 0, H, 0)])
    finally:
        pair.copy_fault_hook = None
    want = single.prefill([PrefillRequest(prompt, table, 0)]).prefill_logits
    got = pair.step([PrefillRequest(prompt, table, 0)], copies=[BlockCopy(D, 0, H, 0)])
    assert max_rel_err(got.prefill_logits, want) <= TOL
