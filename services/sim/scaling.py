"""`cachepoint sim scaling`: measure what one router costs, on the real index and event code.

Every figure comes from running kvcore's `PrefixIndex`, the routing policies and
a replay of a trace in this process; docs/scaling.md is written from this output.
Event batches and heartbeats are encoded with the event bus's own schema
(`cachepoint.events.schema`: versioned msgspec structs in msgpack).
"""

from __future__ import annotations

import gc
import json
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cachepoint.events.schema import (
    SCHEMA_VERSION,
    EventBatch,
    Heartbeat,
    decode,
    encode,
    to_kvcore,
    to_wire,
)
from cachepoint.kvcore import BlockHash, BlockRemoved, BlockStored, KVEvent, PrefixIndex
from cachepoint.routing import ReplicaView, RoutingPolicy, make_policy
from cachepoint.sim.replica import SimReplica
from cachepoint.sim.simulator import PreparedTrace, SimConfig, Simulator
from cachepoint.sim.trace import load_trace


def encode_events(
    replica: str, epoch: int, seq: int, ts: float, events: Sequence[KVEvent]
) -> bytes:
    """One batch as the replica publishes it on `cachepoint.kv.<replica>`."""
    return encode(EventBatch(SCHEMA_VERSION, replica, epoch, seq, ts, to_wire(events)))


def decode_events(payload: bytes) -> list[KVEvent]:
    """The batch as the gateway applies it to its `PrefixIndex`."""
    return to_kvcore(decode(payload, EventBatch).events)


def heartbeat_bytes() -> int:
    """Size of one heartbeat with six- and seven-digit counters (sent once a second)."""
    beat = Heartbeat(
        SCHEMA_VERSION,
        "replica-123",
        "http://replica-123.cachepoint.svc:8000",
        7,
        "meta-llama/Llama-3.1-8B-Instruct",
        16,
        1_234_567,
        123_456,
        12,
        34,
        256,
        26_700,
        12_345,
        12_345,
        2_345,
        1_234_567_890,
        2_345_678_901,
        1_764_490_000.123,
    )
    return len(encode(beat))


def _hashes(n: int, salt: int = 0) -> list[BlockHash]:
    return [BlockHash((salt << 64 | i).to_bytes(16, "little")) for i in range(n)]


def _best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@dataclass(frozen=True, slots=True)
class ReplayTraffic:
    """Event traffic of one replay, per replica."""

    replicas: int  # replicas in the replay
    sim_s: float  # simulated seconds
    requests: int  # requests replayed
    batches: int  # event batches published (one per drain of a pool's queue)
    events: int  # kv events in them
    hashes: int  # block hashes in them
    bytes: int  # msgpack bytes of every batch
    gpu_busy: float  # mean share of time a replica's prefill engine was busy


def replay_traffic(
    trace_path: str,
    replicas: int = 16,
    capacity_frac: float = 0.01,
    block_size: int | None = None,
) -> ReplayTraffic:
    """Replay a trace (prefix_affinity routing, reuse_credit eviction) and encode every
    batch the pools publish."""
    trace = load_trace(trace_path)
    prepared = PreparedTrace.build(trace, block_size)
    config = SimConfig(
        replicas=replicas,
        capacity_frac=capacity_frac,
        policy="prefix_affinity",
        eviction="reuse_credit",
    )
    totals = {"batches": 0, "events": 0, "hashes": 0, "bytes": 0}
    seqs: dict[str, int] = {}

    def wire(replica: SimReplica, events: Sequence[KVEvent]) -> Sequence[KVEvent]:
        name = replica.view.name
        seqs[name] = seqs.get(name, 0) + 1
        payload = encode_events(name, 1, seqs[name], 0.0, events)
        totals["batches"] += 1
        totals["events"] += len(events)
        totals["hashes"] += sum(
            len(e.block_hashes) for e in events if isinstance(e, BlockStored | BlockRemoved)
        )
        totals["bytes"] += len(payload)
        return decode_events(payload)

    result = Simulator(prepared, config, wire=wire).run()
    busy = sum(r.busy_s for r in result.per_replica) / replicas / max(result.sim_time_s, 1e-9)
    return ReplayTraffic(
        replicas,
        result.sim_time_s,
        result.requests,
        totals["batches"],
        totals["events"],
        totals["hashes"],
        totals["bytes"],
        busy,
    )


def _index_memory(blocks: int) -> dict[str, float]:
    """Bytes of an index of ``blocks`` hashes, each a fresh bytes object as a decoder makes it."""
    gc.collect()
    tracemalloc.start()
    hashes = _hashes(blocks)
    index = PrefixIndex()
    index.apply(BlockStored(tuple(hashes), None))
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "index_bytes_per_block": current / blocks,
        "index_mib_per_million": current / blocks * 1e6 / 2**20,
    }


def _index_cpu(blocks: int) -> dict[str, float]:
    """Applying events, resyncing from a snapshot, decoding batches, matching and routing."""
    held = _hashes(blocks)
    index = PrefixIndex(held)
    run = 16  # hashes per stored event: an 8k-token prompt's new blocks at block size 512
    fresh = _hashes(blocks, salt=1)
    stored = [BlockStored(tuple(fresh[i : i + run]), None) for i in range(0, blocks, run)]
    removed = [BlockRemoved(ev.block_hashes) for ev in stored]

    def apply_cycle() -> None:
        index.apply_all(stored)
        index.apply_all(removed)

    cycle = _best_of(apply_cycle)
    out = {
        "apply_hashes_per_s": 2 * blocks / cycle,
        "apply_events_per_s": 2 * len(stored) / cycle,
        "apply_cpu_s_per_million": cycle / 2 / (blocks / 1e6),
        "resync_s_per_million": _best_of(lambda: PrefixIndex(held), 1) / (blocks / 1e6),
    }

    payload = encode_events("replica-0", 1, 1, 0.0, stored[:64])
    n_batches = 2000

    def decode_apply() -> None:
        sink = PrefixIndex()
        for _ in range(n_batches):
            sink.apply_all(decode_events(payload))

    out["decode_apply_hashes_per_s"] = n_batches * 64 * run / _best_of(decode_apply)
    out["wire_bytes_per_hash"] = len(payload) / (64 * run)
    out["heartbeat_bytes"] = heartbeat_bytes()

    prompt = held[:256]
    reps = 2000

    def match_many() -> None:
        for _ in range(reps):
            index.match(prompt)

    out["match_us_256_blocks"] = _best_of(match_many) / reps * 1e6
    for n in (16, 64, 256):
        views = [ReplicaView(f"r{i}", index if i == 0 else PrefixIndex()) for i in range(n)]
        policy = make_policy("prefix_affinity")

        def route_many(views: list[ReplicaView] = views, policy: RoutingPolicy = policy) -> None:
            for _ in range(200):
                policy.choose(prompt, views, 512)

        out[f"route_us_{n}_replicas"] = _best_of(route_many) / 200 * 1e6
    return out


def measure(
    trace_path: str,
    blocks: int = 1_000_000,
    block_size: int | None = None,
    capacity_frac: float = 0.01,
) -> dict[str, Any]:
    """Every figure of docs/scaling.md, measured now (the replay at ``block_size``)."""
    out: dict[str, Any] = {"blocks": blocks}
    out.update(_index_memory(blocks))
    gc.collect()
    out.update(_index_cpu(blocks))
    gc.collect()
    traffic = replay_traffic(trace_path, capacity_frac=capacity_frac, block_size=block_size)
    sim_s = max(traffic.sim_s, 1e-9)
    out["replay"] = {
        "block_size": block_size or load_trace(trace_path).block_tokens,
        "replicas": traffic.replicas,
        "requests": traffic.requests,
        "capacity_frac": capacity_frac,
        "sim_s": traffic.sim_s,
        "batches_per_replica_s": traffic.batches / traffic.replicas / sim_s,
        "hashes_per_request": traffic.hashes / traffic.requests,
        "bytes_per_batch": traffic.bytes / max(traffic.batches, 1),
        "bytes_per_request": traffic.bytes / traffic.requests,
        "bytes_per_replica_s": traffic.bytes / traffic.replicas / sim_s,
        "requests_per_replica_s": traffic.requests / traffic.replicas / sim_s,
        "prefill_busy": traffic.gpu_busy,
    }
    return out


def run_scaling(
    trace_path: str,
    blocks: int,
    *,
    block_size: int | None = None,
    capacity_frac: float = 0.01,
    as_json: bool = False,
) -> int:
    figures = measure(trace_path, blocks, block_size, capacity_frac)
    if as_json:
        print(json.dumps(figures))
        return 0
    r = figures["replay"]
    rows = [
        ("index memory per indexed block", f"{figures['index_bytes_per_block']:.0f} B"),
        ("index memory per million blocks", f"{figures['index_mib_per_million']:.0f} MiB"),
        ("apply stored/removed hashes", f"{figures['apply_hashes_per_s'] / 1e6:.2f} M hashes/s"),
        ("apply events (16 hashes each)", f"{figures['apply_events_per_s'] / 1e3:.0f} k events/s"),
        ("CPU to apply a million hashes", f"{figures['apply_cpu_s_per_million']:.3f} s"),
        ("snapshot resync, per million", f"{figures['resync_s_per_million']:.3f} s"),
        (
            "msgpack decode + apply",
            f"{figures['decode_apply_hashes_per_s'] / 1e6:.2f} M hashes/s",
        ),
        ("wire bytes per hash (64-event batch)", f"{figures['wire_bytes_per_hash']:.1f} B"),
        ("heartbeat (one a second)", f"{figures['heartbeat_bytes']} B"),
        ("match a 256-block prompt", f"{figures['match_us_256_blocks']:.1f} us"),
        ("route over 16 replicas", f"{figures['route_us_16_replicas']:.0f} us"),
        ("route over 64 replicas", f"{figures['route_us_64_replicas']:.0f} us"),
        ("route over 256 replicas", f"{figures['route_us_256_replicas']:.0f} us"),
        ("replay: kvcore block size", f"{r['block_size']} tokens"),
        (
            f"replay: {r['replicas']} replicas, prefill busy",
            f"{100 * r['prefill_busy']:.1f}% of the time",
        ),
        ("replay: requests per replica", f"{r['requests_per_replica_s']:.3f} /s"),
        ("replay: event batches per replica", f"{r['batches_per_replica_s']:.3f} /s"),
        ("replay: hashes per request", f"{r['hashes_per_request']:.1f}"),
        ("replay: bytes per batch", f"{r['bytes_per_batch']:.0f} B"),
        ("replay: bytes per request", f"{r['bytes_per_request']:.0f} B"),
        ("replay: NATS bytes per replica", f"{r['bytes_per_replica_s']:.0f} B/s"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"router scaling, {figures['blocks']:,} indexed blocks")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    return 0
