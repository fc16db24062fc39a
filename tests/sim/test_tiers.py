"""KV tiers in the simulator: hits, promotion time in TTFT, copy links, CLI flags, JSON keys."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from cachepoint.embedded.cli import main
from cachepoint.kvcore import SlotState, Tier
from cachepoint.sim.cost import ReplicaCostModel
from cachepoint.sim.links import LinkSchedule, links_of
from cachepoint.sim.simulator import PreparedTrace, SimConfig, Simulator, run_simulation

from .conftest import tiny_trace
from .test_cli import ISSUE_KEYS
from .test_simulator import req

# One replica, a device pool of 5 four-token blocks.
#   r0 [1,2,3,4] 13 tokens: cold; publishes blocks 1,2,3 (4 is partial), then frees them.
#   r1 [10,11,12,13] 13 tokens: needs 4 blocks: the 2 empty ones and the 2 oldest cached
#      (2 and 3 go before 1: a request's deeper blocks are evicted first), which are
#      demoted to the host tier when there is one.
#   r2 [1,2,3,5] 13 tokens: hits 1 on the device, then 2 and 3 in host memory.
EVICT_THEN_RETURN = [
    req(0, [1, 2, 3, 4], 13),
    req(100, [10, 11, 12, 13], 13),
    req(200, [1, 2, 3, 5], 13),
]


def _run(requests: list[dict[str, object]], **config: object):
    return run_simulation(tiny_trace(requests), SimConfig(**config))  # type: ignore[arg-type]


def test_a_host_tier_turns_evicted_prefixes_into_hits():
    alone = _run(EVICT_THEN_RETURN, replicas=1, capacity_blocks=5, eviction="lru")
    tiered = _run(EVICT_THEN_RETURN, replicas=1, capacity_blocks=5, eviction="lru", host_frac=1.0)
    # r2's usable prefix is 3 blocks; the device alone kept only block 1 of it.
    assert tiered.per_replica[0].cached_tokens == 12
    assert alone.per_replica[0].cached_tokens == 4
    assert tiered.hit_ratio > alone.hit_ratio
    assert tiered.tiers["host"]["hits"] == 2
    assert tiered.tiers["host"]["promotions"] == 2
    assert tiered.tiers["host"]["demotions"] >= 2
    assert tiered.hit_ratio_by_tier["host"] > 0
    assert sum(tiered.hit_ratio_by_tier.values()) == pytest.approx(tiered.hit_ratio)


def test_ttft_includes_the_promotion_copy_time():
    # PCIe slowed to 1 MB/s: a 4-token block (512 KiB of KV) takes half a second to promote.
    slow = ReplicaCostModel(pcie_bytes_per_s=1e6, pcie_efficiency=1.0)
    r = _run(
        EVICT_THEN_RETURN,
        replicas=1,
        capacity_blocks=5,
        eviction="lru",
        host_frac=1.0,
        cost=slow,
    )
    promote = 2 * slow.block_bytes(4) / 1e6  # r2's two host blocks, one after the other
    assert r.promoted_requests == 1
    assert r.promote_max_s == pytest.approx(promote)
    # r2 computes its last token's block after 12 cached tokens, and waited for the copies
    assert max(r.ttft_s) == pytest.approx(promote + slow.prefill_s(1, 12))
    fast = _run(EVICT_THEN_RETURN, replicas=1, capacity_blocks=5, eviction="lru", host_frac=1.0)
    cost = ReplicaCostModel()
    assert fast.promote_max_s == pytest.approx(
        2 * cost.copy_s("host", "device", cost.block_bytes(4))
    )


def test_tiers_raise_hits_on_multi_turn_sessions(sessions):
    prepared = PreparedTrace.build(sessions)
    base = dict(replicas=2, capacity_blocks=12, eviction="lru")
    alone = Simulator(prepared, SimConfig(**base)).run()  # type: ignore[arg-type]
    host = Simulator(prepared, SimConfig(**base, host_frac=0.5)).run()  # type: ignore[arg-type]
    disk = Simulator(prepared, SimConfig(**base, host_frac=0.1, disk_frac=0.5)).run()  # type: ignore[arg-type]
    assert host.hit_ratio > alone.hit_ratio
    assert host.tiers["host"]["promotions"] > 0
    assert disk.tiers["disk"]["demotions"] > 0
    assert disk.hit_ratio_by_tier["disk"] > 0
    assert disk.hit_ratio > alone.hit_ratio


def test_router_index_holds_each_tier_exactly_after_a_replay(sessions):
    prepared = PreparedTrace.build(sessions)
    for delay in (0.0, 0.5):
        cfg = SimConfig(
            replicas=3, capacity_blocks=12, host_frac=0.1, disk_frac=0.2, event_delay_s=delay
        )
        sim = Simulator(prepared, cfg)
        result = sim.run()
        assert result.tiers["disk"]["demotions"] > 0
        for replica in sim.replicas:
            index = replica.view.index
            assert replica.pending == type(replica.pending)()  # every copy batch finished
            assert index.size(Tier.DEVICE) == len(replica.pool.cached)
            assert all(index.tier_of(h) is Tier.DEVICE for h in replica.pool.cached)
            lower = replica.pool.lower
            assert lower is not None
            for store in lower:
                visible = [s.block_hash for s in store.slots if s.state is SlotState.VISIBLE]
                assert index.size(store.tier) == len(visible)
                assert all(index.tier_of(h) is store.tier for h in visible if h is not None)


@dataclass(frozen=True)
class _Copy:
    src_tier: str
    dst_tier: str


def test_links_queue_copies_in_order_and_promotions_wait_behind_disk_writes():
    cost = ReplicaCostModel()
    links = LinkSchedule(cost, cost.block_bytes(512))
    nbytes = cost.block_bytes(512)
    write = cost.copy_s("host", "disk", nbytes)
    d2h = cost.copy_s("device", "host", nbytes)
    h2d = cost.copy_s("host", "device", nbytes)
    read = cost.copy_s("disk", "device", nbytes)
    copies = [
        _Copy("device", "host"),
        _Copy("device", "host"),
        _Copy("host", "disk"),
        _Copy("host", "device"),
        _Copy("disk", "device"),
    ]
    t = links.schedule(copies, 10.0)
    # PCIe is full duplex: the host promotion does not wait for the demotions ...
    # ... but the disk promotion waits for the disk write on the drive, then for the
    # host promotion on the host -> device link.
    assert t.promoted_at == pytest.approx(10.0 + max(write, h2d) + read)
    assert t.demoted_at == pytest.approx(max(10.0 + 2 * d2h, 10.0 + write))
    assert t.promoted_bytes == {"host": nbytes, "disk": nbytes}
    assert t.demoted_bytes == {"host": 2 * nbytes, "disk": nbytes}
    assert links.busy_s["d2h"] == pytest.approx(2 * d2h)
    assert links.busy_s["nvme"] == pytest.approx(write + read)
    # a later batch queues behind what is still on the links
    again = links.schedule([_Copy("device", "host")], 10.0)
    assert again.demoted_at == pytest.approx(10.0 + 3 * d2h)
    assert links_of("disk", "device") == ("h2d", "nvme")


def test_copy_bandwidth_is_the_slowest_link_on_the_way():
    cost = ReplicaCostModel()
    pcie = cost.pcie_bytes_per_s * cost.pcie_efficiency
    disk_read = cost.disk_read_bytes_per_s * cost.disk_efficiency
    assert cost.copy_bytes_per_s("host", "device") == pytest.approx(pcie)
    assert cost.copy_bytes_per_s("device", "host") == pytest.approx(pcie)
    assert cost.copy_bytes_per_s("disk", "device") == pytest.approx(min(pcie, disk_read))
    assert cost.copy_bytes_per_s("host", "disk") == pytest.approx(
        cost.disk_write_bytes_per_s * cost.disk_efficiency
    )
    # Llama-3.1-8B: 128 KiB a token; a 32k-token prefix comes back from host memory in
    # well under a tenth of the time its recompute takes
    assert cost.copy_s("host", "device", 32768 * cost.kv_bytes_per_token) < 0.1 * cost.prefill_s(
        32768, 0
    )
    with pytest.raises(ValueError, match="between two tiers"):
        cost.copy_bytes_per_s("host", "host")
    with pytest.raises(ValueError, match="pcie_efficiency"):
        ReplicaCostModel(pcie_efficiency=0.0)
    with pytest.raises(ValueError, match="disk_read_bytes_per_s"):
        ReplicaCostModel(disk_read_bytes_per_s=-1.0)


def test_config_rejects_bad_tier_shares():
    for bad in (-0.01, math.nan, math.inf):
        with pytest.raises(ValueError, match="host_frac"):
            SimConfig(host_frac=bad)
        with pytest.raises(ValueError, match="disk_frac"):
            SimConfig(disk_frac=bad)


def test_cli_tier_flags_and_json_keys(trace_file: Path, capsys: pytest.CaptureFixture[str]):
    args = ["sim", "--trace", str(trace_file), "--replicas", "2", "--capacity-frac", "2%"]
    assert main([*args, "--host-frac", "8%", "--disk-frac", "0.1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= ISSUE_KEYS  # the capacity-planning keys are all still there
    assert out["host_frac"] == pytest.approx(0.08)
    assert out["disk_frac"] == pytest.approx(0.1)
    assert out["host_slots"] > 0 and out["disk_slots"] > out["host_slots"]
    assert set(out["hit_ratio_by_tier"]) == {"device", "host", "disk"}
    for tier in ("host", "disk"):
        row = out["tiers"][tier]
        assert {"hits", "promotions", "demotions", "evictions", "promoted_bytes"} <= set(row)
    assert out["tiers"]["host"]["demotions"] > 0
    assert set(out["link_busy"]) == {"h2d", "d2h", "nvme"}

    assert main([*args, "--json"]) == 0
    device_only = json.loads(capsys.readouterr().out)
    assert device_only["tiers"] == {} and device_only["host_slots"] == 0
    assert device_only["hit_ratio_by_tier"]["host"] == 0.0

    assert main([*args, "--host-frac", "8%", "--no-progress"]) == 0
    human = capsys.readouterr().out
    assert "host tier" in human and "promoted" in human


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--host-frac", "2", "must be within [0, 1]"),
        ("--host-frac", "-1%", "must be within [0, 1]"),
        ("--disk-frac", "lots", "expected a fraction"),
    ],
)
def test_cli_refuses_bad_tier_fractions_clearly(
    trace_file: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
):
    with pytest.raises(SystemExit) as exc:
        main(["sim", "--trace", str(trace_file), f"{flag}={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and message in err
    assert "Traceback" not in err


def test_tiered_replays_are_deterministic(sessions):
    prepared = PreparedTrace.build(sessions)
    cfg = SimConfig(replicas=3, capacity_blocks=12, host_frac=0.1, disk_frac=0.2, seed=4)
    first = Simulator(prepared, cfg).run().to_json(full=True)
    second = Simulator(prepared, cfg).run().to_json(full=True)
    for out in (first, second):
        out.pop("elapsed_s")
    assert first == second
    assert first["tiers"]["host"]["promotions"] > 0
