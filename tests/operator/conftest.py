"""Fixtures over the emulated Kubernetes API (cachepoint.bench.kube): a cluster with the
chart's CRDs and RBAC, the real operator, a fake kubelet and a stub replica.

The operator runs through `kopf.testing.KopfRunner` in its own thread and event loop,
talking HTTP to the kmock server in the test's loop; tests therefore only ever wait
with `await` so that server keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from cachepoint.bench.kube.cluster import (
    Cluster,
    StatsServer,
    prepare_cluster,
    run_kubelet,
    running_operator,
)
from cachepoint.bench.kube.emulator import ApiServer


@pytest.fixture
def kmock_options(kmock_options: dict[str, Any]) -> dict[str, Any]:
    return {**kmock_options, "cls": ApiServer}


@pytest.fixture
def cluster(kmock: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    path = tmp_path / "kubeconfig"
    result = prepare_cluster(kmock, path)
    monkeypatch.setenv("KUBECONFIG", str(path))
    return result


@pytest.fixture
async def operator(cluster: Cluster) -> AsyncIterator[Any]:
    async with running_operator() as runner:
        yield runner


@pytest.fixture
async def kubelet(cluster: Cluster) -> AsyncIterator[None]:
    task = asyncio.create_task(run_kubelet(cluster))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.fixture
def stats_server() -> Iterator[StatsServer]:
    server = StatsServer()
    thread = threading.Thread(target=server.httpd.serve_forever, daemon=True)
    thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()
