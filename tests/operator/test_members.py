"""The member plan: scale, roll one at a time, never two pods under one name."""

from __future__ import annotations

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
    assert (step.create, step.delete, step.settled) == ([], ["r-1", "r-2"], True)


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


def test_outdated_members_that_are_not_ready_go_at_once() -> None:
    # A bad image leaves members crash-looping; the fix must not wait for them.
    step = plan(3, NEW, members((OLD, False), (OLD, False), (OLD, True)), roll=True)
    assert step.delete == ["r-0", "r-1"]
    assert not step.settled


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
