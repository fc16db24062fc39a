"""What to do with a CacheReplica's member pods: a pure plan from observed pods.

A replaced pod keeps its name, so its successor is created only once the old pod is
gone. The rules, like a Deployment's with maxSurge 0 (`maxUnavailable` is
`spec.rollout.maxUnavailable`, `desired` is `spec.replicas`):

- Failed (or Succeeded) pods serve nothing and no kubelet restarts them (eviction, spot
  shutdown): they are deleted at once, whatever the budget, and replaced.
- serving = members that are ready, not terminating and not failed, at any index.
  floor = desired - maxUnavailable. A ready member is deleted only while serving stays
  at or above the floor after counting that deletion; below it, no ready member goes.
- Scale down: excess members (index >= desired) that are not ready go at once; ready
  ones go from the highest index while the floor holds (they serve until the wanted
  members are back).
- Roll: in flight = wanted members missing, terminating, failed, or up to date but not
  yet ready (the roll's own holes). budget = maxUnavailable - in flight. Outdated
  members go one budget unit each, the not-ready ones first (they serve nothing); a
  ready one also needs the floor. So a roll never has more than maxUnavailable members
  down that it took down, and never takes a ready member while maxUnavailable are
  already down for any reason (an outage under load, a bad image).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cachepoint.operator.naming import ANNOTATION_TEMPLATE_HASH, LABEL_MEMBER

# Pods in these phases never run again: the kubelet restarts containers, not pods.
FINISHED_PHASES = ("Failed", "Succeeded")


@dataclass(frozen=True)
class Member:
    index: int
    name: str
    template_hash: str | None
    ready: bool
    terminating: bool
    # Failed or Succeeded: a pod that will never serve again; `why` says what happened.
    failed: bool = False
    why: str = ""

    @property
    def serving(self) -> bool:
        return self.ready and not self.terminating and not self.failed


@dataclass
class Plan:
    create: list[int] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    # Why the members are not yet where the spec wants them; empty means settled.
    waiting: list[str] = field(default_factory=list)
    # The finished pods deleted in this step, with why they finished (for an Event).
    failed: list[str] = field(default_factory=list)

    @property
    def settled(self) -> bool:
        return not self.waiting


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_finished(pod: dict[str, Any]) -> bool:
    return pod.get("status", {}).get("phase") in FINISHED_PHASES


def finished_reason(pod: dict[str, Any]) -> str:
    """`<name> <phase>: <reason>: <message>`, as much of it as the kubelet gave."""
    status = pod.get("status", {})
    details = [s for s in (status.get("reason"), status.get("message")) if s]
    head = f"{pod.get('metadata', {}).get('name')} {status.get('phase')}"
    return ": ".join([head, *details])


def member_index(pod: dict[str, Any]) -> int | None:
    """The member index from the pod's label; None for a pod that is not a member."""
    label = (pod.get("metadata", {}).get("labels") or {}).get(LABEL_MEMBER, "")
    return int(label) if label.isdigit() else None


def observe(pods: Iterable[dict[str, Any]]) -> dict[int, Member]:
    """Member pods by index; pods without a valid member label are not ours to manage."""
    members: dict[int, Member] = {}
    for pod in pods:
        meta = pod.get("metadata", {})
        index = member_index(pod)
        if index is None:
            continue
        failed = pod_finished(pod)
        members[index] = Member(
            index=index,
            name=meta["name"],
            template_hash=(meta.get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH),
            ready=pod_ready(pod) and not failed,
            terminating=bool(meta.get("deletionTimestamp")),
            failed=failed,
            why=finished_reason(pod) if failed else "",
        )
    return members


def plan(
    desired: int,
    template_hash: str,
    members: dict[int, Member],
    *,
    roll: bool,
    max_unavailable: int = 1,
) -> Plan:
    """Create missing members, delete finished and excess ones and, when `roll`, replace
    outdated ones, never taking ready members below `desired - max_unavailable`."""
    result = Plan()
    ordered = sorted(members.items())
    for _, member in ordered:
        if member.failed and not member.terminating:
            result.delete.append(member.name)
            result.failed.append(member.why)
            result.waiting.append(f"replacing {member.why}")
    serving = sum(m.serving for m in members.values())
    floor = max(0, desired - max_unavailable)

    excess = [m for i, m in ordered if i >= desired and not m.terminating and not m.failed]
    for member in excess:
        if not member.ready:
            result.delete.append(member.name)
    for member in sorted((m for m in excess if m.ready), key=lambda m: -m.index):
        if serving - 1 >= floor:
            result.delete.append(member.name)
            serving -= 1
        else:
            result.waiting.append(f"{member.name} (excess) serves until members are ready")

    for index in range(desired):
        held = members.get(index)
        if held is None:
            result.create.append(index)
        elif held.terminating:
            result.waiting.append(f"{held.name} is terminating")
    if not roll:
        return result

    wanted = [members.get(i) for i in range(desired)]
    in_flight = sum(
        m is None or m.terminating or m.failed or (not m.ready and m.template_hash == template_hash)
        for m in wanted
    )
    budget = max_unavailable - in_flight
    outdated = [
        m
        for m in wanted
        if m is not None and not m.terminating and not m.failed and m.template_hash != template_hash
    ]
    # Not-ready ones first: replacing them costs no serving member.
    for member in sorted(outdated, key=lambda m: (m.ready, m.index)):
        if budget > 0 and (not member.ready or serving - 1 >= floor):
            result.delete.append(member.name)
            budget -= 1
            serving -= member.ready
            state = "outdated" if member.ready else "not ready, outdated"
            result.waiting.append(f"replacing {member.name} ({state})")
        else:
            down = max(0, desired - serving)
            result.waiting.append(
                f"{member.name} waits: {down} of {desired} member(s) down, "
                f"maxUnavailable {max_unavailable}"
            )
    return result
