"""The member plan: scale, roll within maxUnavailable, replace finished pods, never two
pods under one name."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cachepoint.operator.members import Member, observe, plan

NEW, OLD = "new-hash", "old-hash"


def members(*specs: tuple[str, bool] | tuple[str, bool, bool]) -> dict[int, Member]:
    """Member i from (template hash, ready[, terminating])."""
    result = {}
    for i, (template, ready, *rest) in enumerate(specs):
        result[i] = Member(i, f"r-{i}", template, ready, terminating=bool(rest and rest[0]))
    return result


def test_a_new_group_creates_every_member_and_is_settled() -> None:
    step = plan(3, NEW, {}, roll=True)
    assert (step.create, step.delete, step.settled) == ([0, 1, 2], [], True)


def test_running_it_again_changes_nothing() -> None:
    step = plan(2, NEW, members((NEW, True), (NEW, False)), roll=True)
    assert (step.create, step.delete, step.waiting) == ([], [], [])


def test_scale_down_removes_the_highest_members() -> None:
    step = plan(1, NEW, members((NEW, True), (NEW, True), (NEW, True)), roll=True)
    assert (step.create, step.delete, step.settled) == ([], ["r-2", "r-1"], True)


def test_roll_replaces_one_ready_member_at_a_time() -> None:
    step = plan(3, NEW, members((OLD, True), (OLD, True), (OLD, True)), roll=True)
    assert step.delete == ["r-0"]
    assert not step.settled
    # r-0 is gone: recreate it, but touch nothing else until it is ready.
    current = members((NEW, True), (OLD, True), (OLD, True))
    del current[0]
    step = plan(3, NEW, current, roll=True)
    assert (step.create, step.delete) == ([0], [])
    step = plan(3, NEW, members((NEW, False), (OLD, True), (OLD, True)), roll=True)
    assert (step.create, step.delete) == ([], [])
    step = plan(3, NEW, members((NEW, True), (OLD, True), (OLD, True)), roll=True)
    assert step.delete == ["r-1"]


def test_outdated_members_that_are_not_ready_go_first_within_the_budget() -> None:
    # A bad image leaves members crash-looping; the fix must not wait for them, but it
    # replaces them no faster than maxUnavailable allows.
    current = members((OLD, False), (OLD, False), (OLD, True))
    assert plan(3, NEW, current, roll=True).delete == ["r-0"]
    assert plan(3, NEW, current, roll=True, max_unavailable=2).delete == ["r-0", "r-1"]
    # maxUnavailable 2 keeps the one ready member (floor 3 - 2 = 1); 3 lets it go too.
    assert plan(3, NEW, current, roll=True, max_unavailable=3).delete == ["r-0", "r-1", "r-2"]
    step = plan(3, NEW, members((NEW, True), (NEW, True), (OLD, True)), roll=True)
    assert step.delete == ["r-2"]
    assert not step.settled


def test_every_member_not_ready_under_load_is_replaced_one_at_a_time() -> None:
    # A rolling update once deleted 4 outdated members all answering 503 under load at
    # once. With maxUnavailable 1, one goes; the next waits for its successor.
    step = plan(4, NEW, members(*[(OLD, False)] * 4), roll=True)
    assert step.delete == ["r-0"]
    current = members(*[(OLD, False)] * 4)
    del current[0]
    assert plan(4, NEW, current, roll=True).delete == []
    current = members((NEW, False), *[(OLD, False)] * 3)
    assert plan(4, NEW, current, roll=True).delete == []
    current = members((NEW, True), *[(OLD, False)] * 3)
    assert plan(4, NEW, current, roll=True).delete == ["r-1"]


def test_a_wider_budget_rolls_several_ready_members_at_once() -> None:
    step = plan(4, NEW, members(*[(OLD, True)] * 4), roll=True, max_unavailable=2)
    assert step.delete == ["r-0", "r-1"]
    # One member already down for another reason leaves room for one more.
    current = members((NEW, False), *[(OLD, True)] * 3)
    assert plan(4, NEW, current, roll=True, max_unavailable=2).delete == ["r-1"]


def failed(index: int, template: str = NEW, reason: str = "Evicted") -> Member:
    why = f"r-{index} Failed: {reason}: The node was low on resource: memory."
    return Member(index, f"r-{index}", template, False, False, failed=True, why=why)


def test_a_failed_member_is_deleted_then_replaced_even_without_roll() -> None:
    current = members((NEW, True), (NEW, True))
    current[1] = failed(1)
    step = plan(2, NEW, current, roll=False)
    assert (step.create, step.delete) == ([], ["r-1"])
    assert step.failed == ["r-1 Failed: Evicted: The node was low on resource: memory."]
    assert not step.settled
    del current[1]
    assert plan(2, NEW, current, roll=False).create == [1]


def test_failed_members_go_whatever_the_budget_and_block_the_roll() -> None:
    # Two evicted members (spot shutdown) and an outdated ready one: both failed pods
    # go at once (they serve nothing), the ready one waits for them to come back.
    current = members((OLD, True), (OLD, True), (OLD, True))
    current[1], current[2] = failed(1, OLD), failed(2, OLD, "Shutdown")
    step = plan(3, NEW, current, roll=True)
    assert step.delete == ["r-1", "r-2"]


def test_excess_ready_members_serve_until_the_wanted_ones_are_back() -> None:
    # Scale 4 -> 2 while members 0 and 1 are missing: deleting both excess members
    # would leave nothing serving; the floor (2 - 1) keeps one of them for now.
    current = members((NEW, True), (NEW, True), (NEW, True), (NEW, True))
    del current[0], current[1]
    step = plan(2, NEW, current, roll=False)
    assert (step.create, step.delete) == ([0, 1], ["r-3"])
    assert not step.settled
    # Excess members that are not ready serve nothing: they go at once.
    current = members((NEW, True), (NEW, True), (NEW, False), (NEW, False))
    assert plan(2, NEW, current, roll=False).delete == ["r-2", "r-3"]


def test_a_terminating_member_is_waited_for_not_recreated() -> None:
    step = plan(2, NEW, members((NEW, False, True), (NEW, True)), roll=True)
    assert (step.create, step.delete) == ([], [])
    assert step.waiting == ["r-0 is terminating"]


def test_without_roll_only_missing_and_excess_members_change() -> None:
    current = members((OLD, True), (OLD, True), (OLD, True))
    del current[0]
    step = plan(2, NEW, current, roll=False)
    assert (step.create, step.delete) == ([0], ["r-2"])


def test_observe_reads_index_hash_readiness_and_deletion() -> None:
    pods = [
        {
            "metadata": {
                "name": "r-1",
                "labels": {"cachepoint.dev/member": "1"},
                "annotations": {"cachepoint.dev/template-hash": NEW},
                "deletionTimestamp": "2026-01-01T00:00:00Z",
            },
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        },
        {"metadata": {"name": "stray", "labels": {"cachepoint.dev/member": "x"}}},
    ]
    assert observe(pods) == {1: Member(1, "r-1", NEW, True, True)}


def member_states() -> st.SearchStrategy[dict[int, Member]]:
    """Any mix of absent, ready, not ready, terminating, failed, old and new members."""
    state = st.one_of(
        st.none(),
        st.tuples(st.sampled_from([NEW, OLD]), st.booleans(), st.booleans(), st.booleans()),
    )

    def build(states: list[Any]) -> dict[int, Member]:
        result = {}
        for i, s in enumerate(states):
            if s is not None:
                template, ready, terminating, is_failed = s
                result[i] = Member(
                    i,
                    f"r-{i}",
                    template,
                    ready and not is_failed,
                    terminating,
                    failed=is_failed,
                    why=f"r-{i} Failed" if is_failed else "",
                )
        return result

    return st.lists(state, max_size=10).map(build)


@settings(max_examples=500, deadline=None)
@given(
    desired=st.integers(0, 8),
    max_unavailable=st.integers(1, 4),
    current=member_states(),
    roll=st.booleans(),
)
def test_the_plan_never_takes_more_ready_members_down_than_the_budget(
    desired: int, max_unavailable: int, current: dict[int, Member], roll: bool
) -> None:
    step = plan(desired, NEW, current, roll=roll, max_unavailable=max_unavailable)
    by_name = {m.name: m for m in current.values()}
    deleted = [by_name[name] for name in step.delete]
    serving = sum(m.serving for m in current.values())
    floor = max(0, desired - max_unavailable)
    taken = sum(m.serving for m in deleted)
    # Ready members go only down to the floor, and none while already below it.
    assert taken <= max(0, serving - floor)
    assert serving - taken >= min(serving, floor)
    # The roll's own holes (missing, terminating, failed, new but not ready, and the
    # outdated members it deletes now) never exceed maxUnavailable when it adds one.
    wanted = [current.get(i) for i in range(desired)]
    in_flight = sum(
        m is None or m.terminating or m.failed or (not m.ready and m.template_hash == NEW)
        for m in wanted
    )
    rolled = [m for m in deleted if m.index < desired and not m.failed]
    if rolled:
        assert roll
        assert in_flight + len(rolled) <= max_unavailable
    # Finished pods always go; terminating ones are waited for, never deleted twice.
    assert {m.name for m in current.values() if m.failed and not m.terminating} <= set(step.delete)
    assert not any(m.terminating for m in deleted)
    assert len(set(step.delete)) == len(step.delete)
    # A successor is created only where no pod holds the name.
    assert all(i not in current and i < desired for i in step.create)
