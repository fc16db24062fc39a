"""Pure status builders: observed pods + polled stats + previous status -> new status.

Level-based: every field is recomputed from what is observed now, so a missed event or
an operator restart cannot leave status wrong. The only memory is each member's last
epoch (and restart count), carried in status itself, which is how a replica restart,
and so an emptied KV cache, is told apart from a quiet replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cachepoint.operator.members import finished_reason, member_index, pod_finished, pod_ready
from cachepoint.operator.naming import ANNOTATION_TEMPLATE_HASH, selector_string
from cachepoint.operator.stats import ReplicaStats


@dataclass(frozen=True)
class Restart:
    member: str
    old_epoch: int
    new_epoch: int


def build_condition(
    kind: str, ok: bool, reason: str, message: str, previous: list[dict[str, Any]], now: str
) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = next((c for c in previous if c.get("type") == kind), None)
    # lastTransitionTime moves only when the status flips, as Kubernetes conventions ask.
    since = before["lastTransitionTime"] if before and before.get("status") == status else now
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
    }


def build_invalid_status(problems: list[str], previous: dict[str, Any], now: str) -> dict[str, Any]:
    """Status for a spec that can never run: Degraded, not Ready, not Progressing."""
    message = "; ".join(problems)
    conditions = previous.get("conditions") or []
    return {
        "phase": "Degraded",
        "conditions": [
            build_condition("Ready", False, "InvalidSpec", message, conditions, now),
            build_condition("Progressing", False, "InvalidSpec", message, conditions, now),
            build_condition("Degraded", True, "InvalidSpec", message, conditions, now),
        ],
    }


def _container_restarts(pod: dict[str, Any]) -> int:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return sum(int(s.get("restartCount", 0)) for s in statuses)


def _crash_looping(pod: dict[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    bad = {"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError"}
    return any((s.get("state", {}).get("waiting") or {}).get("reason") in bad for s in statuses)


def build_member_status(
    pod: dict[str, Any],
    stats: ReplicaStats | str | None,
    template_hash: str,
    previous: dict[str, Any],
    now: str,
) -> tuple[dict[str, Any], Restart | None]:
    meta, pod_status = pod["metadata"], pod.get("status", {})
    index = member_index(pod)
    pod_hash = (meta.get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH)
    restarts = int(previous.get("restarts", 0))
    epoch = previous.get("epoch")
    restart = None
    entry: dict[str, Any] = {
        "name": meta["name"],
        "index": -1 if index is None else index,
        "phase": pod_status.get("phase", "Pending"),
        "ready": pod_ready(pod),
        "upToDate": pod_hash == template_hash,
        "podRestarts": _container_restarts(pod),
    }
    if pod_status.get("podIP"):
        entry["podIP"] = pod_status["podIP"]
    if isinstance(stats, ReplicaStats):
        if epoch is not None and stats.epoch != epoch:
            restart = Restart(meta["name"], int(epoch), stats.epoch)
            restarts += 1
            entry["lastRestartTime"] = now
        epoch = stats.epoch
        entry["blocks"] = {
            "total": stats.blocks.total,
            "active": stats.blocks.active,
            "cached": stats.blocks.cached_free,
            "retained": stats.blocks.retained,
        }
        entry["hitRate"] = round(stats.hit_rate, 4)
        entry["waiting"] = stats.waiting
        entry["running"] = stats.running
    elif isinstance(stats, str):
        entry["statsError"] = stats
    if restart is None and previous.get("lastRestartTime"):
        entry["lastRestartTime"] = previous["lastRestartTime"]
    if epoch is not None:
        entry["epoch"] = int(epoch)
    entry["restarts"] = restarts
    return entry, restart


def build_status(
    *,
    replica: str,
    desired: int,
    template_hash: str,
    pods: list[dict[str, Any]],
    stats: dict[str, ReplicaStats | str],
    previous: dict[str, Any],
    now: str,
    create_failures: list[str] | None = None,
) -> tuple[dict[str, Any], list[Restart]]:
    """The whole status of a valid CacheReplica, and the member restarts seen this time.

    `create_failures`: the API's answers to child creates it refused (403, 422, ...);
    they make the CacheReplica Degraded, since no retry fixes them.
    """
    before = {m.get("name"): m for m in previous.get("members") or []}
    live = [p for p in pods if member_index(p) is not None]
    live = [p for p in live if not p["metadata"].get("deletionTimestamp")]
    live.sort(key=lambda p: member_index(p) or 0)
    members, restarts = [], []
    for pod in live:
        name = pod["metadata"]["name"]
        entry, restart = build_member_status(
            pod, stats.get(name), template_hash, before.get(name, {}), now
        )
        members.append(entry)
        if restart is not None:
            restarts.append(restart)

    with_stats = [m for m in members if "blocks" in m]
    blocks = {
        key: sum(m["blocks"][key] for m in with_stats)
        for key in ("total", "active", "cached", "retained")
    }
    polled = [s for s in stats.values() if isinstance(s, ReplicaStats)]
    query = sum(s.query_tokens for s in polled)
    hit = sum(s.hit_tokens for s in polled)
    ready = sum(1 for m in members if m["ready"])
    wanted = [m for m in members if 0 <= m["index"] < desired]
    settled = (
        len(wanted) == desired
        and len(members) == desired
        and all(m["upToDate"] and m["ready"] for m in wanted)
    )
    failing = [m["name"] for m, pod in zip(members, live, strict=True) if _crash_looping(pod)]
    # NOTE: a Failed pod is deleted and replaced on the same pass that sees it, so this
    # condition lasts a tick or two; the operator's MemberFailed Event keeps the record.
    finished = [finished_reason(pod) for pod in live if pod_finished(pod)]
    # A ready member whose stats cannot be read still serves; flag it, but it is no crash.
    silent = [m["name"] for m in members if m["ready"] and "statsError" in m]

    previous_conditions = previous.get("conditions") or []
    if settled:
        progress = (False, "Settled", f"{desired} member(s) up to date and ready")
    elif any(not m["upToDate"] for m in wanted):
        progress = (
            True,
            "Rolling",
            "replacing members on an old template, within rollout.maxUnavailable",
        )
    elif len(members) != desired:
        progress = (True, "Scaling", f"{len(members)} member(s), {desired} wanted")
    else:
        progress = (True, "Starting", f"{ready}/{desired} member(s) ready")
    if create_failures:
        degraded = (True, "CreateFailed", "; ".join(create_failures))
    elif finished:
        degraded = (True, "MemberFailed", "; ".join(finished))
    elif failing:
        degraded = (True, "MemberFailing", "failing: " + ", ".join(failing))
    elif silent:
        degraded = (True, "StatsUnavailable", "no /v1/stats from: " + ", ".join(silent))
    else:
        degraded = (False, "AsExpected", "every member is healthy")
    is_ready = ready >= desired and settled
    ready_reason = "ScaledToZero" if desired == 0 else "AllMembersReady" if is_ready else "Waiting"
    conditions = [
        build_condition(
            "Ready", is_ready, ready_reason, f"{ready}/{desired} ready", previous_conditions, now
        ),
        build_condition("Progressing", *progress, previous_conditions, now),
        build_condition("Degraded", *degraded, previous_conditions, now),
    ]
    if failing or finished or create_failures:
        phase = "Degraded"
    elif desired == 0:
        phase = "Stopped"
    elif settled:
        phase = "Running"
    elif ready:
        phase = "Progressing"
    else:
        phase = "Pending"
    status = {
        "phase": phase,
        "replicas": len(members),
        "readyReplicas": ready,
        "ready": f"{ready}/{desired}",
        "selector": selector_string(replica),
        "members": members,
        "blocks": blocks,
        "tokens": {"query": query, "hit": hit},
        "hitRate": round(hit / query, 4) if query else 0.0,
        "conditions": conditions,
    }
    return status, restarts


def set_condition(
    previous: list[dict[str, Any]], kind: str, ok: bool, reason: str, message: str, now: str
) -> list[dict[str, Any]]:
    """`previous` with one condition replaced (or added), the others kept as they are.

    For a handler that learns one thing (a refused create) between two timer ticks: a
    merge patch replaces the whole list, so the others must be sent back unchanged.
    """
    new = build_condition(kind, ok, reason, message, previous, now)
    kept = [c for c in previous if c.get("type") != kind]
    return [*kept, new]
