"""The replica's internal HTTP API: what the gateway sends and gets back."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TtlLabel = Literal["5m", "1h"]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KeySpanIn(_Strict):
    """Extra keys from ``start_block`` on (contract §3: global prefix, then org blocks)."""

    start_block: int = Field(ge=0)
    extra_keys: list[str] = Field(max_length=16)


class BreakpointIn(_Strict):
    """A `cache_control` marker, already resolved by the gateway to a token position."""

    position: int = Field(ge=1, description="prefix length in tokens the entry covers")
    ttl: TtlLabel = "5m"
    extra_keys: list[str] | None = Field(
        None, description="keys of the entry; default: the key span of its last block"
    )
    boundaries: list[int] = Field(
        default_factory=list,
        max_length=19,
        description="earlier content-block ends to look back on, nearest first",
    )


class GenerateRequest(_Strict):
    request_id: str | None = Field(None, max_length=128)
    token_ids: Annotated[list[int], Field(min_length=1)]
    key_spans: list[KeySpanIn] = Field(default_factory=list, max_length=8)
    breakpoints: list[BreakpointIn] = Field(default_factory=list, max_length=4)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop_sequences: list[str] = Field(default_factory=list, max_length=16)
    stop_token_ids: list[int] = Field(
        default_factory=list,
        max_length=16,
        description="ids that end the turn like EOS (stop_reason end_turn), even with "
        "ignore_eos; checked against the vocabulary",
    )
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    priority: int = Field(
        0,
        ge=-(2**31),
        le=2**31 - 1,
        strict=True,  # NOTE: a JSON `true`, "1" or 1.5 is not a priority
        description="scheduling priority: lower runs first (admission) and is preempted "
        "last when KV runs out; FIFO within a priority (as vLLM's priority scheduling)",
    )
    retention_owner: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="tenant charged for the blocks its entries retain (the gateway sends "
        "org:<id>); None = one shared owner for every request that names none",
    )
    owner_retained_share: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        strict=True,  # NOTE: a JSON `true` is not a share (ints still are)
        description="share of this replica's retained budget the owner may hold; "
        "None = the replica's org_retained_share",
    )

    @model_validator(mode="after")
    def _positions(self) -> GenerateRequest:
        n = len(self.token_ids)
        last = 0
        for i, bp in enumerate(sorted(self.breakpoints, key=lambda b: b.position)):
            if bp.position > n:
                raise ValueError(f"breakpoints.{i}.position {bp.position} is past the prompt ({n})")
            if bp.position == last:
                raise ValueError(f"breakpoints.{i}: two breakpoints at position {bp.position}")
            last = bp.position
            for b in bp.boundaries:
                if not 0 < b < bp.position:
                    raise ValueError(
                        f"breakpoints.{i}.boundaries: {b} must be within 1..{bp.position - 1}"
                    )
        starts = [s.start_block for s in self.key_spans]
        if starts and (starts[0] != 0 or starts != sorted(set(starts))):
            raise ValueError("key_spans must start at block 0 and strictly increase")
        return self


class CacheReport(BaseModel):
    """What the cache did for one request: the gateway's only source for billing."""

    prompt_tokens: int  # N
    engine_hit_tokens: int  # KV reused by the engine (full blocks; marker or not)
    promoted_tokens: int = 0  # of engine_hit_tokens, brought up from the host or disk tier
    computed_tokens: int  # N - engine_hit_tokens
    entry_hit_tokens: int  # A: the longest live managed entry hit (0 = none)
    entry_hit_lookback: int | None  # boundaries back from its breakpoint; None = no hit
    written_5m_tokens: int  # C - max(A, B): written under a 5m entry
    written_1h_tokens: int  # B - A: written under a 1h entry
    retention_refused: bool  # a breakpoint could not be retained; billed as input
    refusal_reason: str | None = None
    # guaranteed: written entries keep their blocks until the TTL (kvcore retention);
    # best_effort: the engine evicts by its own policy (vLLM), so an entry may be gone
    # sooner, and a later request then pays a write again instead of a read
    retention: Literal["guaranteed", "best_effort"] = "guaranteed"
    retention_reason: str | None = None  # why retention is best effort here
    scope_narrowed: bool = False  # a shared (global) prefix was cached per org here


class Timings(BaseModel):
    queue_s: float  # submit -> admitted
    prefill_s: float  # admitted -> first token sampled
    decode_s: float  # first token -> finished
    ttft_s: float  # submit -> first token
    preemptions: int = 0  # times its KV was taken back (pool full) and recomputed


class GenerateResponse(BaseModel):
    request_id: str
    replica: str
    epoch: int
    model: str
    output_token_ids: list[int]
    text: str
    stop_reason: StopReason
    stop_sequence: str | None
    output_tokens: int
    cache: CacheReport
    timings: Timings


class BlockStats(BaseModel):
    total: int
    active: int
    cached_free: int
    empty: int
    retained: int
    max_retained: int
    retained_owners: int = 0  # tenants holding at least one retained block


class TierStatsOut(BaseModel):
    """One KV tier behind the device pool; counters are ever since the epoch began."""

    tier: str  # "host" or "disk"
    slots: int  # capacity in blocks
    bytes: int  # capacity in bytes, all TP ranks together
    used: int  # blocks held (visible, or in flight)
    visible: int  # blocks a prefix can hit
    retained: int  # TTL-retained blocks here now
    max_retained: int  # this tier's retained cap
    hit_blocks: int  # blocks hit here (promotions started)
    promoted_blocks: int  # blocks that moved up into the device index
    demoted_blocks: int  # blocks whose copy into this tier completed
    evicted_blocks: int  # blocks pushed out (down a tier, or dropped)
    dropped_blocks: int  # of those, lost from every tier
    failed_copies: int  # copies into this tier that failed


class StatsResponse(BaseModel):
    replica: str
    epoch: int
    model: str
    block_size: int
    max_model_len: int
    blocks: BlockStats
    entries: int
    query_tokens: int
    hit_tokens: int
    hit_rate: float
    evictions: int
    retain_refusals: int
    quota_refusals: int = 0  # of retain_refusals, refused by a tenant's retention quota
    waiting: int
    running: int
    queued_prefill_tokens: int
    max_waiting: int
    preemptions: int = 0  # running sequences requeued to recompute (KV full), ever
    tiers: list[TierStatsOut] = []  # host and disk tiers behind the device pool, if any
    copied_blocks: int = 0  # blocks copied between tiers by the engine, ever
    copy_seconds: float = 0.0  # engine time spent on those copies, ever
    draining: bool = False  # going away: the gateway routes nothing new here
    engine: Literal["torch", "vllm"] = "torch"  # what computes the KV
    lapsed_entries: int = 0  # entries whose blocks the engine evicted before the TTL, ever


# NOTE: an hour: longer than any pod's termination grace, so a typo (seconds read as
# milliseconds) is refused rather than holding a preStop hook for days.
MAX_DRAIN_S = 3600.0


class DrainRequest(_Strict):
    timeout_s: float = Field(
        ge=0,
        le=MAX_DRAIN_S,
        description="how long to wait for the requests in flight (streams included) to end",
    )


class DrainResponse(BaseModel):
    drained: bool  # nothing was in flight when the answer was sent
    in_flight: int  # generate calls still running (0 when drained)
