"""Deletion as the API server and the garbage collector do it, on plain object dicts.

DELETE on an object with finalizers, or on a pod with a grace period, only marks it
(`deletionTimestamp`, and `deletionGracePeriodSeconds` for pods); it goes once the
finalizers are gone and, for a pod, once the kubelet confirms with a zero grace. The
garbage collector then deletes (background propagation) every object whose owners are
all gone.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

DEFAULT_POD_GRACE = 30  # seconds; PodSpec.terminationGracePeriodSeconds' default


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def requested_grace(body: Any, params: Mapping[str, str]) -> int | None:
    """gracePeriodSeconds from DeleteOptions (the body) or the query; None when unset."""
    value = body.get("gracePeriodSeconds") if isinstance(body, dict) else None
    if value is None and "gracePeriodSeconds" in params:
        value = params["gracePeriodSeconds"]
    return None if value is None else int(value)


def pod_grace(pod: dict[str, Any], requested: int | None) -> int:
    """The grace a pod gets: none where it never ran or has finished (as the pod strategy)."""
    scheduled = bool(pod.get("spec", {}).get("nodeName"))
    phase = pod.get("status", {}).get("phase")
    if not scheduled or phase in ("Failed", "Succeeded"):
        return 0
    if requested is not None:
        return max(requested, 0)
    spec_grace = pod.get("spec", {}).get("terminationGracePeriodSeconds")
    return DEFAULT_POD_GRACE if spec_grace is None else int(spec_grace)


def mark_deleted(obj: dict[str, Any], grace: int | None) -> dict[str, Any] | None:
    """The object marked for deletion, or None when it goes at once.

    `grace` is None for objects that are not pods. A pod already terminating keeps its
    mark unless the new grace is shorter (as `kubectl delete --grace-period=0 --force`).
    """
    meta = obj.get("metadata", {})
    finalizers = meta.get("finalizers") or []
    if not finalizers and not grace:
        return None
    current = meta.get("deletionGracePeriodSeconds")
    if meta.get("deletionTimestamp") and (grace is None or current is None or grace >= current):
        return obj  # already marked; nothing changes
    marked = {**obj, "metadata": {**meta, "deletionTimestamp": meta.get("deletionTimestamp")}}
    marked["metadata"]["deletionTimestamp"] = marked["metadata"]["deletionTimestamp"] or now()
    if grace is not None:
        marked["metadata"]["deletionGracePeriodSeconds"] = grace
    if meta.get("generation"):
        marked["metadata"]["generation"] = meta["generation"] + (not meta.get("deletionTimestamp"))
    return marked


def releasable(obj: dict[str, Any]) -> bool:
    """Whether a marked object goes now: no finalizers left and, for a pod, no grace left."""
    meta = obj.get("metadata", {})
    return (
        bool(meta.get("deletionTimestamp"))
        and not meta.get("finalizers")
        and not meta.get("deletionGracePeriodSeconds")
    )


def orphans(objects: Iterable[tuple[Any, dict[str, Any]]]) -> list[Any]:
    """Keys of live objects whose owner references all point at objects that are gone."""
    objects = list(objects)
    uids = {obj.get("metadata", {}).get("uid") for _key, obj in objects}
    out = []
    for key, obj in objects:
        meta = obj.get("metadata", {})
        refs = meta.get("ownerReferences") or []
        if (
            refs
            and not meta.get("deletionTimestamp")
            and not any(r.get("uid") in uids for r in refs)
        ):
            out.append(key)
    return out
