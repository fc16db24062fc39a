"""kmock's KubernetesEmulator, made to behave like a real API server where the operator cares.

kmock 0.8 stores objects as sent and serves them back. On top of it, this server:
- sets metadata.uid, resourceVersion, creationTimestamp and generation on create, names
  objects that carry only generateName (kopf's events), and bumps resourceVersion on
  every write (generation on spec changes): kopf's JSON patches `test` resourceVersion,
  and owner references need the uid; a merge patch or PUT carrying a stale
  resourceVersion gets 409 Conflict;
- answers a failed JSON-patch `test` with 422, which kopf takes as "retry later";
- applies the status and scale subresources: a write to the main resource ignores
  `status`, a write to /status touches only `status`, /scale sets spec.replicas and
  answers with an autoscaling/v1 Scale;
- filters lists and watches by labelSelector;
- authorizes the operator's requests (those with its bearer token) by the chart's RBAC,
  with the OwnerReferencesPermissionEnforcement plugin; the tests' own requests carry no
  token and act as cluster-admin (apiserver/rbac.py);
- prunes, defaults and validates custom resources by their CRD's structural schema and
  CEL rules (apiserver/schema.py);
- deletes as the server and the garbage collector do: deletionTimestamp, pod grace
  periods, finalizers, owner-reference cascades (apiserver/lifecycle.py);
- answers the next N matching requests with an injected 409, 410 or 429
  (apiserver/faults.py).
Writes are serialised so that each patch applies to the state it was computed on.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock import ResourceInfo

from .apiserver import lifecycle, status
from .apiserver.faults import Faults
from .apiserver.rbac import Attributes, Authorizer, check_owner_references, verb_of
from .apiserver.schema import CustomResource

CREATE, UPDATE, DELETE = kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE
FETCH, LIST, WATCH = kmock.action.FETCH, kmock.action.LIST, kmock.action.WATCH
Key = tuple[Any, str | None, str]


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


def scale_of(obj: dict[str, Any]) -> dict[str, Any]:
    """The autoscaling/v1 Scale a /scale request answers with."""
    meta = obj.get("metadata", {})
    keep = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
    scale_status: dict[str, Any] = {"replicas": obj.get("status", {}).get("replicas", 0)}
    if obj.get("status", {}).get("selector"):
        scale_status["selector"] = obj["status"]["selector"]
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {k: meta[k] for k in keep if k in meta},
        "spec": {"replicas": obj.get("spec", {}).get("replicas", 0)},
        "status": scale_status,
    }


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    _versions: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    _writes: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    faults: Faults = attrs.field(factory=Faults, init=False)
    custom_resources: dict[tuple[str, str, str], CustomResource] = attrs.field(
        factory=dict, init=False
    )
    authorizer: Authorizer | None = attrs.field(default=None, init=False)
    operator_token: str | None = attrs.field(default=None, init=False)
    # OpenShift turns the OwnerReferencesPermissionEnforcement admission plugin on.
    owner_references_enforcement: bool = attrs.field(default=True, init=False)
    # False: a server that does not evaluate the CRD's CEL rules (before Kubernetes 1.25).
    cel_rules: bool = attrs.field(default=True, init=False)
    denied: list[status.ApiError] = attrs.field(factory=list, init=False)
    last_version: int = attrs.field(default=0, init=False)

    # ------------------------------------------------------------ configuration

    def install_crd(self, crd: dict[str, Any]) -> None:
        """Serve a CRD's resources, their writes checked by its schema (as `kubectl apply`)."""
        names = crd["spec"]["names"]
        for served in CustomResource.from_crd(crd):
            version = next(v for v in crd["spec"]["versions"] if v["name"] == served.version)
            self.resources[f"{served.group}/{served.version}/{served.plural}"] = ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular"),
                namespaced=crd["spec"].get("scope", "Namespaced") == "Namespaced",
                verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
                subresources=set((version.get("subresources") or {}).keys()),
            )
            self.custom_resources[served.group, served.version, served.plural] = served

    def enable_rbac(self, authorizer: Authorizer, token: str) -> None:
        """Requests bearing `token` are the authorizer's user's; others act as admin."""
        self.authorizer, self.operator_token = authorizer, token

    # ------------------------------------------------------------ request handling

    async def _handle(self, request: kmock.Request) -> Any:
        try:
            if request.resource is None or request.resource.plural is None:
                return await super()._handle(request)  # discovery: every user may read it
            user = self._authenticate(request)
            fault_response = await self._inject_fault(request, user)
            if fault_response is not None:
                return fault_response
            if user is not None:
                self._authorize(request, user)
            if request.action in (CREATE, UPDATE, DELETE):
                async with self._writes:
                    return await self._write(request, user)
            if request.action == FETCH and request.subresource == "scale":
                current = self._require(request)
                return aiohttp.web.json_response(scale_of(current))
            return await super()._handle(request)
        except status.ApiError as e:
            if e.code == 403:
                self.denied.append(e)
            return e.response()

    def from_operator(self, request: kmock.Request) -> bool:
        """Whether a recorded request bore the operator's token (for tests' assertions)."""
        header = request.headers.get("Authorization") or request.headers.get("authorization")
        return bool(header) and header.partition(" ")[2] == self.operator_token

    def _authenticate(self, request: kmock.Request) -> str | None:
        """The user a request acts as; None for the tests' own (admin) requests."""
        header = request.headers.get("Authorization") or request.headers.get("authorization")
        if self.authorizer is None or not header:
            return None
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or token != self.operator_token:
            raise status.unauthorized()
        return self.authorizer.user

    def _attributes(self, request: kmock.Request, user: str) -> Attributes:
        res = request.resource
        return Attributes(
            user=user,
            verb=verb_of(
                str(request.method.value), request.name is not None, request.action == WATCH
            ),
            group=res.group or "",
            resource=res.plural,
            subresource=request.subresource,
            namespace=request.namespace,
            name=request.name,
        )

    def _authorize(self, request: kmock.Request, user: str) -> None:
        assert self.authorizer is not None
        self.authorizer.check(self._attributes(request, user))

    async def _inject_fault(self, request: kmock.Request, user: str | None) -> Any:
        action = str(request.action.value).lower() if request.action else ""
        fault = self.faults.take(
            action, request.resource.plural, request.namespace, request.name, user is not None
        )
        if fault is None:
            return None
        if fault.code == 409 and request.action == UPDATE:
            # NOTE: a conflict is another writer getting there first. So it is one: the
            # object is written meanwhile, and the request then meets what a real server
            # gives it: 409 for a PUT or merge patch carrying the old resourceVersion, 422
            # for a JSON patch whose resourceVersion test fails, and success for a patch
            # without a precondition (the server re-applies those to the newest object).
            await self._write_meanwhile(request)
            return None
        error = fault.error(request.resource.group or "", request.name, "1")
        if request.action != WATCH:
            return error.response()
        # NOTE: a real server starts the watch (200) and sends the expiry as an ERROR event.
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        event = {"type": "ERROR", "object": error.body()}
        await response.write(json.dumps(event).encode() + b"\n")
        await response.write_eof()
        return response

    async def _write_meanwhile(self, request: kmock.Request) -> None:
        """Another client's write to the request's object: a new resourceVersion, an event."""
        async with self._writes:
            stored = self._stored(request.resource, request.namespace, request.name)
            if stored is None:
                return
            new = copy.deepcopy(stored.raw)
            new["metadata"]["resourceVersion"] = self._next_version()
            await self._store((request.resource, request.namespace, request.name), new, "MODIFIED")

    # ------------------------------------------------------------ reads

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            result["items"] = [i for i in result["items"] if matches_selector(i, selector)]
        result["metadata"]["resourceVersion"] = str(self.last_version)
        return result

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        selector = request.params.get("labelSelector")
        async for event in super()._serve_watch(request):
            if (
                selector
                and isinstance(event, dict)
                and not matches_selector(event.get("object") or {}, selector)
            ):
                continue
            yield event

    def current(self, resource: Any, namespace: str | None, name: str) -> dict[str, Any] | None:
        obj = self._stored(resource, namespace, name)
        return None if obj is None else copy.deepcopy(obj.raw)

    def _stored(self, resource: Any, namespace: str | None, name: str) -> Any:
        key = (resource, namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key]
        return None

    def _require(self, request: kmock.Request) -> dict[str, Any]:
        found = self.current(request.resource, request.namespace, request.name)
        if found is None:
            raise status.not_found(
                request.resource.plural, request.resource.group or "", request.name or ""
            )
        return found

    # ------------------------------------------------------------ writes

    def _next_version(self) -> str:
        self.last_version = next(self._versions)
        return str(self.last_version)

    async def _write(self, request: kmock.Request, user: str | None) -> Any:
        if request.action == CREATE:
            obj, code = await self._create(request, user), 201
        elif request.action == UPDATE and request.name is not None:
            obj, code = await self._update(request, user), 200
        elif request.action == DELETE and request.name is not None:
            obj, code = await self._delete(request), 200
        else:
            return await super()._handle(request)
        await self._collect_garbage()
        body = scale_of(obj) if request.subresource == "scale" else obj
        return aiohttp.web.json_response(body, status=code)

    def _custom(self, resource: Any) -> CustomResource | None:
        return self.custom_resources.get((resource.group, resource.version, resource.plural))

    def _admit(
        self,
        request: kmock.Request,
        user: str | None,
        new: dict[str, Any],
        old: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Schema (custom resources) and admission plugins, on the object about to be stored."""
        custom = self._custom(request.resource)
        if custom is not None:
            new = custom.admit(new, old, self.cel_rules)
        if user is not None and self.authorizer is not None and self.owner_references_enforcement:
            a = attrs.evolve(
                self._attributes(request, user), name=new.get("metadata", {}).get("name")
            )
            check_owner_references(self.authorizer, a, new, old, self._plural_of)
        return new

    def _plural_of(self, api_version: str, kind: str) -> str | None:
        group, _, version = api_version.rpartition("/")
        for resource in self.resources:
            if (resource.group, resource.version) == (group, version) and (
                self.resources[resource].kind == kind
            ):
                return resource.plural
        return None

    async def _create(self, request: kmock.Request, user: str | None) -> dict[str, Any]:
        obj = copy.deepcopy(request.data) if isinstance(request.data, dict) else {}
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta.setdefault("namespace", request.namespace)
        key = (request.resource, request.namespace or meta.get("namespace"), meta.get("name"))
        if self._stored(*key) is not None:
            raise status.already_exists(
                request.resource.plural, request.resource.group or "", meta["name"]
            )
        for server_owned in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(server_owned, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=lifecycle.now(), generation=1)
        obj = self._admit(request, user, obj, None)
        obj["metadata"]["resourceVersion"] = self._next_version()
        await self._store(key, obj, "ADDED")
        return obj

    async def _update(self, request: kmock.Request, user: str | None) -> dict[str, Any]:
        current = self._require(request)
        new = self._updated(request, current)
        new = self._admit(request, user, new, current)
        new["metadata"]["resourceVersion"] = self._next_version()
        key = (request.resource, request.namespace, request.name)
        await self._store(key, new, "MODIFIED")
        if lifecycle.releasable(new):
            await self._remove(key)
        return new

    async def _delete(self, request: kmock.Request) -> dict[str, Any]:
        current = self._require(request)
        key = (request.resource, request.namespace, request.name)
        requested = lifecycle.requested_grace(request.data, request.params)
        return await self._delete_object(key, current, requested)

    async def confirm_termination(self, resource: Any, namespace: str | None, name: str) -> None:
        """The kubelet's zero-grace DELETE once a pod's containers stopped, without a request.

        NOTE: in-process so that tests which assert on the operator's requests see none of it.
        """
        async with self._writes:
            current = self.current(resource, namespace, name)
            if current is not None:
                await self._delete_object((resource, namespace, name), current, 0)
                await self._collect_garbage()

    async def _delete_object(
        self, key: Key, current: dict[str, Any], requested: int | None
    ) -> dict[str, Any]:
        is_pod = key[0].group == "" and key[0].plural == "pods"
        grace = lifecycle.pod_grace(current, requested) if is_pod else None
        marked = lifecycle.mark_deleted(current, grace)
        if marked is None:
            await self._remove(key)
            return current
        if marked is current:
            return current
        marked["metadata"]["resourceVersion"] = self._next_version()
        await self._store(key, marked, "MODIFIED")
        if lifecycle.releasable(marked):
            await self._remove(key)
        return marked

    async def _store(self, key: Key, obj: dict[str, Any], event: str) -> None:
        async with self._lock:
            if key in self.objects:
                self.objects[key].create(copy.deepcopy(obj))  # a new version in its history
            else:
                self.objects[key] = copy.deepcopy(obj)
            await self._buses[key[0]].put({"type": event, "object": copy.deepcopy(obj)})

    async def _remove(self, key: Key) -> None:
        async with self._lock:
            raw = copy.deepcopy(self.objects[key].raw)
            self.objects[key].delete()
            await self._buses[key[0]].put({"type": "DELETED", "object": raw})

    async def _collect_garbage(self) -> None:
        """Background propagation: delete what has lost all its owners, until nothing has."""
        while True:
            live = [(k, o.raw) for k, o in self.objects.items() if not o.deleted]
            gone = lifecycle.orphans(live)
            if not gone:
                return
            for key in gone:
                current = self.current(*key)
                if current is not None:
                    await self._delete_object(key, current, None)

    def _updated(self, request: kmock.Request, current: dict[str, Any]) -> dict[str, Any]:
        data = request.data
        plural, group = request.resource.plural, request.resource.group or ""
        if isinstance(data, list):
            try:
                patched = jsonpatch.apply_patch(current, data, in_place=False)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise status.ApiError(422, "Invalid", str(e)) from e
        else:
            sent = (data or {}).get("metadata", {}).get("resourceVersion")
            if sent and sent != current["metadata"].get("resourceVersion"):
                raise status.conflict(plural, group, request.name)
            if request.method == kmock.method.PUT:
                patched = copy.deepcopy(data)
            else:
                patched = merge_patch(current, data)

        new = copy.deepcopy(current)
        if request.subresource == "status":
            new["status"] = patched.get("status")
        elif request.subresource == "scale":
            new.setdefault("spec", {})["replicas"] = (patched.get("spec") or {}).get("replicas")
        else:
            new = copy.deepcopy(patched)  # a merge patch shares untouched dicts with `current`
            if "status" in self.resources[request.resource].subresources:
                new["status"] = current.get("status")
        if new.get("status") is None:
            new.pop("status", None)
        # Identity and deletion are the server's, whatever the patch said.
        meta, old_meta = new.setdefault("metadata", {}), current.get("metadata", {})
        for key in (
            "uid",
            "creationTimestamp",
            "namespace",
            "name",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ):
            meta.pop(key, None)
            if key in old_meta:
                meta[key] = old_meta[key]
        if old_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or ()) - set(old_meta.get("finalizers") or ())
            if added:
                raise status.ApiError(
                    422,
                    "Invalid",
                    f'{status.qualified(plural, group)} "{request.name}" is invalid:'
                    " metadata.finalizers: Forbidden: no new finalizers can be added if the"
                    f" object is being deleted, found new finalizers {sorted(added)}",
                )
        generation = old_meta.get("generation", 1)
        meta["generation"] = generation + (new.get("spec") != current.get("spec"))
        return new
