"""The scheduling policy on its own: kvcore's real pool and manager, an engine known only
by its shape, no engine, no event loop. A small driver stands in for the loop: it runs
each plan by "sampling" a fixed token for every row that gets one."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

from cachepoint.kvcore import DEFAULT_EVICTION
from cachepoint.replica.policy import EngineShape, SchedulerPolicy
from cachepoint.replica.request_state import RequestState, SeqStatus
from cachepoint.replica.step import Admitted, Ending, Preemption, StepPlan

B = 4  # tokens per block
TOKEN = 7  # what the driver samples


@dataclass(slots=True)
class Settings:
    """The policy's settings (`PolicySettings`), with no pydantic behind them."""

    name: str = "r-policy"
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    decode_steps: int = 1
    decode_reserve_blocks: int = 1
    readmit_headroom_tokens: int = 0
    max_admission_bypass: int = 32
    coalesce_prefills: bool = True
    retained_share: float = 0.5
    org_retained_share: float = 0.5
    eviction: str = DEFAULT_EVICTION


def _policy(num_blocks: int = 64, **settings: object) -> SchedulerPolicy[RequestState]:
    shape = EngineShape(block_size=B, num_blocks=num_blocks)
    return SchedulerPolicy(shape, Settings(**settings))  # type: ignore[arg-type]


class Requests:
    """Requests numbered in arrival order, as a core numbers them."""

    def __init__(self, policy: SchedulerPolicy[RequestState]) -> None:
        self.policy = policy
        self.arrivals = 0

    def add(self, prompt_len: int, max_tokens: int, priority: int = 0) -> RequestState:
        seq = RequestState(
            request_id=f"req-{self.arrivals}",
            prompt=[(self.arrivals * 31 + i) % 97 + 1 for i in range(prompt_len)],
            key_spans=[],
            entry_spans=[],
            max_tokens=max_tokens,
            priority=priority,
            arrival=self.arrivals,
        )
        self.arrivals += 1
        self.policy.add(seq)
        return seq


def _step(policy: SchedulerPolicy[RequestState], **kw: bool) -> StepPlan[RequestState]:
    """One turn of the loop: schedule, run every step of the plan, deliver."""
    plan = policy.schedule(**kw)
    rows = len(plan.sampled_prefills) + len(plan.decodes)
    for _ in range(plan.decode_steps):
        update = policy.update(plan, [TOKEN] * rows)
        for seq in update.prefilled:
            policy.commit(seq)
        for seq, token in update.sampled:
            if seq.status is SeqStatus.FINISHED:
                continue
            assert isinstance(token, int)
            seq.output.append(token)
            if len(seq.output) >= seq.max_tokens or seq.context_full:
                seq.stop_reason = "max_tokens"
                policy.finish(seq)
    return plan


def _assert_clean(policy: SchedulerPolicy[RequestState]) -> None:
    policy.pool.check_invariants()
    assert all(b.ref_cnt == 0 for b in policy.pool.blocks)
    assert not policy.running
    assert not policy.waiting


def test_admission_takes_priority_then_arrival() -> None:
    policy = _policy(max_num_seqs=1)
    reqs = Requests(policy)
    a = reqs.add(8, 4, priority=0)
    b = reqs.add(8, 4, priority=5)
    c = reqs.add(8, 4, priority=-1)
    d = reqs.add(8, 4, priority=0)
    assert policy.waiting == [c, a, d, b]
    order = []
    while policy.waiting or policy.running:
        plan = _step(policy)
        order += [n.seq for n in plan.notes if isinstance(n, Admitted)]
    assert order == [c, a, d, b]
    assert [len(q.output) for q in (a, b, c, d)] == [4] * 4
    _assert_clean(policy)


def test_a_preempted_request_requeues_at_its_rank() -> None:
    policy = _policy(max_num_seqs=2)
    reqs = Requests(policy)
    old = reqs.add(8, 4, priority=1)
    urgent = reqs.add(8, 4, priority=0)
    newer = reqs.add(8, 4, priority=1)
    later = reqs.add(8, 4, priority=2)
    policy.admit()
    assert policy.running == [urgent, old]
    policy.preempt(old)
    assert policy.waiting == [old, newer, later]
    policy.preempt(urgent)
    assert policy.waiting == [urgent, old, newer, later]
    notes = policy.take_notes()
    assert [type(n) for n in notes] == [Admitted, Admitted, Preemption, Preemption]
    assert [n.seq for n in notes] == [urgent, old, old, urgent]
    assert policy.preemptions == 2


def test_admission_reserves_the_prompt_and_one_block_then_grows_a_block_at_a_time() -> None:
    policy = _policy()
    seq = Requests(policy).add(8, 20)
    policy.admit()
    assert seq.alloc is not None
    assert len(seq.alloc.blocks) == 3  # 8 prompt slots + a block of headroom: 12
    _step(policy)  # the prefill: its first token
    held = []
    while seq.status is not SeqStatus.FINISHED:
        _step(policy)
        held.append(len(seq.alloc.blocks) if seq.alloc.blocks else None)
    # Before each decode: the slot it writes (prompt + output - 1) and one more, never
    # past the last slot it can use (prompt + max_tokens - 1 = 27: 7 blocks).
    want = [-(-min(8 + k + 1, 27) // B) for k in range(1, 20)]
    assert held[:-1] == want[:-1]
    assert len(seq.output) == 20
    _assert_clean(policy)


@pytest.mark.parametrize(
    ("priorities", "victim"),
    [((0, 0), 1), ((3, 0), 0), ((0, 3), 1)],
    ids=["newest-among-equals", "lowest-priority-first-in", "lowest-priority-last-in"],
)
def test_a_full_pool_preempts_the_lowest_priority_newest_request(
    priorities: tuple[int, int], victim: int
) -> None:
    # 6 blocks: two prompts of 8 with a block of headroom each fill the pool; the
    # first growth past 12 slots must take a block from someone.
    policy = _policy(num_blocks=6)
    reqs = Requests(policy)
    seqs = [reqs.add(8, 16, priority=p) for p in priorities]
    _step(policy)
    assert all(s.status is SeqStatus.DECODING for s in seqs)
    while not policy.preemptions:
        plan = _step(policy)
    preempted = [n for n in plan.notes if isinstance(n, Preemption)]
    assert [n.seq for n in preempted] == [seqs[victim]]
    assert preempted[0].committed
    assert seqs[victim].status is SeqStatus.WAITING and seqs[victim].alloc is None
    assert seqs[victim].recompute == len(seqs[victim].output)
    assert seqs[1 - victim] in policy.running
    # No admission in the round that preempted: the victim waits at least one step.
    assert not [n for n in plan.notes if isinstance(n, Admitted)]
    while policy.running or policy.waiting:
        _step(policy)
    assert [len(s.output) for s in seqs] == [16, 16]
    assert seqs[victim].preemptions == 1 and seqs[1 - victim].preemptions == 0
    _assert_clean(policy)


def test_decodes_go_first_and_prefills_chunk_within_the_token_budget() -> None:
    policy = _policy(max_num_batched_tokens=16)
    reqs = Requests(policy)
    first = reqs.add(40, 30)
    plan = _step(policy)
    assert [(c.start, c.end, c.samples) for c in plan.prefills] == [(0, 16, False)]
    _step(policy)
    plan = _step(policy)
    assert [(c.start, c.end, c.samples) for c in plan.prefills] == [(32, 40, True)]
    assert len(first.output) == 1
    second = reqs.add(30, 4)
    chunks = []
    while second.status is not SeqStatus.DECODING:
        plan = _step(policy)
        assert [c.seq for c in plan.decodes] == [first]  # one token, before any prefill
        chunks += [(c.start, c.end) for c in plan.prefills]
        assert sum(c.end - c.start for c in plan.prefills) + len(plan.decodes) <= 16
    assert chunks == [(0, 15), (15, 30)]
    decode = plan.decodes[0]
    assert decode.token == TOKEN
    assert decode.position == first.prompt_len + len(first.output) - 2  # fed, then sampled
    while policy.running:
        _step(policy)
    _assert_clean(policy)


def test_a_decode_only_plan_runs_as_many_steps_as_every_sequence_may_take() -> None:
    policy = _policy(decode_steps=4)
    reqs = Requests(policy)
    seq = reqs.add(8, 6)
    assert _step(policy).decode_steps == 1  # a prefill: one step
    plan = _step(policy)
    assert plan.decode_steps == 4
    assert len(seq.output) == 5
    assert seq.alloc is not None and len(seq.alloc.blocks) * B >= 8 + 5  # the run's slots
    assert _step(policy).decode_steps == 1  # only one token left
    assert seq.status is SeqStatus.FINISHED and len(seq.output) == 6
    _assert_clean(policy)


def test_a_run_is_one_step_while_anything_else_needs_the_loop() -> None:
    policy = _policy(decode_steps=8, max_num_seqs=1)
    reqs = Requests(policy)
    seq = reqs.add(8, 40)
    _step(policy)  # the prefill
    assert _step(policy).decode_steps == 8
    assert _step(policy, multi_step=False).decode_steps == 1  # the loop's fault hook
    seq.cancelled = True  # the loop ends it at the next step boundary
    assert _step(policy).decode_steps == 1
    seq.cancelled = False
    reqs.add(8, 2)  # waits: one sequence at a time
    assert _step(policy).decode_steps == 1


def test_a_sampling_failure_of_the_whole_step_reaches_every_sampled_row() -> None:
    policy = _policy()
    reqs = Requests(policy)
    a, b = reqs.add(8, 4), reqs.add(8, 4)
    plan = policy.schedule()
    boom = RuntimeError("sampling failed")
    update = policy.update(plan, boom)
    assert update.prefilled == [a, b]
    assert update.sampled == [(a, boom), (b, boom)]
    assert (a.num_computed, b.num_computed, a.max_batch) == (8, 8, 2)


def test_a_request_that_cannot_fit_an_empty_pool_ends_with_an_overload() -> None:
    policy = _policy(num_blocks=8)
    reqs = Requests(policy)
    big = reqs.add(40, 4)  # 10 blocks for its prompt alone
    plan = _step(policy)
    assert plan.empty
    (note,) = plan.notes
    assert isinstance(note, Ending) and note.seq is big
    assert "KV pool is full" in str(note.error)
    assert big.status is SeqStatus.FINISHED
    _assert_clean(policy)


def test_commit_reports_the_prefix_hit_and_finishing_returns_every_block() -> None:
    policy = _policy()
    reqs = Requests(policy)
    first = reqs.add(10, 2)
    while policy.running or policy.waiting:
        _step(policy)
    assert first.cache is not None and first.cache.engine_hit_tokens == 0
    again = reqs.add(10, 2)
    again.prompt = list(first.prompt)
    while policy.running or policy.waiting:
        _step(policy)
    assert again.cache is not None
    assert (again.cache.engine_hit_tokens, again.cache.computed_tokens) == (8, 2)
    _assert_clean(policy)


def test_the_policy_imports_neither_torch_nor_asyncio() -> None:
    code = textwrap.dedent(
        """
        import sys
        import cachepoint.replica.policy
        print(sorted(m for m in ("torch", "asyncio") if m in sys.modules))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


def _same_prompt(policy: SchedulerPolicy[RequestState], n: int, prompt_len: int):
    reqs = []
    for i in range(n):
        seq = RequestState(
            request_id=f"herd-{i}",
            prompt=[7 + (j % 50) for j in range(prompt_len)],
            key_spans=[],
            entry_spans=[],
            max_tokens=2,
            arrival=i,
        )
        policy.add(seq)
        reqs.append(seq)
    return reqs


@pytest.mark.parametrize("coalesce", [True, False])
def test_a_herd_with_one_prefix_computes_it_once(coalesce: bool) -> None:
    """Agents that start together send the same prefix: the first computes it, the rest
    wait for its commit and hit its blocks (the first-turn herd, issue 32)."""
    policy = _policy(max_num_batched_tokens=32, coalesce_prefills=coalesce)
    herd = _same_prompt(policy, 3, 40)  # 10 full blocks, chunked over 2 steps
    computed = 0
    while policy.waiting or policy.running:
        plan = _step(policy)
        computed += plan.computed_tokens
    if coalesce:
        # one computes 40; the others hit 36 (the last prompt token is always computed)
        assert computed == 40 + 4 + 4
        assert all(s.coalesced > 0 for s in herd[1:]) and herd[0].coalesced == 0
    else:
        assert computed == 3 * 40
    _assert_clean(policy)
