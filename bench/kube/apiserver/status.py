"""Status bodies as the API server writes them (meta/v1 Status), and the error that carries one."""

from __future__ import annotations

import json
from typing import Any

import aiohttp.web


class ApiError(Exception):
    """A request the server answers with a Status body instead of an object."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details, self.headers = details or {}, headers or {}

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body

    def response(self) -> aiohttp.web.Response:
        return aiohttp.web.Response(
            status=self.code,
            text=json.dumps(self.body()),
            content_type="application/json",
            headers=self.headers,
        )


def qualified(plural: str, group: str) -> str:
    """`pods`, `cachereplicas.cachepoint.dev`: how messages name a resource."""
    return f"{plural}.{group}" if group else plural


def details(plural: str, group: str, name: str | None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": plural} if name is None else {"name": name, "kind": plural}
    if group:
        out["group"] = group
    return {**out, **extra}


def not_found(plural: str, group: str, name: str) -> ApiError:
    what = qualified(plural, group)
    return ApiError(404, "NotFound", f'{what} "{name}" not found', details(plural, group, name))


def already_exists(plural: str, group: str, name: str) -> ApiError:
    what = qualified(plural, group)
    return ApiError(
        409, "AlreadyExists", f'{what} "{name}" already exists', details(plural, group, name)
    )


def conflict(plural: str, group: str, name: str | None) -> ApiError:
    what = qualified(plural, group)
    message = (
        f'Operation cannot be fulfilled on {what} "{name or ""}": the object has been modified;'
        " please apply your changes to the latest version and try again"
    )
    return ApiError(409, "Conflict", message, details(plural, group, name))


def expired(resource_version: str) -> ApiError:
    return ApiError(410, "Expired", f"too old resource version: {resource_version}")


def too_many_requests(retry_after: int) -> ApiError:
    return ApiError(
        429,
        "TooManyRequests",
        "Too many requests, please try again later.",
        {"retryAfterSeconds": retry_after},
        {"Retry-After": str(retry_after)},
    )


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")
