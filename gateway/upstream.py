"""Calls to replicas, and the router seam that cache-aware routing plugs into."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import msgspec

from cachepoint.routing import RouteDecision

from .errors import ApiError, internal, invalid, rate_limited

# NOTE: msgspec encodes the token list several times faster than json; on a long
# prompt that is most of the gateway's own CPU time per request.
_encode = msgspec.json.encode
_decode = msgspec.json.decode
_JSON = {"content-type": "application/json"}

_STATUS = {
    400: lambda m: invalid(m),
    429: lambda m: rate_limited(m),
}


class ReplicaRefusedError(ApiError):
    """The replica answered 503 before taking the request: it is draining or shutting
    down, or its pool cannot fit the request now. Nothing ran there, so the request is
    routed again, elsewhere; the client sees 529 if nowhere else takes it."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(529, "overloaded_error", message)
        self.replica = name


def _error_from(name: str, resp_status: int, body: bytes) -> ApiError:
    try:
        message = str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:500] or f"replica answered {resp_status}"
    if resp_status == 503:
        return ReplicaRefusedError(name, message)
    make = _STATUS.get(resp_status)
    if make is not None:
        return make(message)
    return internal(f"replica failed: {message}")


class ReplicaUnreachableError(ApiError):
    """The replica did not answer at the transport level (down, restarting)."""

    def __init__(self, name: str, exc: Exception) -> None:
        super().__init__(529, "overloaded_error", f"replica {name} unreachable: {exc}")
        self.replica = name


class ReplicaStreamError(ApiError):
    """The replica's event stream broke after it began (it died, or sent garbage)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(500, "api_error", f"replica {name} stream failed: {reason}")
        self.replica = name


class ReplicaClient:
    """One replica's internal API (POST /v1/generate, GET /v1/stats)."""

    def __init__(self, name: str, url: str, http: httpx.AsyncClient) -> None:
        self.name = name  # replica name (its URL until it reports one)
        self.url = url.rstrip("/")
        self.http = http

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = await self.http.post(
                f"{self.url}/v1/generate", content=_encode(payload), headers=_JSON
            )
        except httpx.TransportError as exc:
            raise ReplicaUnreachableError(self.name, exc) from exc
        if resp.status_code != 200:
            raise _error_from(self.name, resp.status_code, resp.content)
        data: dict[str, Any] = _decode(resp.content)
        return data

    @asynccontextmanager
    async def stream(self, payload: dict[str, Any]) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """NDJSON events from the replica. Closing the context closes the connection,
        which makes the replica abort the request."""
        try:
            async with self.http.stream(
                "POST",
                f"{self.url}/v1/generate",
                content=_encode({**payload, "stream": True}),
                headers=_JSON,
            ) as resp:
                if resp.status_code != 200:
                    raise _error_from(self.name, resp.status_code, await resp.aread())

                async def events() -> AsyncIterator[dict[str, Any]]:
                    # NOTE: a replica that dies mid-stream surfaces here, after the
                    # response began; it becomes one typed error for the relay to
                    # report, not an httpx exception escaping into the ASGI server.
                    try:
                        lines = resp.aiter_lines()
                        async for line in lines:
                            if line:
                                event = json.loads(line)
                                if not isinstance(event, dict):
                                    raise ValueError(f"not an object: {line[:80]!r}")
                                if event.get("type") == "done":
                                    # NOTE: the last line: read the body to its end
                                    # first. httpx pools a connection only after its
                                    # response was read in full; otherwise every
                                    # request paid a new connection (bench/RESULTS.md).
                                    async for _ in lines:
                                        pass
                                yield event
                    except httpx.TransportError as exc:
                        raise ReplicaStreamError(self.name, f"connection lost: {exc!r}") from exc
                    except ValueError as exc:
                        raise ReplicaStreamError(self.name, f"unreadable event: {exc}") from exc

                yield events()
        except httpx.TransportError as exc:
            raise ReplicaUnreachableError(self.name, exc) from exc


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a router may look at to choose a replica."""

    tokens: Sequence[int]  # the rendered prompt
    key_spans: Sequence[tuple[int, Sequence[str]]]  # (start_block, extra keys)
    model: str  # the served model id (aliases resolved): only its replicas may be chosen
    avoid: frozenset[str] = frozenset()  # replicas already tried for this request


@dataclass(frozen=True, slots=True)
class Routed:
    replica: ReplicaClient  # where to send the request
    decision: RouteDecision | None  # why (None for the static fallback)


class Router(Protocol):
    def pick(self, req: RouteRequest) -> Routed: ...

    def report_failure(self, name: str) -> None:
        """A call to ``name`` failed at the transport; route elsewhere meanwhile."""

    def freshness_s(self, name: str) -> float | None:
        """Seconds since ``name``'s prefix index last changed (None if unknown)."""
