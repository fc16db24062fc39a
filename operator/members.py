"""What to do with a CacheReplica's member pods: a pure plan from observed pods.

Rolling rule (maxUnavailable = 1, like a Deployment): a member on an old template that
is not ready serves nothing, so it is replaced at once; a ready one is replaced only
while every other member is ready, one at a time. A replaced pod keeps its name, so
its successor is created only once the old pod is gone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .naming import ANNOTATION_TEMPLATE_HASH, LABEL_MEMBER


@dataclass(frozen=True)
class Member:
    index: int
    name: str
    template_hash: str | None
    ready: bool
    terminating: bool


@dataclass
class Plan:
    create: list[int] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    # Why the members are not yet where the spec wants them; empty means settled.
    waiting: list[str] = field(default_factory=list)

    @property
    def settled(self) -> bool:
        return not self.waiting


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


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
        members[index] = Member(
            index=index,
            name=meta["name"],
            template_hash=(meta.get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH),
            ready=pod_ready(pod),
            terminating=bool(meta.get("deletionTimestamp")),
        )
    return members


def plan(desired: int, template_hash: str, members: dict[int, Member], *, roll: bool) -> Plan:
    """Create missing members, delete excess ones and, when `roll`, replace outdated ones."""
    result = Plan()
    for index, member in sorted(members.items()):
        if index >= desired and not member.terminating:
            result.delete.append(member.name)
    for index in range(desired):
        member = members.get(index)
        if member is None:
            result.create.append(index)
        elif member.terminating:
            result.waiting.append(f"{member.name} is terminating")
    if not roll:
        return result

    outdated = [
        m
        for i, m in sorted(members.items())
        if i < desired and not m.terminating and m.template_hash != template_hash
    ]
    broken = [m for m in outdated if not m.ready]
    healthy = [m for m in outdated if m.ready]
    for member in broken:
        result.delete.append(member.name)
        result.waiting.append(f"replacing {member.name} (not ready, outdated)")
    if healthy:
        all_ready = not broken and all(
            i in members and members[i].ready and not members[i].terminating for i in range(desired)
        )
        if all_ready:
            result.delete.append(healthy[0].name)
            result.waiting.append(f"replacing {healthy[0].name}")
        else:
            result.waiting.append(f"{healthy[0].name} waits until every member is ready")
    return result
