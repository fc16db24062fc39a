"""Typed dependencies for the routes."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from cachepoint.replica.errors import SchedulerError
from cachepoint.replica.interface import ReplicaCore
from cachepoint.replica.metrics import ReplicaMetrics


class UnauthorizedError(SchedulerError):
    """The call lacks the internal token: only the gateway (and the operator) may call."""

    kind = "authentication_error"
    status = 401


def get_scheduler(request: Request) -> ReplicaCore:
    scheduler: ReplicaCore = request.app.state.scheduler
    return scheduler


def get_metrics(request: Request) -> ReplicaMetrics:
    metrics: ReplicaMetrics = request.app.state.metrics
    return metrics


def require_internal_token(request: Request) -> None:
    """401 unless `Authorization: Bearer <internal_token>` matches the configured token.

    Without a configured token the replica is open (tests, a laptop); the chart and the
    embedded stack always set one, so billing cannot be skipped by calling a replica.
    """
    scheduler: ReplicaCore = request.app.state.scheduler
    expected = scheduler.settings.internal_token
    if expected is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # NOTE: compare_digest takes the same time wherever the first difference is, so the
    # token cannot be guessed byte by byte from response times.
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), expected.get_secret_value().encode()
    ):
        raise UnauthorizedError("missing or wrong internal token")


SchedulerDep = Annotated[ReplicaCore, Depends(get_scheduler)]
MetricsDep = Annotated[ReplicaMetrics, Depends(get_metrics)]
