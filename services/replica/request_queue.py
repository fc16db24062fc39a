"""The waiting queue: requests in the order admission takes them.

Like vLLM's priority request queue, but a sorted list rather than a heap: admission
walks it in order (passing over what does not fit), and a preempted request goes back
to its rank's place, ahead of everything that arrived after it at its priority.
"""

from __future__ import annotations

import bisect
from typing import TypeVar

from cachepoint.replica.request_state import RequestState

R = TypeVar("R", bound=RequestState)


class RequestQueue(list[R]):
    """Kept sorted by `RequestState.rank`: priority, then arrival.

    NOTE: a list, so that whoever reads the queue (stats, tests, readiness) sees a
    plain sequence; only `add` may put a request in, or the order breaks.
    """

    def add(self, seq: R) -> None:
        """Into the queue at its rank: by priority, FIFO within one."""
        bisect.insort(self, seq, key=lambda q: q.rank)
