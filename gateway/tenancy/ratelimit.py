"""Rate limits per org and per API key: token buckets on requests and input tokens per
minute, in this gateway process.

Each limit is a bucket that holds up to its per-minute figure and refills continuously
(limit / 60 per second), as Anthropic's limits do. A request takes one request token
at admission from every bucket that applies. Input tokens are known only once the
prompt is billed, so they are taken then (``spend_input``) and may drive a bucket
below zero: the next request waits until it is positive again. NOTE: limits are per
gateway process; N gateway replicas admit up to N times the figure.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

_MAX_BUCKETS = 100_000  # beyond this, full (idle) buckets are forgotten


@dataclass(slots=True)
class TokenBucket:
    limit: int  # per minute; also the bucket's capacity
    level: float  # tokens available now (below 0 after a large input debit)
    stamp: float  # monotonic time at which ``level`` was last brought up to date

    @property
    def rate(self) -> float:
        return self.limit / 60.0

    def refill(self, now: float) -> None:
        self.level = min(float(self.limit), self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``level`` reaches ``amount`` (0 if it already has)."""
        return max(0.0, (amount - self.level) / self.rate)

    def full_in(self) -> float:
        return self.wait_for(float(self.limit))


@dataclass(frozen=True, slots=True)
class Window:
    """One limit as the response headers report it."""

    limit: int  # per minute
    remaining: int  # what is left now, never negative
    reset: datetime  # when the bucket is full again (UTC)


@dataclass(frozen=True, slots=True)
class Admission:
    """The outcome of one request's admission."""

    requests: Window | None  # the tightest request limit that applies; None = no limit
    input_tokens: Window | None  # the tightest input-token limit; None = no limit
    retry_after_s: float | None  # None = admitted; else how long until it would be
    reason: str = ""  # which limit refused it, for the error message

    @property
    def allowed(self) -> bool:
        return self.retry_after_s is None

    def headers(self) -> list[tuple[str, str]]:
        """Anthropic's ``anthropic-ratelimit-*`` headers (reset in RFC 3339), plus
        ``retry-after`` in whole seconds when refused."""
        out: list[tuple[str, str]] = []
        for name, w in (("requests", self.requests), ("input-tokens", self.input_tokens)):
            if w is None:
                continue
            reset = w.reset.isoformat(timespec="seconds").replace("+00:00", "Z")
            out += [
                (f"anthropic-ratelimit-{name}-limit", str(w.limit)),
                (f"anthropic-ratelimit-{name}-remaining", str(w.remaining)),
                (f"anthropic-ratelimit-{name}-reset", reset),
            ]
        if self.retry_after_s is not None:
            out.append(("retry-after", str(max(1, math.ceil(self.retry_after_s)))))
        return out

    def openai_headers(self, now: datetime | None = None) -> list[tuple[str, str]]:
        """OpenAI's ``x-ratelimit-*`` headers (reset as a duration, "1s", "6m0s"), plus
        ``retry-after`` when refused."""
        now = now or datetime.now(UTC)
        out: list[tuple[str, str]] = []
        for name, w in (("requests", self.requests), ("tokens", self.input_tokens)):
            if w is None:
                continue
            out += [
                (f"x-ratelimit-limit-{name}", str(w.limit)),
                (f"x-ratelimit-remaining-{name}", str(w.remaining)),
                (f"x-ratelimit-reset-{name}", _duration((w.reset - now).total_seconds())),
            ]
        if self.retry_after_s is not None:
            out.append(("retry-after", str(max(1, math.ceil(self.retry_after_s)))))
        return out


def _duration(seconds: float) -> str:
    """A duration as OpenAI writes it in its reset headers: "0s", "17ms", "6m0s"."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-minute figures; 0 = no limit."""

    org_requests: int  # requests per org
    org_input_tokens: int  # input and cache-write tokens per org
    key_requests: int  # requests per API key
    key_input_tokens: int  # input and cache-write tokens per API key
    org_count_tokens: int = 0  # count_tokens requests per org (a budget of its own)


@dataclass(slots=True)
class RateLimiter:
    limits: Limits
    clock: Callable[[], float] = field(default=time.monotonic)  # monotonic seconds
    # (kind, scope id) -> bucket, kind in req-org / tok-org / req-key / tok-key
    _buckets: dict[tuple[str, str], TokenBucket] = field(default_factory=dict)
    # admission runs on the event loop, input debits in billing's worker threads
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _now(self) -> float:
        return self.clock()

    def _scoped(self, kind: str, org_id: str, key_id: str) -> list[TokenBucket]:
        figures = {
            "req": (
                ("org", org_id, self.limits.org_requests),
                ("key", key_id, self.limits.key_requests),
            ),
            "tok": (
                ("org", org_id, self.limits.org_input_tokens),
                ("key", key_id, self.limits.key_input_tokens),
            ),
        }[kind]
        now = self._now()
        out = []
        for scope, ident, limit in figures:
            if limit <= 0:
                continue
            b = self._buckets.get((f"{kind}-{scope}", ident))
            if b is None:
                if len(self._buckets) >= _MAX_BUCKETS:
                    self._forget_full(now)
                b = self._buckets[(f"{kind}-{scope}", ident)] = TokenBucket(limit, limit, now)
            b.limit = limit
            b.refill(now)
            out.append(b)
        return out

    def _forget_full(self, now: float) -> None:
        for k, b in list(self._buckets.items()):
            b.refill(now)
            if b.level >= b.limit:
                del self._buckets[k]

    def admit(self, org_id: str, key_id: str) -> Admission:
        """Take one request from every request bucket that applies, if all have one and
        no input-token bucket is in debt; else take nothing and say how long to wait."""
        with self._lock:
            reqs = self._scoped("req", org_id, key_id)
            toks = self._scoped("tok", org_id, key_id)
            waits = [(b.wait_for(1.0), "requests per minute") for b in reqs if b.level < 1.0]
            waits += [(b.wait_for(1.0), "input tokens per minute") for b in toks if b.level < 1.0]
            if not waits:
                for b in reqs:
                    b.level -= 1.0
            wall = datetime.now(UTC)
            retry, reason = max(waits) if waits else (None, "")
            return Admission(_tightest(reqs, wall), _tightest(toks, wall), retry, reason)

    def admit_count(self, org_id: str) -> Admission:
        """count_tokens' own per-org request budget. NOTE: apart from messages' so that
        a client counting before each call does not halve its message rate, but a
        budget all the same: counting renders and tokenizes like a message does."""
        limit = self.limits.org_count_tokens
        if limit <= 0:
            return Admission(None, None, None)
        with self._lock:
            now = self._now()
            b = self._buckets.get(("cnt-org", org_id))
            if b is None:
                if len(self._buckets) >= _MAX_BUCKETS:
                    self._forget_full(now)
                b = self._buckets[("cnt-org", org_id)] = TokenBucket(limit, limit, now)
            b.limit = limit
            b.refill(now)
            wall = datetime.now(UTC)
            if b.level < 1.0:
                retry = b.wait_for(1.0)
                return Admission(
                    _tightest([b], wall), None, retry, "count_tokens requests per minute"
                )
            b.level -= 1.0
            return Admission(_tightest([b], wall), None, None)

    def spend_input(self, org_id: str, key_id: str, tokens: int) -> None:
        """Debit the input tokens a request was billed (input and cache writes)."""
        if tokens <= 0:
            return
        with self._lock:
            for b in self._scoped("tok", org_id, key_id):
                b.level -= tokens


def _tightest(buckets: list[TokenBucket], wall: datetime) -> Window | None:
    if not buckets:
        return None
    b = min(buckets, key=lambda x: (x.level, x.limit))
    reset = wall + timedelta(seconds=b.full_in())
    return Window(b.limit, max(0, math.floor(b.level)), reset)
