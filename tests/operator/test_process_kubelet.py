"""The process kubelet (the e2e tests' stand-in for a node) keeps a real kubelet's rules.

Failed is terminal: a readiness probe still in flight when a pod is evicted must not
write Running over the eviction. Before this rule the e2e test waited forever, on a
loaded machine, for the operator to replace a pod that looked Running but was dead.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from .process_kubelet import PodProcess, ProcessKubelet

POD: dict[str, Any] = {
    "metadata": {"namespace": "ns", "name": "m-0", "uid": "u1"},
    "spec": {
        "containers": [{"name": "replica", "command": ["x"], "ports": [{"containerPort": 8000}]}]
    },
}


async def test_a_probe_in_flight_does_not_undo_an_eviction(tmp_path: Path) -> None:
    statuses: list[dict[str, Any]] = []
    stored = {"metadata": dict(POD["metadata"])}

    async def patch_status(namespace: str, name: str, status: dict[str, Any]) -> None:
        statuses.append(status)

    kubelet = ProcessKubelet(
        list_pods=lambda: [POD],
        get=lambda kind, namespace, name: stored,
        patch_status=patch_status,
        confirm_delete=lambda namespace, name: None,
        dns={},
        log_dir=tmp_path,
    )
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    p = PodProcess(namespace="ns", name="m-0", uid="u1", ip="127.0.0.9", pod=POD, log_dir=tmp_path)
    p.proc, p.ready = proc, True
    kubelet.pods[p.key] = p

    answer = asyncio.Event()

    async def slow_get(url: str, **_: Any) -> httpx.Response:
        # The probe's GET is slow (a loaded machine), then finds the process gone.
        await answer.wait()
        raise httpx.ConnectError("connection refused")

    kubelet._http.get = slow_get  # type: ignore[method-assign]
    try:
        probe = asyncio.create_task(kubelet._probe(p))
        await asyncio.sleep(0)  # the probe is now waiting on its GET
        await kubelet.fail("ns", "m-0")
        answer.set()
        await probe
    finally:
        proc.kill()
        proc.wait()
        await kubelet._http.aclose()

    assert statuses, "the eviction wrote no status"
    assert statuses[-1]["phase"] == "Failed", [s["phase"] for s in statuses]
    assert [s["phase"] for s in statuses] == ["Failed"]
