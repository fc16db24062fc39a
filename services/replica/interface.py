"""What the replica's API, event bus, metrics and drain need from a replica's core.

Two cores implement it: `TorchCore` (loop.py: kvcore's own pool, scheduled by the
policy, the torch engine) and `VllmCore` (vllm_engine/core.py: vLLM's engine, with a
kvcore mirror of its pool). Everything above them is shared, so a vLLM replica serves
the same API and events as a torch one.
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any, Protocol

from opentelemetry import trace

from cachepoint.kvcore import BlockHash, CacheStats, KVEvent
from cachepoint.protocol import GenerateRequest, GenerateResponse, RetentionMode
from cachepoint.replica.rates import Rates
from cachepoint.replica.sequence import SequenceState
from cachepoint.replica.settings import ReplicaSettings


class EventSink(Protocol):
    """Where kv events go after each step (the NATS publisher in the cluster)."""

    def publish(self, epoch: int, events: list[KVEvent]) -> None: ...


class CountingSink:
    """Default sink: counts events and drops them (no event plane configured)."""

    def __init__(self) -> None:
        self.published = 0  # events seen, ever

    def publish(self, epoch: int, events: list[KVEvent]) -> None:
        self.published += len(events)


FinishHook = Callable[[SequenceState], None]
DeathHook = Callable[[BaseException], None]


class ReplicaCore(Protocol):
    """A replica's core (its scheduling and its engine), as the layers above it see it."""

    settings: ReplicaSettings
    name: str  # the replica's name in the fleet
    model: str  # the served model id
    epoch: int  # new at every (re)start of the engine's cache
    block_size: int  # tokens per KV block
    max_model_len: int  # longest sequence, prompt and output
    draining: bool  # going away: takes no new requests (set by the Drainer)
    failure: BaseException | None  # what killed the loop, if it died
    copied_blocks: int  # blocks copied between KV tiers, ever
    copy_s: float  # seconds spent on those copies, ever
    rates: Rates  # measured speeds, for the router
    sink: EventSink  # where kv events go
    tracer: trace.Tracer
    on_finish: FinishHook | None
    on_death: DeathHook | None
    # a test hook: called with each step's work outside every per-request guard, so
    # raising in it kills the loop (watchdog.py)
    fault_hook: Callable[[Any], None] | None

    @property
    def alive(self) -> bool:
        """The scheduling loop runs (False: the process must be restarted)."""
        ...

    @property
    def unavailable(self) -> str | None:
        """Why no request can be served right now though the loop runs (an engine
        restarting), or None. Readiness fails and heartbeats stop meanwhile."""
        ...

    @property
    def waiting(self) -> Sized:
        """Requests queued, not yet computing."""
        ...

    @property
    def running(self) -> Sized:
        """Requests computing."""
        ...

    @property
    def preemptions(self) -> int:
        """Running sequences whose KV was taken back, ever."""
        ...

    @property
    def queued_prefill_tokens(self) -> int: ...

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across every TP rank."""
        ...

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """Token ids must be below this."""
        ...

    @property
    def device(self) -> str:
        """Where the KV lives: "cpu", "cuda:0", ..."""
        ...

    @property
    def lapsed_entries(self) -> int:
        """Entries whose blocks the engine evicted before their TTL, ever (0 where
        retention is guaranteed)."""
        ...

    @property
    def retention(self) -> RetentionMode:
        """guaranteed: entries keep their blocks until the TTL; best_effort: the engine
        may evict them sooner."""
        ...

    @property
    def pinned_blocks(self) -> int | None:
        """Blocks a KV connector holds for entries (vLLM); None where the pool is ours."""
        ...

    @property
    def connector_seconds(self) -> float | None:
        """Seconds that connector spent in the engine's scheduler, ever; None = none."""
        ...

    @property
    def expired_retentions(self) -> int | None:
        """Block retentions that ran out, ever, where they are counted (vLLM)."""
        ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def submit(self, req: GenerateRequest) -> SequenceState: ...

    def cancel(self, seq: SequenceState) -> None: ...

    def result(self, seq: SequenceState) -> GenerateResponse: ...

    def cache_stats(self) -> CacheStats: ...

    def flush_events(self) -> int: ...

    def snapshot(self) -> dict[str, list[BlockHash]]:
        """Every hash the engine holds now, by tier ("device", "host", "disk")."""
        ...
