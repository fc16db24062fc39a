"""Status from observed pods and polled stats: aggregates, phases, conditions, restarts."""

from __future__ import annotations

from typing import Any

from cachepoint.operator.stats import BlockStats, ReplicaStats
from cachepoint.operator.status import build_invalid_status, build_status, set_condition

HASH = "h1"


def pod(index: int, *, ready: bool = True, hash_: str = HASH, waiting: str = "") -> dict[str, Any]:
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {}}
    return {
        "metadata": {
            "name": f"r-{index}",
            "labels": {"cachepoint.dev/member": str(index)},
            "annotations": {"cachepoint.dev/template-hash": hash_},
        },
        "status": {
            "phase": "Running",
            "podIP": f"10.0.0.{index}",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "replica", "restartCount": 2, "state": state}],
        },
    }


def stats(epoch: int, query: int, hit: int) -> ReplicaStats:
    blocks = BlockStats(total=100, active=10, cached_free=30, empty=60, retained=5)
    return ReplicaStats(
        epoch=epoch, blocks=blocks, query_tokens=query, hit_tokens=hit, hit_rate=hit / query
    )


def build(
    pods: list[dict[str, Any]],
    polled: dict[str, Any],
    previous: dict[str, Any] | None = None,
    desired: int = 2,
    now: str = "T1",
    create_failures: list[str] | None = None,
) -> tuple[dict[str, Any], list[Any]]:
    return build_status(
        replica="r",
        desired=desired,
        template_hash=HASH,
        pods=pods,
        stats=polled,
        previous=previous or {},
        now=now,
        create_failures=create_failures,
    )


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_blocks_add_up_and_hit_rate_is_token_weighted() -> None:
    status, restarts = build(
        [pod(0), pod(1)], {"r-0": stats(1, 1000, 900), "r-1": stats(1, 3000, 300)}
    )
    assert status["blocks"] == {"total": 200, "active": 20, "cached": 60, "retained": 10}
    assert status["tokens"] == {"query": 4000, "hit": 1200}
    assert status["hitRate"] == 0.3  # not the mean of 0.9 and 0.1
    assert (status["phase"], status["ready"], status["readyReplicas"], status["replicas"]) == (
        "Running",
        "2/2",
        2,
        2,
    )
    assert status["selector"] == "cachepoint.dev/replica=r"
    assert condition(status, "Ready")["status"] == "True"
    assert condition(status, "Progressing")["status"] == "False"
    assert restarts == []
    assert [m["epoch"] for m in status["members"]] == [1, 1]
    assert status["members"][0]["podRestarts"] == 2


def test_a_new_epoch_is_a_restart_and_counted_once() -> None:
    first, _ = build([pod(0)], {"r-0": stats(7, 10, 5)}, desired=1)
    second, restarts = build(
        [pod(0)], {"r-0": stats(8, 10, 5)}, previous=first, desired=1, now="T2"
    )
    assert [(r.member, r.old_epoch, r.new_epoch) for r in restarts] == [("r-0", 7, 8)]
    assert second["members"][0]["restarts"] == 1
    assert second["members"][0]["lastRestartTime"] == "T2"
    third, restarts = build(
        [pod(0)], {"r-0": stats(8, 10, 5)}, previous=second, desired=1, now="T3"
    )
    assert restarts == []
    assert third["members"][0]["restarts"] == 1
    assert third["members"][0]["lastRestartTime"] == "T2"


def test_unreachable_stats_keep_the_last_epoch_and_flag_the_member() -> None:
    first, _ = build([pod(0)], {"r-0": stats(7, 10, 5)}, desired=1)
    second, restarts = build([pod(0)], {"r-0": "ConnectError: refused"}, previous=first, desired=1)
    assert restarts == []
    assert second["members"][0]["epoch"] == 7
    assert second["members"][0]["statsError"] == "ConnectError: refused"
    assert condition(second, "Degraded")["reason"] == "StatsUnavailable"
    # Back with a new epoch: the restart in between is still seen.
    _, restarts = build([pod(0)], {"r-0": stats(9, 10, 5)}, previous=second, desired=1)
    assert [r.new_epoch for r in restarts] == [9]


def test_rolling_scaling_and_crash_looping_phases() -> None:
    rolling, _ = build([pod(0, hash_="old"), pod(1)], {})
    assert (rolling["phase"], condition(rolling, "Progressing")["reason"]) == (
        "Progressing",
        "Rolling",
    )
    scaling, _ = build([pod(0)], {}, desired=3)
    assert condition(scaling, "Progressing")["reason"] == "Scaling"
    pending, _ = build([pod(0, ready=False), pod(1, ready=False)], {})
    assert (pending["phase"], condition(pending, "Ready")["status"]) == ("Pending", "False")
    crashing, _ = build([pod(0, ready=False, waiting="CrashLoopBackOff"), pod(1)], {})
    assert crashing["phase"] == "Degraded"
    assert condition(crashing, "Degraded")["message"] == "failing: r-0"
    stopped, _ = build([], {}, desired=0)
    assert (stopped["phase"], condition(stopped, "Ready")["reason"]) == ("Stopped", "ScaledToZero")


def test_transition_time_moves_only_when_a_condition_flips() -> None:
    first, _ = build([pod(0), pod(1)], {}, now="T1")
    same, _ = build([pod(0), pod(1)], {}, previous=first, now="T2")
    assert condition(same, "Ready")["lastTransitionTime"] == "T1"
    flipped, _ = build([pod(0), pod(1, ready=False)], {}, previous=same, now="T3")
    assert condition(flipped, "Ready")["lastTransitionTime"] == "T3"
    assert condition(flipped, "Degraded")["lastTransitionTime"] == "T1"


def test_an_invalid_spec_is_degraded_and_not_ready() -> None:
    status = build_invalid_status(["tensorParallelSize 4 needs 4 GPUs"], {}, "T1")
    assert status["phase"] == "Degraded"
    assert condition(status, "Degraded") == {
        "type": "Degraded",
        "status": "True",
        "reason": "InvalidSpec",
        "message": "tensorParallelSize 4 needs 4 GPUs",
        "lastTransitionTime": "T1",
    }
    assert condition(status, "Ready")["status"] == "False"


def evicted(index: int) -> dict[str, Any]:
    failed = pod(index, ready=False)
    failed["status"].update(
        phase="Failed", reason="Evicted", message="The node was low on resource: memory."
    )
    return failed


def test_a_failed_member_makes_the_replica_degraded_with_the_kubelets_reason() -> None:
    status, _ = build([pod(0), evicted(1)], {}, previous=build([pod(0), pod(1)], {})[0])
    assert status["phase"] == "Degraded"
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "MemberFailed")
    assert degraded["message"] == "r-1 Failed: Evicted: The node was low on resource: memory."
    assert status["members"][1]["phase"] == "Failed"
    assert (status["readyReplicas"], condition(status, "Ready")["status"]) == (1, "False")


def test_a_refused_child_create_is_degraded_with_the_apis_message() -> None:
    message = 'create Pod r-1: 403 pods "r-1" is forbidden: exceeded quota: gpu'
    status, _ = build([pod(0)], {}, create_failures=[message])
    assert status["phase"] == "Degraded"
    assert condition(status, "Degraded") | {"lastTransitionTime": "-"} == {
        "type": "Degraded",
        "status": "True",
        "reason": "CreateFailed",
        "message": message,
        "lastTransitionTime": "-",
    }


def test_set_condition_replaces_one_and_keeps_the_others() -> None:
    status, _ = build([pod(0), pod(1)], {}, now="T1")
    conditions = set_condition(status["conditions"], "Degraded", True, "CreateFailed", "m", "T2")
    assert {c["type"]: c["status"] for c in conditions} == {
        "Ready": "True",
        "Progressing": "False",
        "Degraded": "True",
    }
    assert condition({"conditions": conditions}, "Degraded")["lastTransitionTime"] == "T2"
    assert condition({"conditions": conditions}, "Ready") == condition(status, "Ready")
