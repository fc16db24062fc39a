"""One request's life inside the replica: its scheduling state plus what delivers it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch
from opentelemetry.context import Context
from opentelemetry.trace import Span

from cachepoint.engine import SamplingParams, StopChecker
from cachepoint.protocol import CacheReport
from cachepoint.replica.request_state import RequestState


@dataclass(slots=True, frozen=True)
class TokenEvent:
    """A streamed piece of output."""

    token_id: int  # the sampled token
    text: str  # text that became safe to stream with it (may be empty)


@dataclass(slots=True, frozen=True)
class PrefillDone:
    """The prefill committed: the cache report is final from here on."""

    cache: CacheReport


@dataclass(slots=True, eq=False, kw_only=True)
class SequenceState(RequestState):
    """A request as both engines' cores hold it: the policy's `RequestState`, and its
    output's way out. Touched only on the event-loop thread."""

    params: SamplingParams  # sampling and stop rules
    stream: asyncio.Queue[TokenEvent | PrefillDone | None]  # None closes the stream
    done: asyncio.Future[None]  # resolved (or failed) when finished
    stopper: StopChecker  # stop strings and streamable text
    generator: torch.Generator | None = None  # per-sequence sampling RNG
    otel_ctx: Context | None = None  # the request's trace context (its server span)
    prefill_span: Span | None = None  # open from admission to commit (or abort)
    promote_span: Span | None = None  # open from admission until its tier copies ran
    decode_span: Span | None = None  # open from the first token to the end
    t_submit_ns: int = field(default_factory=time.time_ns)  # wall clock, for span starts
