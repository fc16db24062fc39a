"""Request traces: Mooncake's public JSONL and Cachepoint's own, read and written.

Both formats are JSON Lines with one request per line. A request names its prompt
as ``hash_ids``: ids of consecutive ``block_tokens``-token blocks, where equal ids
at the same position mean an equal prefix (the last block may be partial). The
formats are documented in docs/sim.md.

- Mooncake (FAST'25): ``{"timestamp": ms, "input_length", "output_length",
  "hash_ids"}``; blocks of 512 tokens; no header.
- Cachepoint: a header line ``{"format": "cachepoint-trace", "version": 1,
  "block_tokens": B}`` then Mooncake-shaped lines that may add ``tenant`` and
  ``breakpoints`` (``[{"tokens": N, "ttl": "5m" | "1h"}]``, at most 4).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachepoint.kvcore import TTL_SECONDS, BlockHash
from cachepoint.kvcore.limits import MAX_BREAKPOINTS

TRACE_FORMAT = "cachepoint-trace"  # the header's "format" value
TRACE_VERSION = 1  # the header's "version" value this code reads and writes
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces


class TraceError(ValueError):
    """The trace file is missing or malformed; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceBreakpoint:
    """A trace request's `cache_control` marker: the prefix up to ``tokens`` is written
    with ``ttl``."""

    tokens: int  # prefix length it marks, 1..input_length
    ttl: str  # "5m" or "1h"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    arrival_s: float  # seconds from the trace's first request
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: tuple[int, ...]  # one id per block_tokens-token block; the last may be partial
    tenant: str | None = None  # org id; different tenants never share a block (None: one tenant)
    breakpoints: tuple[TraceBreakpoint, ...] = ()  # cache_control markers, in prompt order


@dataclass(frozen=True, slots=True)
class Trace:
    """A loaded trace, requests in arrival order."""

    requests: tuple[TraceRequest, ...]  # sorted by arrival (stable)
    block_tokens: int  # tokens per hash id
    source: str  # where it was read from, for reports
    format: str  # "mooncake" or "cachepoint"

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (for quick runs)."""
        return Trace(self.requests[:n], self.block_tokens, self.source, self.format)


# ---------------------------------------------------------------------- reading


def load_trace(path: str | Path) -> Trace:
    """Read either format (told apart by the header line). Raises `TraceError`."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"trace file not found: {p}")
    if not p.is_file():
        raise TraceError(f"trace path is not a file: {p}")
    try:
        with p.open("r", encoding="utf-8") as fh:
            return parse_trace(fh, source=str(p))
    except UnicodeDecodeError as exc:
        raise TraceError(f"{p}: not UTF-8 text ({exc.reason})") from None


def parse_trace(lines: Iterable[str], *, source: str = "<memory>") -> Trace:
    """Parse JSON Lines; blank lines are skipped. Raises `TraceError` naming the line."""
    block_tokens = MOONCAKE_BLOCK_TOKENS
    fmt = "mooncake"
    requests: list[TraceRequest] = []
    first = True
    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if first and "format" in obj:
            block_tokens = _parse_header(obj, where)
            fmt = "cachepoint"
            first = False
            continue
        first = False
        requests.append(_parse_request(obj, where, block_tokens, allow_extras=fmt == "cachepoint"))
    if not requests:
        raise TraceError(f"{source}: the trace holds no requests")
    # NOTE: arrival_s holds milliseconds until here; shifting before dividing keeps
    # integral timestamps exact, so writing and reading a trace round-trips.
    base = min(r.arrival_s for r in requests)
    ordered = sorted(requests, key=lambda r: r.arrival_s)  # stable: equal times keep file order
    return Trace(tuple(_shift(r, base, 1000.0) for r in ordered), block_tokens, source, fmt)


def _shift(req: TraceRequest, base: float, unit: float = 1.0) -> TraceRequest:
    return TraceRequest(
        max(req.arrival_s - base, 0.0) / unit,
        req.input_length,
        req.output_length,
        req.hash_ids,
        req.tenant,
        req.breakpoints,
    )


def _parse_header(obj: dict[str, Any], where: str) -> int:
    if obj.get("format") != TRACE_FORMAT:
        raise TraceError(f"{where}: unknown trace format {obj.get('format')!r}")
    if obj.get("version") != TRACE_VERSION:
        raise TraceError(
            f"{where}: trace version {obj.get('version')!r} is not supported "
            f"(this build reads version {TRACE_VERSION})"
        )
    bt = obj.get("block_tokens")
    if not isinstance(bt, int) or isinstance(bt, bool) or bt <= 0:
        raise TraceError(f"{where}: header needs a positive integer block_tokens")
    return bt


def _int_field(obj: dict[str, Any], key: str, where: str, minimum: int) -> int:
    if key not in obj:
        raise TraceError(f"{where}: missing field {key!r}")
    val = obj[key]
    if not isinstance(val, int) or isinstance(val, bool) or val < minimum:
        raise TraceError(f"{where}: {key!r} must be an integer >= {minimum}, got {val!r}")
    return val


def _parse_request(
    obj: dict[str, Any], where: str, block_tokens: int, *, allow_extras: bool
) -> TraceRequest:
    if "timestamp" not in obj:
        raise TraceError(f"{where}: missing field 'timestamp'")
    ts = obj["timestamp"]
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: 'timestamp' must be a non-negative number of ms, got {ts!r}")
    input_length = _int_field(obj, "input_length", where, 1)
    output_length = _int_field(obj, "output_length", where, 0)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of non-negative integers")
    need = -(-input_length // block_tokens)
    if len(ids) != need:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for {input_length} tokens; "
            f"{block_tokens}-token blocks need {need}"
        )
    tenant: str | None = None
    breakpoints: tuple[TraceBreakpoint, ...] = ()
    if allow_extras:
        raw_tenant = obj.get("tenant")
        if raw_tenant is not None and (not isinstance(raw_tenant, str) or not raw_tenant):
            raise TraceError(f"{where}: 'tenant' must be a non-empty string")
        tenant = raw_tenant
        breakpoints = _parse_breakpoints(obj.get("breakpoints", []), where, input_length)
    return TraceRequest(float(ts), input_length, output_length, tuple(ids), tenant, breakpoints)


def _parse_breakpoints(raw: Any, where: str, input_length: int) -> tuple[TraceBreakpoint, ...]:
    if not isinstance(raw, list):
        raise TraceError(f"{where}: 'breakpoints' must be a list")
    if len(raw) > MAX_BREAKPOINTS:
        raise TraceError(f"{where}: {len(raw)} breakpoints; at most {MAX_BREAKPOINTS} are allowed")
    out: list[TraceBreakpoint] = []
    for bp in raw:
        if not isinstance(bp, dict):
            raise TraceError(f"{where}: each breakpoint must be an object")
        tokens = _int_field(bp, "tokens", where, 1)
        if tokens > input_length:
            raise TraceError(f"{where}: breakpoint at {tokens} is past the prompt ({input_length})")
        ttl = bp.get("ttl", "5m")
        if ttl not in TTL_SECONDS:
            raise TraceError(f"{where}: breakpoint ttl must be one of {sorted(TTL_SECONDS)}")
        if out and tokens <= out[-1].tokens:
            raise TraceError(f"{where}: breakpoints must be in increasing token order")
        if out and ttl == "1h" and out[-1].ttl == "5m":
            raise TraceError(f"{where}: a 1h breakpoint may not come after a 5m one")
        out.append(TraceBreakpoint(tokens, ttl))
    return tuple(out)


# ---------------------------------------------------------------------- writing


def dump_trace(trace: Trace) -> Iterator[str]:
    """The trace as Cachepoint-format lines (header first), each ending in a newline."""
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "block_tokens": trace.block_tokens}
    yield json.dumps(header) + "\n"
    for req in trace.requests:
        obj: dict[str, Any] = {
            "timestamp": round(req.arrival_s * 1000.0, 3),
            "input_length": req.input_length,
            "output_length": req.output_length,
            "hash_ids": list(req.hash_ids),
        }
        if req.tenant is not None:
            obj["tenant"] = req.tenant
        if req.breakpoints:
            obj["breakpoints"] = [{"tokens": b.tokens, "ttl": b.ttl} for b in req.breakpoints]
        yield json.dumps(obj) + "\n"


def write_trace(path: str | Path, trace: Trace) -> None:
    with Path(path).open("w", encoding="utf-8") as fh:
        fh.writelines(dump_trace(trace))


class TraceRecorder:
    """Turns recorded traffic into a Cachepoint trace without keeping any content.

    The gateway already holds each prompt's chained block hashes (it routes on
    them). The recorder numbers every distinct hash in order of first sight, so
    the trace keeps exactly the traffic's sharing and nothing of its text.
    """

    __slots__ = ("_ids", "_requests", "block_tokens")

    def __init__(self, block_tokens: int) -> None:
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        self.block_tokens = block_tokens  # the block size the hashes were computed at
        self._ids: dict[bytes, int] = {}  # block hash (or tail key) -> trace id
        self._requests: list[TraceRequest] = []  # recorded so far, in call order

    def add(
        self,
        arrival_s: float,
        block_hashes: Sequence[BlockHash],
        input_length: int,
        output_length: int,
        *,
        tenant: str | None = None,
        breakpoints: Sequence[TraceBreakpoint] = (),
        tail_key: bytes | None = None,
    ) -> TraceRequest:
        """Record one request.

        ``block_hashes`` are the prompt's full blocks. A partial last block needs an
        id too: ``tail_key`` identifies it (e.g. the entry key of the whole prompt);
        without one it gets a fresh id that nothing else shares.
        """
        full = input_length // self.block_tokens
        if len(block_hashes) != full:
            raise ValueError(f"{len(block_hashes)} hashes for {full} full blocks")
        ids = [self._id(bytes(h)) for h in block_hashes]
        if input_length % self.block_tokens:
            key = tail_key if tail_key is not None else b"tail:%d" % len(self._ids)
            ids.append(self._id(b"tail|" + key))
        req = TraceRequest(
            arrival_s, input_length, output_length, tuple(ids), tenant, tuple(breakpoints)
        )
        self._requests.append(req)
        return req

    def _id(self, key: bytes) -> int:
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._ids)
        return found

    def trace(self, source: str = "recorded") -> Trace:
        base = min((r.arrival_s for r in self._requests), default=0.0)
        reqs = sorted((_shift(r, base) for r in self._requests), key=lambda r: r.arrival_s)
        return Trace(tuple(reqs), self.block_tokens, source, "cachepoint")
