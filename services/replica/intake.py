"""What both engines check of a request before queueing it, and the sampling
parameters it runs with: the same refusals, in the same order, with the same words."""

from __future__ import annotations

import uuid
from collections.abc import Container
from dataclasses import dataclass

from cachepoint.engine import SamplingParams
from cachepoint.kvcore import RetentionOwner
from cachepoint.protocol import GenerateRequest
from cachepoint.replica import admission
from cachepoint.replica.errors import (
    DrainingError,
    InvalidRequestError,
    OverloadedError,
    QueueFullError,
)


@dataclass(frozen=True, slots=True)
class Intake:
    """A request that passed every check, and what both engines derive from it alike."""

    request_id: str  # the caller's, or a fresh one
    params: SamplingParams  # max_tokens clipped to the room max_model_len leaves
    key_spans: list[tuple[int, list[str]]]  # (start_block, extra keys) from the gateway
    owner: RetentionOwner  # the tenant its entries' retention is charged to


def refuse_if_closed(
    name: str, *, stopping: bool, draining: bool, failure: BaseException | None
) -> None:
    """Refuse every request on a replica that is stopping (or whose loop died) or
    draining."""
    if stopping:
        why = " (scheduler loop stopped)" if failure is not None else ""
        raise OverloadedError(f"replica {name} is shutting down{why}")
    if draining:
        raise DrainingError(
            f"replica {name} is draining: it takes no new requests; retry on another replica"
        )


def check(
    req: GenerateRequest,
    *,
    name: str,
    vocab_size: int,
    max_model_len: int,
    waiting: int,
    max_waiting: int,
    running_ids: Container[str],
) -> Intake:
    """Validate ``req`` against the model (``vocab_size``, ``max_model_len``) and the
    queue (``waiting`` of ``max_waiting``, ``running_ids``). Raises InvalidRequestError
    or QueueFullError."""
    n = len(req.token_ids)
    for field, ids in (("token_ids", req.token_ids), ("stop_token_ids", req.stop_token_ids)):
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"{field}.{bad}: {ids[bad]} is not a token id (0..{vocab_size - 1})"
            )
    if n >= max_model_len:
        raise InvalidRequestError(
            f"prompt of {n} tokens leaves no room to generate: max_model_len is {max_model_len}"
        )
    if waiting >= max_waiting:
        raise QueueFullError(f"{waiting} requests already waiting on replica {name}")
    request_id = req.request_id or f"req_{uuid.uuid4().hex}"
    if request_id in running_ids:
        raise InvalidRequestError(f"request_id {request_id} is already running here")
    try:
        params = SamplingParams(
            # NOTE: the engine sizes its pool to hold at least one max_model_len
            # sequence, so anything within max_model_len fits an empty pool.
            max_tokens=min(req.max_tokens, max_model_len - n),
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=tuple(req.stop_sequences),
            stop_token_ids=tuple(req.stop_token_ids),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
        )
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc
    return Intake(
        request_id=request_id,
        params=params,
        key_spans=[(s.start_block, list(s.extra_keys)) for s in req.key_spans],
        owner=admission.retention_owner(req.retention_owner, req.owner_retained_share),
    )
