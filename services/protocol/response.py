"""What a generation reports: its cache report (the gateway bills from it alone), its
timings, and the final response (``POST /v1/generate``'s answer, and the ``done``
event's)."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, model_validator

StopReason = Literal["end_turn", "max_tokens", "stop_sequence"]
STOP_REASONS: tuple[str, ...] = get_args(StopReason)


RetentionMode = Literal["guaranteed", "best_effort"]
"""guaranteed: entries keep their blocks until the TTL; best_effort: the engine may evict
them sooner."""


class CacheReport(BaseModel):
    """What the cache did for one request: the gateway's only source for billing.

    NOTE: the four billed counts (prompt, entry hit, 5m and 1h writes) are all a report
    must carry; the engine-side detail has defaults, so a peer that sends only what is
    billed (an older or simpler replica) is still read, and billed, the same."""

    prompt_tokens: int  # N
    engine_hit_tokens: int = 0  # KV reused by the engine (full blocks; marker or not)
    promoted_tokens: int = 0  # of engine_hit_tokens, brought up from the host or disk tier
    computed_tokens: int  # N - engine_hit_tokens (derived when left out)
    entry_hit_tokens: int  # A: the longest live managed entry hit (0 = none)
    entry_hit_lookback: int | None = None  # boundaries back from its breakpoint; None = no hit
    written_5m_tokens: int  # C - max(A, B): written under a 5m entry
    written_1h_tokens: int  # B - A: written under a 1h entry
    retention_refused: bool = False  # a breakpoint could not be retained; billed as input
    refusal_reason: str | None = None
    # guaranteed: written entries keep their blocks until the TTL (kvcore retention);
    # best_effort: the engine evicts by its own policy (vLLM without its retention
    # connector), so an entry may be gone sooner, and a later request then pays a
    # write again instead of a read
    retention: RetentionMode = "guaranteed"
    retention_reason: str | None = None  # why retention is best effort here
    scope_narrowed: bool = False  # a shared (global) prefix was cached per org here

    @model_validator(mode="before")
    @classmethod
    def _computed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "computed_tokens" not in data:
            prompt, hit = data.get("prompt_tokens"), data.get("engine_hit_tokens", 0)
            if type(prompt) is int and type(hit) is int:
                return {**data, "computed_tokens": prompt - hit}
        return data


class Timings(BaseModel):
    queue_s: float  # submit -> admitted
    prefill_s: float  # admitted -> first token sampled
    decode_s: float  # first token -> finished
    ttft_s: float  # submit -> first token
    # of decode_s, time in engine steps that also ran a prefill chunk (torch engine)
    decode_mixed_s: float = 0.0
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
