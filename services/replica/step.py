"""What one engine step runs, as the policy planned it, and what came of it.

The policy (policy.py) hands the loop (loop.py) a `StepPlan`, as vLLM's Scheduler
hands its EngineCore a SchedulerOutput; the loop runs it and gives the sampled tokens
back to `SchedulerPolicy.update`, which returns a `StepUpdate` for the loop to deliver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from cachepoint.kvcore import Allocation, BlockCopy
from cachepoint.replica.admission import AdmissionPlan
from cachepoint.replica.request_state import RequestState

R = TypeVar("R", bound=RequestState)

Sampled = list[int | Exception] | Exception
"""A step's sampled tokens, one per sampled row (or that row's error), or the error
that failed the whole step's sampling."""


@dataclass(frozen=True, slots=True)
class PrefillChunk(Generic[R]):
    """Part of one request's prefill, computed in this step."""

    seq: R  # the request it prefills
    start: int  # positions before it are in the pool already
    end: int  # positions up to here are in the pool after the step
    block_ids: list[int]  # its block table (the allocation's live list)
    samples: bool  # it ends the prefill: a token is sampled from its last position


@dataclass(frozen=True, slots=True)
class DecodeChunk(Generic[R]):
    """One request's next token, computed in this step."""

    seq: R  # the request it decodes
    token: int  # the token last sampled, fed back
    position: int  # that token's position
    block_ids: list[int]  # its block table (the allocation's live list)


@dataclass(frozen=True, slots=True)
class Admitted(Generic[R]):
    """A request the policy admitted: it holds blocks and prefills from now on."""

    seq: R
    resumed: bool  # a readmission after a preemption: it recomputes; its report stands
    # NOTE: what it was admitted with, kept here: by the time the loop traces the
    # admission the request may have lost them again (preempted by hand, in tests).
    plan: AdmissionPlan  # its admission plan (the first admission's, when resumed)
    alloc: Allocation  # the blocks it was given


@dataclass(frozen=True, slots=True)
class Preemption(Generic[R]):
    """A running request whose blocks the policy took back; it waits again."""

    seq: R
    committed: bool  # its prefill had committed: it recomputes, its report stands
    computed: int  # prefill positions it had computed when its blocks went back


@dataclass(frozen=True, slots=True)
class Ending(Generic[R]):
    """A request the policy ended (its blocks are back, it left the queue or batch):
    the loop closes its stream and resolves its future."""

    seq: R
    error: Exception | None  # what it fails with; None: it stopped (stop_reason is set)


Note = Admitted[R] | Preemption[R] | Ending[R]
"""What the policy did to one request outside the step itself, for the loop to trace
and deliver."""


@dataclass(slots=True)
class StepPlan(Generic[R]):
    """What the next engine step runs, and what the policy decided on the way."""

    decodes: list[DecodeChunk[R]] = field(default_factory=list)  # one token each, first
    prefills: list[PrefillChunk[R]] = field(default_factory=list)  # in the budget left
    copies: list[BlockCopy] = field(default_factory=list)  # tier copies, before the step
    decode_steps: int = 1  # decode steps to run back to back (a decode-only plan)
    # admissions, preemptions and endings since the last plan, in the order they happened
    notes: list[Note[R]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def seqs(self) -> list[R]:
        """Every request in the step: the prefills', then the decodes'."""
        return [c.seq for c in self.prefills] + [c.seq for c in self.decodes]

    @property
    def sampled_prefills(self) -> list[int]:
        """Which prefills finish their prompt this step (indices into ``prefills``):
        they and every decode get a token."""
        return [i for i, c in enumerate(self.prefills) if c.samples]

    @property
    def computed_tokens(self) -> int:
        """Prefill tokens the step computes (what the measured prefill rate counts)."""
        return sum(c.end - c.start for c in self.prefills)

    def drop(self, seq: R) -> None:
        """Take ``seq`` out of the step (it ended after the plan was made)."""
        self.prefills = [c for c in self.prefills if c.seq is not seq]
        self.decodes = [c for c in self.decodes if c.seq is not seq]


@dataclass(frozen=True, slots=True)
class StepUpdate(Generic[R]):
    """What one step's results mean, for the loop to deliver."""

    prefilled: list[R]  # prefills that completed: to commit, in order
    sampled: list[tuple[R, int | Exception]]  # each sampled row's token, or its error
