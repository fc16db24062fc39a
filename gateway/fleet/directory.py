"""The gateway's view of the fleet: one prefix index and one load record per replica,
fed only by the replicas' events and heartbeats (contract §4).

Pure bookkeeping with no I/O: the NATS side (`bus.py`) feeds it and performs the
snapshot requests it asks for, so every rule below is unit-testable.

- A batch whose seq skips ahead starts a snapshot resync; batches that arrive
  meanwhile are buffered and replayed after the snapshot.
- A batch or heartbeat from a newer epoch drops the replica's index first.
- A replica whose heartbeat is older than ``miss_factor`` intervals is not live, so
  it is never routed to; its next heartbeat brings it back.
- Events and snapshots carry the tier of each block (device, host, disk), and each
  heartbeat the replica's cost model, from which the view's `TierValue` prices a
  lower-tier hit for the routing policies.
- A replica whose health check fails is not live until one passes or it restarts.
- A replica whose heartbeat says ``draining`` leaves routing at once (`views`); the
  requests already sent there finish. Only a new epoch (a new process) brings it back.
- Routing is per model: `views(model)` lists only the replicas serving that model.
- Refused, changing nothing: an epoch (the replica's start time) further in the
  future than ``max_epoch_skew_s``, and a URL the `UrlPolicy` does not give the name.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cachepoint.events import schema
from cachepoint.gateway.fleet.trust import UrlPolicy
from cachepoint.kvcore import BlockHash, BlockRemoved, Tier
from cachepoint.routing import ReplicaView, tier_value

log = logging.getLogger(__name__)

_LOG_EVERY_S = 60.0  # one log line per replica and reason per minute at most
GONE_BLOCKS = 65_536  # removed blocks remembered per replica (about 100 bytes each)


@dataclass(slots=True)
class ReplicaState:
    """Everything the gateway tracks about one replica."""

    view: ReplicaView  # what routing policies read: index, load, liveness
    url: str | None = None  # its HTTP API, from heartbeats (or static config)
    epoch: int = 0  # current epoch; older batches are ignored
    last_seq: int = 0  # last batch applied in this epoch
    last_heartbeat: float = 0.0  # monotonic time of the last heartbeat (0 = never)
    last_polled: float = 0.0  # monotonic time of the last /v1/stats answer
    last_applied: float = 0.0  # monotonic time the index last changed (freshness)
    block_size: int = 0
    model: str = ""
    resyncing: bool = False  # a snapshot request is in flight
    healthy: bool = True  # False after a failed health check, until one passes or a restart
    draining: bool = False  # it said it is going away: no new requests, until a new epoch
    pending: list[schema.EventBatch] = field(default_factory=list)  # held during resync
    # block hash -> the tier it last left, for blocks its events removed from every tier
    # (newest last, at most GONE_BLOCKS): what cache diagnostics name for an eviction
    gone: OrderedDict[BlockHash, Tier] = field(default_factory=OrderedDict)

    @property
    def name(self) -> str:
        return self.view.name


class ReplicaDirectory:
    """Replica name -> state. Call `sweep()` periodically to age out silent replicas."""

    def __init__(
        self,
        *,
        heartbeat_interval_s: float = 1.0,
        miss_factor: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        urls: UrlPolicy | None = None,
        max_epoch_skew_s: float = 60.0,
        wall_ns: Callable[[], int] = time.time_ns,
        block_size: int | None = None,
    ) -> None:
        self.interval = heartbeat_interval_s
        self.miss_after = heartbeat_interval_s * miss_factor
        self.clock = clock
        self.urls = urls or UrlPolicy()
        self.max_skew_ns = int(max_epoch_skew_s * 1e9)
        self.wall_ns = wall_ns  # epochs are wall-clock nanoseconds (time.time_ns)
        self.block_size = block_size  # what routing hashes prompts with; None = unchecked
        self.replicas: dict[str, ReplicaState] = {}
        self.resyncs = 0  # snapshot resyncs started, ever
        self.heartbeat_misses = 0  # replicas taken out of routing for silence, ever
        self.health_downs = 0  # replicas marked unhealthy by a failed health check, ever
        self.batches_applied = 0
        self.rejections: dict[str, int] = {}  # messages refused, by reason
        self._logged: dict[tuple[str, str], float] = {}  # (reason, name) -> last log time

    # ------------------------------------------------------------- refusals

    def reject(self, reason: str, name: str, detail: str) -> None:
        """Count a refused message (by reason) and log it, at most once a minute per
        replica and reason: a flood of forgeries must not flood the log."""
        self.rejections[reason] = self.rejections.get(reason, 0) + 1
        self._warn(reason, name, f"event plane: refused {reason} for replica {name!r}: {detail}")

    def _warn(self, reason: str, name: str, message: str) -> None:
        """Log ``message`` at most once a minute per replica and reason."""
        now = self.clock()
        last = self._logged.get((reason, name))
        if last is None or now - last >= _LOG_EVERY_S:
            if len(self._logged) >= 10_000:  # forged names must not grow it without end
                self._logged.clear()
            self._logged[(reason, name)] = now
            log.warning("%s", message)

    def _check_block_size(self, name: str, block_size: int) -> None:
        # NOTE: routing hashes every prompt with one block size; a replica on another
        # (vLLM on the CPU takes multiples of 32) is still routed by load, but none of
        # its cached blocks can ever match. Said, not refused: the fleet keeps serving.
        if self.block_size is not None and block_size != self.block_size:
            self._warn(
                "block_size",
                name,
                f"replica {name!r} uses KV blocks of {block_size} tokens but the gateway "
                f"hashes prompts in blocks of {self.block_size}: none of its cache hits "
                "can be routed to; give the gateway (--block-size) and every replica one "
                "block size",
            )

    def _future_epoch(self, name: str, epoch: int) -> bool:
        # NOTE: one forged epoch of 2**62 would otherwise make every real message of
        # this replica "older" until the gateway restarts.
        ahead = epoch - self.wall_ns()
        if ahead <= self.max_skew_ns:
            return False
        self.reject("future_epoch", name, f"epoch {epoch} is {ahead / 1e9:.0f}s in the future")
        return True

    def _bad_url(self, name: str, url: str) -> bool:
        why = self.urls.refuses(name, url)
        if why is None:
            return False
        self.reject("url", name, why)
        return True

    # ----------------------------------------------------------------- state

    def _state(self, name: str) -> ReplicaState:
        st = self.replicas.get(name)
        if st is None:
            st = ReplicaState(view=ReplicaView(name=name, live=False))
            self.replicas[name] = st
        return st

    def _new_epoch(self, st: ReplicaState, epoch: int) -> None:
        st.view.index.replace(())
        st.view.routed.clear()  # a new process holds nothing of what was sent to the old one
        st.gone.clear()  # nor was anything it removed evicted: it restarted
        st.epoch = epoch
        st.last_seq = 0
        st.pending.clear()
        st.resyncing = False
        st.healthy = True  # a new process: judge it afresh
        st.draining = False
        st.last_applied = self.clock()

    # ------------------------------------------------------------ heartbeats

    def on_heartbeat(self, hb: schema.Heartbeat) -> bool:
        """Record load and liveness. True when the heartbeat reveals missed batches
        (its last_seq is ahead of what was applied): the caller should resync."""
        if self._future_epoch(hb.name, hb.epoch) or self._bad_url(hb.name, hb.url):
            return False
        st = self._state(hb.name)
        if hb.epoch > st.epoch:
            self._new_epoch(st, hb.epoch)
        elif hb.epoch < st.epoch:
            return False  # a late heartbeat from the previous process
        st.url = hb.url
        st.block_size = hb.block_size
        self._check_block_size(hb.name, hb.block_size)
        st.model = hb.model
        self._set_draining(st, hb.draining)
        st.last_heartbeat = self.clock()
        v = st.view
        v.queued_prefill_tokens = hb.queued_prefill_tokens
        v.running = hb.running
        v.waiting = hb.waiting
        v.max_waiting = hb.max_waiting
        v.tier_value = tier_value(
            hb.kv_bytes_per_token,
            hb.prefill_tokens_per_s,
            hb.host_read_bytes_per_s,
            hb.disk_read_bytes_per_s,
        )
        v.live = st.healthy
        return hb.last_seq > st.last_seq and not st.resyncing

    def on_stats(self, name: str, url: str, stats: Mapping[str, Any]) -> bool:
        """Load from a replica's /v1/stats (the fallback while NATS is down).
        False when refused (a future epoch, or a URL that is not the name's)."""
        # NOTE: every field is read before anything changes: a malformed answer (the
        # caller catches KeyError, ValueError, TypeError) leaves the record untouched.
        epoch = int(stats["epoch"])
        block_size, model = int(stats["block_size"]), str(stats["model"])
        load = [int(stats[k]) for k in ("queued_prefill_tokens", "running", "waiting")]
        max_waiting = int(stats["max_waiting"])
        draining = stats.get("draining", False) is True  # absent in older replicas' stats
        if self._future_epoch(name, epoch) or self._bad_url(name, url):
            return False
        st = self._state(name)
        if epoch > st.epoch:
            self._new_epoch(st, epoch)
        st.url = url
        st.block_size = block_size
        self._check_block_size(name, block_size)
        st.model = model
        self._set_draining(st, draining)
        st.last_polled = self.clock()
        v = st.view
        v.queued_prefill_tokens, v.running, v.waiting = load
        v.max_waiting = max_waiting
        v.live = st.healthy
        return True

    def _set_draining(self, st: ReplicaState, draining: bool) -> None:
        # NOTE: one way within an epoch: a replica never stops draining; a stale message
        # sent before its drain began must not put it back in routing.
        if draining and not st.draining:
            log.info("replica %s is draining: out of routing for new requests", st.name)
        st.draining = st.draining or draining

    def sweep(self) -> list[str]:
        """Take silent replicas out of routing; returns the names just taken out."""
        now = self.clock()
        out = []
        for st in self.replicas.values():
            fresh = max(st.last_heartbeat, st.last_polled)
            live = fresh > 0 and now - fresh <= self.miss_after and st.healthy
            if st.view.live and not live:
                self.heartbeat_misses += 1
                out.append(st.name)
            st.view.live = live
        return out

    # ---------------------------------------------------------------- events

    def on_batch(self, batch: schema.EventBatch) -> bool:
        """Apply a batch in order. True when a gap was found and a resync must start."""
        if self._future_epoch(batch.replica, batch.epoch):
            return False
        st = self._state(batch.replica)
        if batch.epoch < st.epoch:
            return False
        if batch.epoch > st.epoch:
            self._new_epoch(st, batch.epoch)
        if st.resyncing:
            st.pending.append(batch)
            return False
        if batch.seq <= st.last_seq:
            return False  # a duplicate, or already covered by a snapshot
        if batch.seq != st.last_seq + 1:
            st.pending.append(batch)
            st.resyncing = True
            self.resyncs += 1
            return True
        self._apply(st, batch)
        return False

    def _apply(self, st: ReplicaState, batch: schema.EventBatch) -> None:
        events = list(schema.to_kvcore(batch.events))
        st.view.index.apply_all(events)
        self._note_gone(st, events)
        routed = st.view.routed
        if routed:
            for event in events:
                hashes = getattr(event, "block_hashes", None)
                if hashes is None:  # AllBlocksCleared: whatever was on its way is moot
                    routed.clear()
                else:
                    routed.forget(hashes)
        st.last_seq = batch.seq
        st.last_applied = self.clock()
        self.batches_applied += 1

    @staticmethod
    def _note_gone(st: ReplicaState, events: list[Any]) -> None:
        """Remember the tier each block left last when no tier holds it any more.

        NOTE: kept when the block is stored again: the turn that missed it recomputes
        and stores it before it is billed, and its bill asks where it was evicted from."""
        gone, index = st.gone, st.view.index
        for event in events:
            if isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    if index.tier_of(h) is None:
                        gone[h] = event.tier
                        gone.move_to_end(h)
                while len(gone) > GONE_BLOCKS:
                    gone.popitem(last=False)

    def evicted_from(self, name: str, block_hash: BlockHash) -> Tier | None:
        """The tier ``name``'s events last removed ``block_hash`` from when no tier held
        it any more (None: never removed so, by this process, or forgotten)."""
        st = self.replicas.get(name)
        return st.gone.get(block_hash) if st is not None else None

    def begin_resync(self, name: str) -> None:
        """Mark a resync in flight (e.g. after reconnecting to NATS)."""
        st = self._state(name)
        if not st.resyncing:
            st.resyncing = True
            self.resyncs += 1

    def on_snapshot(self, snap: schema.Snapshot) -> bool:
        """Replace the index, then replay buffered batches past the snapshot.
        True when another gap remains and a new resync is needed."""
        if self._future_epoch(snap.replica, snap.epoch):
            self.resync_failed(snap.replica)
            return False
        st = self._state(snap.replica)
        if snap.epoch < st.epoch:
            st.resyncing = False
            return True
        if snap.epoch > st.epoch:
            self._new_epoch(st, snap.epoch)
        device = schema.to_kvcore_hashes(snap.block_hashes)
        host = schema.to_kvcore_hashes(snap.host_hashes)
        disk = schema.to_kvcore_hashes(snap.disk_hashes)
        st.view.index.replace(device, host=host, disk=disk)
        for hashes in (device, host, disk):
            st.view.routed.forget(hashes)
        st.last_seq = snap.seq
        st.last_applied = self.clock()
        st.resyncing = False
        pending = sorted(
            (b for b in st.pending if b.epoch == st.epoch and b.seq > snap.seq),
            key=lambda b: b.seq,
        )
        st.pending.clear()
        for b in pending:
            if b.seq != st.last_seq + 1:
                st.pending = [x for x in pending if x.seq > st.last_seq]
                st.resyncing = True
                self.resyncs += 1
                return True
            self._apply(st, b)
        return False

    def resync_failed(self, name: str) -> None:
        """The snapshot request failed; keep what is buffered and try again later."""
        self._state(name).resyncing = False

    # --------------------------------------------------------------- queries

    def views(self, model: str | None = None) -> list[ReplicaView]:
        """What a request may be routed to: the replicas with a URL that are not
        draining, and with ``model`` only those that serve it."""
        return [
            st.view
            for st in self.replicas.values()
            if st.url is not None and not st.draining and (model is None or st.model == model)
        ]

    def served_models(self) -> set[str]:
        """Every model a known replica reports, live, draining or not."""
        return {st.model for st in self.replicas.values() if st.url is not None and st.model}

    def draining(self, model: str | None = None) -> list[str]:
        """The draining replicas (of ``model``), by name."""
        return [
            st.name
            for st in self.replicas.values()
            if st.draining and (model is None or st.model == model)
        ]

    def url_of(self, name: str) -> str | None:
        st = self.replicas.get(name)
        return st.url if st else None

    def freshness_s(self, name: str) -> float | None:
        """Seconds since the replica's index last changed (None if never)."""
        st = self.replicas.get(name)
        if st is None or not st.last_applied:
            return None
        return self.clock() - st.last_applied

    def mark_down(self, name: str) -> None:
        """A call to it failed at the transport: stop routing there until it speaks."""
        st = self.replicas.get(name)
        if st is not None:
            st.view.live = False
            st.view.routed.clear()  # what was sent there may never be computed
            st.last_heartbeat = st.last_polled = 0.0

    def mark_unhealthy(self, name: str, why: str) -> None:
        """Its health check failed: no routing there until one passes (`mark_healthy`)
        or it starts a new epoch, whatever its heartbeats say meanwhile."""
        st = self.replicas.get(name)
        if st is None or not st.healthy:
            return
        st.healthy = False
        # NOTE: counted on the health transition, whether or not a missed heartbeat had
        # already taken it out: otherwise the count depends on which check came first.
        self.health_downs += 1
        st.view.live = False
        st.view.routed.clear()
        log.warning("replica %s out of routing: health check failed (%s)", name, why)

    def mark_healthy(self, name: str) -> None:
        """Its health check passed: live again if it is heard from recently."""
        st = self.replicas.get(name)
        if st is None or st.healthy:
            return
        st.healthy = True
        fresh = max(st.last_heartbeat, st.last_polled)
        st.view.live = fresh > 0 and self.clock() - fresh <= self.miss_after
        log.info("replica %s back in routing: health check passed", name)
