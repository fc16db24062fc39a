"""Worker threads for a request's heavy work, shared fairly between orgs.

NOTE: threads, not processes, measured: the tokenizer's ``encode_batch`` releases the
GIL (``encode`` does not: one 1.3 MB encode stopped every other thread for 0.9 s),
Jinja and the checks are Python bytecode, which yields the GIL every 5 ms, and a
process would have to pickle the parsed request both ways. What still holds the GIL
is C parsing (``json.loads``: ~15 ms per MB of small objects, so under 0.5 s for the
largest body the cap lets in) and pydantic's validation of what the caps let through.

Small bodies stay on the loop: a job for a body of at most ``inline_bytes`` runs
there, at once. Its work holds the GIL in a thread too (parsing, validation, a
template, hashing), and for such a body it is shorter than the two thread switches
that moving it costs: 0.12 ms of work for a 2 kB body against 0.35 ms a round trip
through a worker, measured on a 2-core VM (bench/RESULTS.md, "The replica hop").

Fairness: an org runs at most ``org_share`` jobs at once; its other requests wait
for one of its slots, never for another org's. Their bodies are held in memory
meanwhile, so an org's requests in intake may declare at most ``org_bytes`` of body in
all (its first one is always let in); beyond that its next request is a 429 before
its body is read. A job whose client hung up still holds its org's slot until the
thread finishes it, so hanging up cannot buy more than the share.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

_T = TypeVar("_T")


class IntakeFull(Exception):
    """The org's requests in intake already declare ``org_bytes`` of body."""


@dataclass(slots=True)
class _Org:
    slots: asyncio.Semaphore  # at most org_share of its jobs run at once
    admitted: int = 0  # its requests between admission and the end of their intake
    nbytes: int = 0  # the body sizes those requests declared
    running: int = 0  # its jobs holding a slot (a hung-up request's too, until done)


@dataclass(slots=True)
class IntakePool:
    workers: int  # threads in all
    org_share: int  # jobs one org may run at once
    org_bytes: int  # body bytes one org's requests in intake may declare in all
    inline_bytes: int = 0  # a job for a body of at most this many bytes runs on the loop
    _executor: ThreadPoolExecutor | None = None
    _orgs: dict[str, _Org] = field(default_factory=dict)

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="intake")
        return self._executor

    def _org(self, org_id: str) -> _Org:
        org = self._orgs.get(org_id)
        if org is None:
            org = self._orgs[org_id] = _Org(asyncio.Semaphore(self.org_share))
        return org

    @asynccontextmanager
    async def admitted(self, org_id: str, nbytes: int) -> AsyncIterator[None]:
        """Let a request of ``nbytes`` (its declared body size) into the org's intake for
        the block, or ``IntakeFull``."""
        org = self._org(org_id)
        if org.admitted and org.nbytes + nbytes > self.org_bytes:
            raise IntakeFull(org_id)
        org.admitted += 1
        org.nbytes += nbytes
        try:
            yield
        finally:
            org.admitted -= 1
            org.nbytes -= nbytes
            self._forget_idle(org_id, org)

    def _forget_idle(self, org_id: str, org: _Org) -> None:
        if org.admitted == 0 and org.running == 0 and self._orgs.get(org_id) is org:
            del self._orgs[org_id]

    async def run(
        self, org_id: str, fn: Callable[..., _T], *args: Any, size: int | None = None
    ) -> _T:
        """``fn(*args)`` in a worker thread, in the caller's context (spans, request
        log), within the org's share. Its exceptions are raised here. ``size``: the
        body's bytes; at most ``inline_bytes``, ``fn`` runs here, on the loop."""
        if size is not None and size <= self.inline_bytes:
            return fn(*args)
        org = self._org(org_id)
        org.running += 1
        try:
            await org.slots.acquire()
        except BaseException:
            org.running -= 1
            self._forget_idle(org_id, org)
            raise
        loop = asyncio.get_running_loop()
        call = functools.partial(contextvars.copy_context().run, fn, *args)

        def release() -> None:
            org.running -= 1
            org.slots.release()
            self._forget_idle(org_id, org)

        try:
            job = self._pool().submit(call)
        except BaseException:
            release()
            raise
        result: asyncio.Future[_T] = loop.create_future()

        def settle() -> None:
            release()
            if result.done():  # the caller stopped waiting
                return
            if job.cancelled():
                result.cancel()
            elif (exc := job.exception()) is not None:
                result.set_exception(exc)
            else:
                result.set_result(job.result())

        def done(_: object) -> None:
            # NOTE: one wake-up of the loop settles the wait and frees the slot (wrap_future
            # would take a second). A closed loop means the app is gone, and its pool too.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle)

        job.add_done_callback(done)
        try:
            return await result
        except asyncio.CancelledError:
            # NOTE: a job not yet started never runs; a running one finishes and only
            # then gives the slot back (``settle``).
            job.cancel()
            raise

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
