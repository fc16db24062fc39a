"""Errors the scheduler raises to its callers; the API maps each to one HTTP status."""

from __future__ import annotations


class SchedulerError(Exception):
    """Base class; ``kind`` names the error class in the envelope."""

    kind = "api_error"
    status = 500


class InvalidRequestError(SchedulerError, ValueError):
    """The request can never run here (bad token id, too long, too big for the pool)."""

    kind = "invalid_request_error"
    status = 400


class QueueFullError(SchedulerError):
    """The waiting queue is at its bound; retry later."""

    kind = "rate_limit_error"
    status = 429


class OverloadedError(SchedulerError):
    """The pool cannot fit the request now (blocks retained or in use); retry later."""

    kind = "overloaded_error"
    status = 503


class DrainingError(SchedulerError):
    """The replica is draining (its pod is going away): it takes no new request, while
    the ones it runs finish. Retryable at once on another replica, as the gateway does."""

    kind = "overloaded_error"
    status = 503


class EngineFailedError(SchedulerError):
    """The forward pass failed; the request's blocks were returned, nothing published."""

    kind = "api_error"
    status = 500


class CancelledRequestError(SchedulerError):
    """The client went away; the request was aborted."""

    kind = "cancelled"
    status = 499


class RequestFailedError(SchedulerError):
    """Something raised while the replica worked on this request alone (sampling, its
    commit, decoding its text): it fails, its blocks go back, the others go on."""

    kind = "api_error"
    status = 500


class ReplicaFailedError(SchedulerError):
    """The scheduler loop itself died: every request still on the replica fails, and the
    process exits so that it is restarted."""

    kind = "api_error"
    status = 500


def failed_inside(replica: str, exc: BaseException) -> RequestFailedError:
    """What a request fails with when something raised while the replica worked on it
    alone: the same words on both engines."""
    return RequestFailedError(
        f"request failed inside replica {replica}: {type(exc).__name__}: {exc}"
    )
