"""Typed dependencies for the routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ..metrics import ReplicaMetrics
from ..scheduler import Scheduler


def get_scheduler(request: Request) -> Scheduler:
    scheduler: Scheduler = request.app.state.scheduler
    return scheduler


def get_metrics(request: Request) -> ReplicaMetrics:
    metrics: ReplicaMetrics = request.app.state.metrics
    return metrics


SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
MetricsDep = Annotated[ReplicaMetrics, Depends(get_metrics)]
