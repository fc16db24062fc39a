"""One request as the scheduling policy sees it: its tokens, blocks and place in line.

Pure state, with neither torch nor asyncio behind it: the policy (policy.py) runs on
it alone, and the loop's `SequenceState` (sequence.py) extends it with what delivers
the request's output (its stream, future, stop checker, sampler and spans).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cachepoint.kvcore import Allocation, BlockHash
from cachepoint.protocol import CacheReport
from cachepoint.replica.admission import AdmissionPlan, EntrySpan


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued (or preempted and requeued); holds no blocks
    PREFILLING = "prefilling"  # admitted; prefill chunks running; blocks unpublished
    DECODING = "decoding"  # prefill committed; generating
    FINISHED = "finished"  # done or failed; blocks returned


@dataclass(slots=True, eq=False)
class RequestState:
    """Scheduling state of one request. Touched only on the event-loop thread."""

    request_id: str  # unique per replica while running
    prompt: list[int]  # prompt token ids
    key_spans: list[tuple[int, list[str]]]  # (start_block, extra keys) from the gateway
    entry_spans: list[EntrySpan]  # where its managed entries are read and written
    max_tokens: int  # the most tokens it may generate (its sampling params' max_tokens)
    priority: int = 0  # lower is more important (admitted first, preempted last)
    arrival: int = 0  # submission order on this replica; FIFO within a priority
    bypassed: int = 0  # later requests admitted past it while it did not fit
    status: SeqStatus = SeqStatus.WAITING
    plan: AdmissionPlan | None = None  # set at admission
    alloc: Allocation | None = None  # set at admission
    num_computed: int = 0  # prefill positions whose KV is in the pool
    recompute: int = 0  # output tokens the next prefill recomputes (after a preemption)
    # chain hashes of the full blocks it had computed when preempted (prompt and
    # output), published then, so its readmission hits them instead of recomputing
    resume_hashes: list[BlockHash] | None = None
    # chain hashes of the prompt's full blocks, computed once while it waits (the
    # coalescing check in admission looks at them every step it is deferred)
    prompt_hashes: list[BlockHash] | None = None
    coalesced: int = 0  # admission rounds it waited for another request's prefill
    preemptions: int = 0  # times its blocks were taken back and it was requeued
    context_full: bool = False  # the pool cannot grow it: the next token is its last
    output: list[int] = field(default_factory=list)  # generated token ids
    stop_reason: str | None = None  # end_turn | max_tokens | stop_sequence
    cache: CacheReport | None = None  # final after commit
    cancelled: bool = False  # client went away; finish at the next step boundary
    promoting: bool = False  # its promotion copies are queued and have not run yet
    max_batch: int = 0  # the most sequences prefilled in one step with this one
    t_submit: float = field(default_factory=time.perf_counter)
    t_admit: float = 0.0
    # NOTE: seconds of this request's decode spent in engine steps that also ran
    # another request's prefill chunk: what a decode waits behind prefill (issue 32).
    decode_mixed_s: float = 0.0
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
