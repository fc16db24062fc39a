"""The HTTP client to one replica: generate calls, their NDJSON events decoded into
cachepoint.protocol's types, and the errors a replica's answers become.

NOTE: aiohttp, not httpx, on this hop: every request takes it, and measured on the
echo replica httpx spent 1.0 ms of CPU a call against aiohttp's 0.3 ms, a quarter of
the gateway's whole overhead (bench/RESULTS.md, "The replica hop"). The control
plane's polls (stats, readiness) stay on the app's httpx client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import aiohttp
from opentelemetry.instrumentation.aiohttp_client import create_trace_config
from opentelemetry.trace import TracerProvider
from pydantic import ValidationError

from cachepoint.gateway.errors import ApiError, internal, invalid, rate_limited
from cachepoint.protocol import (
    PROTOCOL_VERSION,
    VERSION_HEADER,
    DoneEvent,
    ErrorEvent,
    Event,
    GenerateRequest,
    MalformedEvent,
    decode_event,
    encode_request,
)

# NOTE: the protocol version rides on every call, so a replica of another version
# refuses it before reading the body (cachepoint.protocol.version).
_HEADERS = {"content-type": "application/json", VERSION_HEADER: str(PROTOCOL_VERSION)}

_STATUS = {
    400: lambda m: invalid(m),
    429: lambda m: rate_limited(m),
}


CONNECT_TIMEOUT_S = 5.0  # a replica that does not accept in this long is unreachable
MAX_CONNECTIONS = 512  # to all replicas together
# NOTE: below the replica's keep-alive (uvicorn's 5 s), so the gateway drops an idle
# connection before the replica does: a POST sent on one the replica is closing fails
# (aiohttp retries only idempotent methods) and would count as the replica being down.
KEEPALIVE_S = 4.0


class ReplicaSession:
    """The aiohttp session of generate calls, opened on first use, on the loop that
    uses it (aiohttp binds a session to its loop; a router is often built before the
    app's loop runs).

    ``read_timeout_s`` bounds each wait for the replica's next bytes, never the whole
    generation (as httpx's read timeout did): a long answer streams for as long as its
    tokens keep coming. ``headers`` ride on every call (the internal token).
    ``tracer_provider``: a CLIENT span a call, its context sent in ``traceparent``, so
    the replica's spans join the request's trace."""

    def __init__(
        self,
        read_timeout_s: float = 600.0,
        headers: Mapping[str, str] | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self.read_timeout_s = read_timeout_s
        self.headers = dict(headers or {})
        self.tracer_provider = tracer_provider
        self._session: aiohttp.ClientSession | None = None

    def get(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(
                total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=self.read_timeout_s
            )
            provider = self.tracer_provider
            self._session = aiohttp.ClientSession(
                timeout=timeout,
                connector=aiohttp.TCPConnector(
                    limit=MAX_CONNECTIONS, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
                ),
                headers=self.headers,
                trace_configs=[create_trace_config(tracer_provider=provider)] if provider else None,
                auto_decompress=False,  # replicas never compress: nothing to sniff
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class ReplicaRefusedError(ApiError):
    """The replica answered 503 before taking the request: it is draining or shutting
    down, or its pool cannot fit the request now. Nothing ran there, so the request is
    routed again, elsewhere; the client sees 529 if nowhere else takes it."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(529, "overloaded_error", message)
        self.replica = name


def _error_from(name: str, resp_status: int, body: bytes) -> ApiError:
    try:
        message = ErrorEvent.model_validate_json(body).error.message
    except ValidationError:
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


class UsageReportError(ApiError):
    """A replica's usage report that cannot be true for the request it was sent (or
    cannot be read at all): the request fails with an api_error, nothing is billed from
    it, and the replica is reported."""

    def __init__(self, reason: str) -> None:
        super().__init__(500, "api_error", f"replica sent an unusable usage report: {reason}")
        self.reason = reason  # what did not add up, for the log line


class ReplicaClient:
    """One replica's internal API (POST /v1/generate). NOTE: the gateway reads every
    generation as the replica's event stream, even one the client wants whole, so that a
    hang-up can abort it (gateway/dispatch.py): there is no collected call."""

    def __init__(self, name: str, url: str, http: ReplicaSession) -> None:
        self.name = name  # replica name (its URL until it reports one)
        self.url = url.rstrip("/")
        self.http = http

    @asynccontextmanager
    async def stream(self, request: GenerateRequest) -> AsyncIterator[AsyncIterator[Event]]:
        """The replica's events (cachepoint.protocol). Closing the context closes the
        connection, which makes the replica abort the request."""
        if not request.stream:
            request = request.model_copy(update={"stream": True})
        body = encode_request(request)
        try:
            resp = await self.http.get().post(
                f"{self.url}/v1/generate", data=body, headers=_HEADERS
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ReplicaUnreachableError(self.name, exc) from exc
        try:
            if resp.status != 200:
                try:
                    answered = await resp.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise ReplicaUnreachableError(self.name, exc) from exc
                raise _error_from(self.name, resp.status, answered)
            yield self._events(resp)
        finally:
            # NOTE: a body not read to its end closes the connection (never pooled half
            # read), which is how the replica learns to abort the generation.
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()

    async def _events(self, resp: aiohttp.ClientResponse) -> AsyncIterator[Event]:
        # NOTE: a replica that dies mid-stream surfaces here, after the response began;
        # it becomes one typed error for the relay to report, not an aiohttp exception
        # escaping into the ASGI server.
        try:
            lines = _ndjson_lines(resp)
            async for line in lines:
                if not line:
                    continue
                event = decode_event(line)
                if event is None:
                    continue  # a newer replica's event type: nothing this gateway reads
                if isinstance(event, DoneEvent):
                    # NOTE: the last line: read the body to its end first. A connection
                    # is pooled only after its response was read in full; otherwise
                    # every request paid a new connection (bench/RESULTS.md).
                    async for _ in lines:
                        pass
                yield event
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ReplicaStreamError(self.name, f"connection lost: {exc!r}") from exc
        except MalformedEvent as exc:
            # NOTE: a prefill_done or done that does not read is a usage report that
            # cannot be billed from: refused unbilled, as one whose numbers do not add up.
            if exc.reports_usage:
                raise UsageReportError(f"unreadable event: {exc.detail}") from exc
            raise ReplicaStreamError(self.name, f"unreadable event: {exc.detail}") from exc


async def _ndjson_lines(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The body's lines, split on ``\\n`` alone.

    NOTE: split here on ``\\n``, never as ``str.splitlines`` does (httpx's
    ``aiter_lines`` did): a token whose text holds U+2028, U+2029 or U+0085 (JSON leaves
    them unescaped) cut its event in two and failed the whole generation as an
    unreadable event. Nor with aiohttp's ``readline``: it refuses a line over its
    buffer limit (64 KiB), and a done event carries the whole answer.
    """
    tail = b""
    async for chunk in resp.content.iter_any():
        *whole, tail = (tail + chunk).split(b"\n")
        for line in whole:
            yield line
    if tail:
        yield tail  # a last line without its newline: still decoded, and refused if cut
