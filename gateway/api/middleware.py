"""The gateway's outer ASGI layer: a request id on every response, the body guard
(size, read time, media type and encoding), extra response headers that dependencies
ask for, and the request log line. Plain ASGI, no buffering."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachepoint.gateway.errors import error_body
from cachepoint.gateway.observability import requestlog

# scope["state"] key under which dependencies queue (name, value) response headers
EXTRA_HEADERS = "cp_headers"
_SNIFF_LIMIT = 65_536  # bytes of an error body kept to read its error type
# Methods whose body the gateway reads: every such endpoint takes JSON.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex[:24]}"


class BodyRejectedError(Exception):
    """Raised from ``receive`` when the body is too large or too slow; the middleware
    answers in place of whatever the app makes of it."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


class BodyGuard:
    """Wraps ``receive``: counts the body's bytes against ``limit`` and its read time
    against ``timeout_s`` (from the request's arrival to its last chunk), whether or
    not a content-length was sent. Past either, it raises instead of reading on."""

    def __init__(self, receive: Receive, limit: int, timeout_s: float) -> None:
        self._receive = receive
        self.limit = limit  # bytes
        self.timeout_s = timeout_s  # for the whole body, not per chunk
        self.deadline = time.monotonic() + timeout_s  # when the body must be in
        self.seen = 0  # body bytes received so far
        self.done = False  # the last chunk has arrived (or the client left)
        self.failure: BodyRejectedError | None = None  # set once the body is refused

    async def receive(self) -> Message:
        if self.failure is not None:
            raise self.failure
        if self.done:
            return await self._receive()
        try:
            # NOTE: asyncio.timeout, not wait_for: no task per chunk on the hot path.
            async with asyncio.timeout(max(0.0, self.deadline - time.monotonic())):
                message = await self._receive()
        except TimeoutError:
            self.failure = BodyRejectedError(
                408,
                "invalid_request_error",
                f"request body not received within {self.timeout_s:g} s",
            )
            raise self.failure from None
        if message["type"] != "http.request":
            self.done = True
            return message
        self.seen += len(message.get("body", b""))
        if self.seen > self.limit:
            # NOTE: refused as soon as the limit is crossed: the rest of a chunked body
            # is never read, so its size cannot cost memory.
            self.failure = BodyRejectedError(
                413, "request_too_large", f"request body exceeds {self.limit} bytes"
            )
            raise self.failure
        if not message.get("more_body", False):
            self.done = True
        return message


class _Response:
    """What the middleware saw of the app's response."""

    def __init__(self) -> None:
        self.started = False  # http.response.start was sent
        self.dropped = False  # the app's response is being discarded (body refused)
        self.status: int | None = None
        self.sse = False  # a text/event-stream response
        self.error_body = b""  # the start of a JSON error body
        self.error_type: str | None = None

    def sniff(self, chunk: bytes) -> None:
        if self.sse:
            # NOTE: Anthropic's stream names the event; OpenAI's sends a bare error object.
            if self.error_type is None and (
                chunk.startswith(b"event: error\n") or chunk.startswith(b'data: {"error"')
            ):
                data = chunk.partition(b"data: ")[2].strip()
                self.error_type = _error_type(data)
        elif (self.status or 0) >= 400 and len(self.error_body) < _SNIFF_LIMIT:
            self.error_body += chunk[: _SNIFF_LIMIT - len(self.error_body)]


def unsupported_body(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a request body's headers are refused with 415, or None to read it.

    The content-type must be ``application/json`` or ``application/*+json``, with any
    parameters (``; charset=utf-8``): what FastAPI parses as JSON. NOTE: a missing one
    is refused too: FastAPI (strict_content_type) would not parse the body and the
    client got a 400 about a "dictionary". A compressed body is refused, not decoded:
    nothing is ever inflated, so a gzip bomb cannot cost memory; no SDK compresses."""
    typed = False
    for name, raw in headers:
        if name == b"content-type":
            typed = True
            value = raw.decode("latin-1").strip()[:100]
            media = value.partition(";")[0].strip().lower()
            kind, _, subtype = media.partition("/")
            if kind != "application" or not (subtype == "json" or subtype.endswith("+json")):
                return f"content-type {value!r} is not supported; send application/json"
        elif name == b"content-encoding":
            value = raw.decode("latin-1").strip()[:100]
            codings = [c.strip().lower() for c in value.split(",") if c.strip()]
            if any(c != "identity" for c in codings):
                return f"content-encoding {value!r} is not supported; send the body uncompressed"
    return None if typed else "content-type is missing; send application/json"


def _error_type(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
        return str(body["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return None


class RequestIdMiddleware:
    def __init__(
        self, app: ASGIApp, max_body_bytes: int, body_read_timeout_s: float = 30.0
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = new_request_id()
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        extra: list[tuple[str, str]] = state.setdefault(EXTRA_HEADERS, [])
        seen = _Response()
        guard = BodyGuard(receive, self.max_body_bytes, self.body_read_timeout_s)

        def headers_of(message: Message) -> list[tuple[bytes, bytes]]:
            added = [(k.encode(), v.encode()) for k, v in extra]
            return [*message.get("headers", []), (b"request-id", rid.encode()), *added]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                if guard.failure is not None:
                    seen.dropped = True
                    return
                seen.started = True
                seen.status = int(message["status"])
                message["headers"] = headers_of(message)
                ctype = dict(message["headers"]).get(b"content-type", b"")
                seen.sse = ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                if seen.dropped:
                    return
                seen.sniff(message.get("body", b""))
            await send(message)

        async def reply(status: int, kind: str, message: str) -> None:
            seen.status, seen.error_type = status, kind
            status, body = error_body(scope.get("path", ""), status, kind, message, rid, None)
            raw = json.dumps(body).encode()
            start: Message = {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(raw)).encode()),
                    # NOTE: the unread rest of the body makes the connection unusable;
                    # closing it also stops the server reading that rest.
                    (b"connection", b"close"),
                ],
            }
            start["headers"] = headers_of(start)
            await send(start)
            await send({"type": "http.response.body", "body": raw})

        path = scope.get("path", "")
        logged = requestlog.begin(rid, path) if path in requestlog.LOGGED_PATHS else None
        try:
            length = dict(scope.get("headers", [])).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                msg = f"request body of {int(length)} bytes exceeds {self.max_body_bytes}"
                await reply(413, "request_too_large", msg)
                return
            if scope.get("method") in _BODY_METHODS:
                refused = unsupported_body(scope.get("headers", []))
                if refused is not None:
                    await reply(415, "invalid_request_error", refused)
                    return
            try:
                await self.app(scope, guard.receive, send_with_id)
            except BodyRejectedError:
                pass  # answered below
            except BaseException:
                seen.status, seen.error_type = seen.status or 500, seen.error_type or "api_error"
                raise
            failure = guard.failure
            if failure is not None and not seen.started:
                await reply(failure.status, failure.kind, failure.message)
        finally:
            if logged is not None:
                record, token = logged
                record.status = seen.status
                record.error_type = seen.error_type or (
                    _error_type(seen.error_body) if seen.error_body else None
                )
                requestlog.finish(record, token)


def extra_headers(scope: Scope) -> list[tuple[str, str]]:
    """The list a dependency appends (name, value) response headers to."""
    state: dict[str, Any] = scope.setdefault("state", {})
    headers: list[tuple[str, str]] = state.setdefault(EXTRA_HEADERS, [])
    return headers
