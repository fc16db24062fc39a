"""Failures a test asks the server to give: the next N matching requests get 409, 410 or 429.

A fault matches on the Kubernetes action (create, update, delete, list, watch, fetch),
the resource's plural, and optionally namespace and name. By default only requests of
the operator (authenticated ones) are hit, so the test's own kubectl-like calls and the
fake kubelet never take a fault meant for the operator.

A 409 on an update is a concurrent writer (emulator.py): the object is written first, and
the request then conflicts only as it would on a real server, where a patch without a
resourceVersion precondition never does.
"""

from __future__ import annotations

import attrs

from .status import ApiError, conflict, expired, too_many_requests

CODES = (409, 410, 429)


@attrs.define
class Fault:
    code: int
    action: str
    resource: str
    count: int = 1
    namespace: str | None = None
    name: str | None = None
    retry_after: int = 1
    operator_only: bool = True
    hits: int = 0

    def __attrs_post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"fault code must be one of {CODES}, not {self.code}")

    def matches(
        self,
        action: str,
        resource: str,
        namespace: str | None,
        name: str | None,
        from_operator: bool,
    ) -> bool:
        return (
            self.hits < self.count
            and self.action == action
            and self.resource == resource
            and (self.namespace is None or self.namespace == namespace)
            and (self.name is None or self.name == name)
            and (from_operator or not self.operator_only)
        )

    def error(self, group: str, name: str | None, resource_version: str) -> ApiError:
        if self.code == 409:
            return conflict(self.resource, group, name)
        if self.code == 410:
            return expired(resource_version)
        return too_many_requests(self.retry_after)


@attrs.define
class Faults:
    pending: list[Fault] = attrs.field(factory=list)

    def add(self, code: int, action: str, resource: str, **kwargs: object) -> Fault:
        """Make the next `count` requests that match answer `code`; returns it, to count hits."""
        fault = Fault(code, action.lower(), resource, **kwargs)  # type: ignore[arg-type]
        self.pending.append(fault)
        return fault

    def take(
        self,
        action: str,
        resource: str,
        namespace: str | None,
        name: str | None,
        from_operator: bool,
    ) -> Fault | None:
        for fault in self.pending:
            if fault.matches(action, resource, namespace, name, from_operator):
                fault.hits += 1
                return fault
        return None
