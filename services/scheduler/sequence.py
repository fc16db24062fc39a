"""One request's life inside the scheduler."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

import torch
from opentelemetry.context import Context
from opentelemetry.trace import Span

from cachepoint.engine import SamplingParams, StopChecker
from cachepoint.kvcore import Allocation, BlockHash

from .admission import Breakpoint, CachePlan
from .schemas import CacheReport


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued (or preempted and requeued); holds no blocks
    PREFILLING = "prefilling"  # admitted; prefill chunks running; blocks unpublished
    DECODING = "decoding"  # prefill committed; generating
    FINISHED = "finished"  # done or failed; blocks returned


@dataclass(slots=True, frozen=True)
class TokenEvent:
    """A streamed piece of output."""

    token_id: int  # the sampled token
    text: str  # text that became safe to stream with it (may be empty)


@dataclass(slots=True, frozen=True)
class PrefillDone:
    """The prefill committed: the cache report is final from here on."""

    cache: CacheReport


@dataclass(slots=True, eq=False)
class SequenceState:
    """Scheduler state of one request. Touched only on the event-loop thread."""

    request_id: str  # unique per replica while running
    prompt: list[int]  # prompt token ids
    key_spans: list[tuple[int, list[str]]]  # (start_block, extra keys) from the gateway
    breakpoints: list[Breakpoint]  # resolved markers
    params: SamplingParams  # sampling and stop rules
    stream: asyncio.Queue[TokenEvent | PrefillDone | None]  # None closes the stream
    done: asyncio.Future[None]  # resolved (or failed) when finished
    stopper: StopChecker  # stop strings and streamable text
    priority: int = 0  # lower is more important (admitted first, preempted last)
    arrival: int = 0  # submission order on this replica; FIFO within a priority
    bypassed: int = 0  # later requests admitted past it while it did not fit
    status: SeqStatus = SeqStatus.WAITING
    plan: CachePlan | None = None  # set at admission
    alloc: Allocation | None = None  # set at admission
    generator: torch.Generator | None = None  # per-sequence sampling RNG
    num_computed: int = 0  # prefill positions whose KV is in the pool
    recompute: int = 0  # output tokens the next prefill recomputes (after a preemption)
    # chain hashes of the full blocks it had computed when preempted (prompt and
    # output), published then, so its readmission hits them instead of recomputing
    resume_hashes: list[BlockHash] | None = None
    preemptions: int = 0  # times its blocks were taken back and it was requeued
    context_full: bool = False  # the pool cannot grow it: the next token is its last
    output: list[int] = field(default_factory=list)  # generated token ids
    stop_reason: str | None = None  # end_turn | max_tokens | stop_sequence
    cache: CacheReport | None = None  # final after commit
    cancelled: bool = False  # client went away; finish at the next step boundary
    otel_ctx: Context | None = None  # the request's trace context (its server span)
    prefill_span: Span | None = None  # open from admission to commit (or abort)
    promote_span: Span | None = None  # open from admission until its tier copies ran
    promoting: bool = False  # its promotion copies are queued and have not run yet
    decode_span: Span | None = None  # open from the first token to the end
    max_batch: int = 0  # the most sequences prefilled in one step with this one
    t_submit_ns: int = field(default_factory=time.time_ns)  # wall clock, for span starts
    t_submit: float = field(default_factory=time.perf_counter)
    t_admit: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0

    @property
    def rank(self) -> tuple[int, int]:
        """Queue order: priority, then arrival. The largest rank is preempted first."""
        return (self.priority, self.arrival)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def prefill_len(self) -> int:
        """Tokens the current admission prefills: the prompt, plus the output so far
        when it recomputes after a preemption."""
        return len(self.prompt) + self.recompute

    @property
    def remaining_prefill(self) -> int:
        return self.prefill_len - self.num_computed

    def prefill_tokens(self, end: int) -> list[int]:
        """The first ``end`` tokens of what this admission prefills."""
        n = len(self.prompt)
        return self.prompt[:end] if end <= n else self.prompt + self.output[: end - n]
