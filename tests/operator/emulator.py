"""kmock's KubernetesEmulator, plus the API-server behaviour kopf and the operator rely on.

kmock 0.8 stores objects as sent. A real API server also:
- sets metadata.uid, resourceVersion, creationTimestamp and generation on create, names
  objects that carry only generateName (kopf's events), and bumps resourceVersion on
  every write (generation on spec changes): kopf's JSON patches `test` resourceVersion,
  and owner references need the uid;
- answers a failed JSON-patch `test` with 422, which kopf takes as "retry later";
- applies the status and scale subresources: a write to the main resource ignores
  `status`, a write to /status touches only `status`, /scale sets spec.replicas;
- filters lists by labelSelector.
Writes are serialised so that each patch applies to the state it was computed on.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import uuid
from typing import Any

import attrs
import jsonpatch
import kmock

CREATE, UPDATE, DELETE = kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def matches_selector(obj: dict[str, Any], selector: str) -> bool:
    """Equality-based label selectors: `k=v`, `k==v`, `k!=v`, `k`, `!k`, comma-joined."""
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            ok = labels.get(key.strip()) != value.strip()
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            ok = labels.get(key.strip()) == value.strip()
        elif term.startswith("!"):
            ok = term[1:] not in labels
        else:
            ok = term in labels
        if not ok:
            return False
    return True


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    _versions: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    _writes: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is None or request.action not in (CREATE, UPDATE, DELETE):
            return await super()._handle(request)
        async with self._writes:
            try:
                self._emulate(request)
            except kmock.KubernetesError as e:
                return await self._render_error(e)
            return await super()._handle(request)

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            result["items"] = [i for i in result["items"] if matches_selector(i, selector)]
        return result

    def current(self, resource: Any, namespace: str | None, name: str) -> dict[str, Any] | None:
        for (res, ns, nm), obj in self.objects.items():
            if res == resource and ns == namespace and nm == name and not obj.deleted:
                return copy.deepcopy(obj.raw)
        return None

    def _has_status(self, resource: Any) -> bool:
        return "status" in self.resources[resource].subresources

    def _emulate(self, request: kmock.Request) -> None:
        """Rewrite the request's payload into what the server would store.

        In place: kmock routes by the identity of the request it recorded, so a copy
        (attrs.evolve) would match no reaction. kmock then stores the payload: the
        whole object on create, a root-replacing JSON patch on update.
        """
        data = None
        if request.action == CREATE:
            data = self._created(request)
        elif request.action == UPDATE and request.name is not None:
            current = self.current(request.resource, request.namespace, request.name)
            if current is not None:
                new = self._updated(request, current)
                data = [{"op": "replace", "path": "", "value": new}]
        if data is not None:
            object.__setattr__(request, "data", data)  # kmock's Request is a frozen attrs class

    def _created(self, request: kmock.Request) -> dict[str, Any]:
        obj = copy.deepcopy(request.data)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta.setdefault("namespace", request.namespace)
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=str(next(self._versions)),
            creationTimestamp=_now(),
            generation=1,
        )
        return obj

    def _updated(self, request: kmock.Request, current: dict[str, Any]) -> dict[str, Any]:
        data = request.data
        if isinstance(data, list):
            try:
                patched = jsonpatch.apply_patch(current, data, in_place=False)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from e
        elif request.method == kmock.method.PUT:
            patched = copy.deepcopy(data)
        else:
            patched = merge_patch(current, data)

        new = copy.deepcopy(current)
        if request.subresource == "status":
            new["status"] = patched.get("status")
        elif request.subresource == "scale":
            new.setdefault("spec", {})["replicas"] = (patched.get("spec") or {}).get("replicas")
        else:
            new = patched
            if self._has_status(request.resource):
                new["status"] = current.get("status")
            if new.get("status") is None:
                new.pop("status", None)
        # Identity is the server's, whatever the patch said.
        meta = new.setdefault("metadata", {})
        for key in ("uid", "creationTimestamp", "namespace", "name"):
            if key in current.get("metadata", {}):
                meta[key] = current["metadata"][key]
        meta["resourceVersion"] = str(next(self._versions))
        generation = current.get("metadata", {}).get("generation", 1)
        meta["generation"] = generation + (new.get("spec") != current.get("spec"))
        return new
