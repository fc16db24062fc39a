"""RBAC as the API server's authorizer applies it, from Role/ClusterRole manifests.

A request becomes attributes (user, verb, API group, resource, subresource, namespace,
name); it is allowed when a rule of a role bound to the user matches them all. Roles
come through ClusterRoleBindings (every namespace) or RoleBindings (their namespace
only). Requests outside resources (/api, /apis, /version) are discovery, which every
authenticated user may GET (the system:discovery ClusterRole).

The OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift) is here
too: setting `blockOwnerDeletion: true` needs `update` on the owner's `finalizers`
subresource, and changing owner references on an existing object needs `delete` on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs

from .status import ApiError, details, qualified

# HTTP method -> verb for requests that name an object, and for those that do not.
_NAMED = {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete", "POST": "create"}
_COLLECTION = {"GET": "list", "POST": "create", "DELETE": "deletecollection"}


@attrs.frozen
class Attributes:
    user: str
    verb: str
    group: str
    resource: str
    subresource: str | None = None
    namespace: str | None = None
    name: str | None = None

    @property
    def resource_path(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def verb_of(method: str, named: bool, watch: bool) -> str:
    """The RBAC verb of an HTTP request: a GET is get, list or watch depending on the URL."""
    method = method.upper()
    if method == "GET" and watch:
        return "watch"
    return (_NAMED if named else _COLLECTION).get(method, method.lower())


@attrs.frozen
class Rule:
    api_groups: frozenset[str]
    resources: frozenset[str]
    verbs: frozenset[str]
    resource_names: frozenset[str]

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Rule:
        return cls(
            api_groups=frozenset(raw.get("apiGroups") or ()),
            resources=frozenset(raw.get("resources") or ()),
            verbs=frozenset(raw.get("verbs") or ()),
            resource_names=frozenset(raw.get("resourceNames") or ()),
        )

    def allows(self, a: Attributes) -> bool:
        if not ({"*", a.verb} & self.verbs) or not ({"*", a.group} & self.api_groups):
            return False
        wanted = {a.resource_path, "*"}
        if a.subresource:
            wanted.add(f"*/{a.subresource}")  # "*/scale" grants every resource's scale
        if not wanted & self.resources:
            return False
        # NOTE: resourceNames cannot restrict create, list or watch of a collection
        # (the name is not in the URL), so a named rule grants those only by name.
        return not self.resource_names or a.name in self.resource_names


@attrs.frozen
class Grant:
    namespace: str | None  # None: cluster-wide (ClusterRoleBinding)
    rules: tuple[Rule, ...]

    def allows(self, a: Attributes) -> bool:
        if self.namespace is not None and a.namespace != self.namespace:
            return False
        return any(rule.allows(a) for rule in self.rules)


@attrs.frozen
class Authorizer:
    user: str
    grants: tuple[Grant, ...]

    @classmethod
    def from_manifests(cls, docs: Iterable[dict[str, Any]], service_account: str) -> Authorizer:
        """The grants of `namespace/name` (a ServiceAccount) in a list of manifests."""
        docs = [d for d in docs if d]
        sa_ns, _, sa_name = service_account.partition("/")
        roles = {
            (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): tuple(
                Rule.parse(r) for r in d.get("rules") or ()
            )
            for d in docs
            if d.get("kind") in ("Role", "ClusterRole")
        }
        grants = []
        for d in docs:
            if d.get("kind") not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            subjects = d.get("subjects") or ()
            if not any(_is(s, sa_ns, sa_name, d["metadata"].get("namespace")) for s in subjects):
                continue
            ref = d["roleRef"]
            scope = d["metadata"].get("namespace") if d["kind"] == "RoleBinding" else None
            key = (ref["kind"], scope if ref["kind"] == "Role" else None, ref["name"])
            if key not in roles:
                raise ValueError(f"{d['kind']} {d['metadata']['name']} refers to missing {key}")
            grants.append(Grant(scope, roles[key]))
        return cls(f"system:serviceaccount:{sa_ns}:{sa_name}", tuple(grants))

    def allows(self, a: Attributes) -> bool:
        return any(grant.allows(a) for grant in self.grants)

    def check(self, a: Attributes) -> None:
        if not self.allows(a):
            raise forbidden(a)


def _is(subject: dict[str, Any], namespace: str, name: str, binding_ns: str | None) -> bool:
    return (
        subject.get("kind") == "ServiceAccount"
        and subject.get("name") == name
        and (subject.get("namespace") or binding_ns) == namespace
    )


def forbidden(a: Attributes) -> ApiError:
    """The message and details of a real authorizer's denial."""
    what = qualified(a.resource, a.group)
    subject = f'{what} "{a.name}"' if a.name else what
    where = f'in the namespace "{a.namespace}"' if a.namespace else "at the cluster scope"
    message = (
        f'{subject} is forbidden: User "{a.user}" cannot {a.verb} resource "{a.resource_path}"'
        f' in API group "{a.group}" {where}'
    )
    return ApiError(403, "Forbidden", message, details(a.resource, a.group, a.name))


def check_owner_references(
    authorizer: Authorizer,
    a: Attributes,
    new: dict[str, Any],
    old: dict[str, Any] | None,
    plural_of: Callable[[str, str], str | None],
) -> None:
    """OwnerReferencesPermissionEnforcement, for a create or an update `a` of `old` to `new`.

    `plural_of(apiVersion, kind)` maps an owner reference to its resource's plural.
    """
    new_refs = new.get("metadata", {}).get("ownerReferences") or []
    old_refs = (old or {}).get("metadata", {}).get("ownerReferences") or []
    if new_refs == old_refs:
        return
    what = qualified(a.resource, a.group)
    name = a.name or new.get("metadata", {}).get("name") or ""
    if old is not None and not authorizer.allows(attrs.evolve(a, verb="delete", subresource=None)):
        message = "cannot set an ownerRef on a resource you can't delete: , <nil>"
        raise ApiError(
            403,
            "Forbidden",
            f'{what} "{name}" is forbidden: {message}',
            details(a.resource, a.group, name),
        )
    blocking_before = {r.get("uid") for r in old_refs if r.get("blockOwnerDeletion")}
    for ref in new_refs:
        if not ref.get("blockOwnerDeletion") or ref.get("uid") in blocking_before:
            continue
        group = ref.get("apiVersion", "").rpartition("/")[0]
        plural = plural_of(ref.get("apiVersion", ""), ref.get("kind", ""))
        owner = Attributes(
            user=a.user,
            verb="update",
            group=group,
            resource=plural or ref.get("kind", "").lower(),
            subresource="finalizers",
            namespace=a.namespace,
            name=ref.get("name"),
        )
        if plural is None or not authorizer.allows(owner):
            message = (
                "cannot set blockOwnerDeletion if an ownerReference refers to a resource"
                " you can't set finalizers on: , <nil>"
            )
            raise ApiError(
                403,
                "Forbidden",
                f'{what} "{name}" is forbidden: {message}',
                details(a.resource, a.group, name),
            )
