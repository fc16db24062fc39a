"""A kubelet that runs each pod the operator creates as a real local process.

Where the emulated API server (emulator.py) stands in for the control plane, this
stands in for the nodes: every member pod becomes a real `cachepoint-replica` process,
started from the pod's own container command and environment, with a loopback address
of its own as the pod IP (127.0.0.N: the whole 127/8 reaches `lo` on Linux, so every
pod binds the same container port, as pods in their own network namespaces do).

What it does, as a kubelet would:
- resolves the container env: plain values, `secretKeyRef` (a missing Secret or key
  holds the container in CreateContainerConfigError until it appears) and `fieldRef`
  (metadata.name, metadata.namespace, status.podIP);
- runs the readiness probe from the pod spec and writes phase, podIP, the Ready
  condition and containerStatuses to the pod's status subresource;
- restarts a container that exits (restartPolicy Always), counting restarts;
- on deletion runs the preStop exec hook, then SIGTERM, then SIGKILL once the grace
  period is over, and confirms the delete (gracePeriodSeconds=0) when the API server
  kept the object with a deletionTimestamp;
- `fail()` plays an eviction: the container is stopped and the pod's phase is Failed.

What it cannot do is cluster DNS: `dns` maps the service host:port pairs that pods
name (NATS, member DNS names) to local addresses, applied to env values. That map,
and the host the replica binds (the pod IP instead of 0.0.0.0), are the only edits
made to what the operator asked for.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

BIN = Path(sys.executable).parent  # the venv's bin: `python` and `cachepoint-replica`
Getter = Callable[[str, str, str], dict[str, Any] | None]  # (resource, namespace, name)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ConfigError(Exception):
    """The container cannot start yet (CreateContainerConfigError)."""


@dataclass
class PodProcess:
    namespace: str
    name: str
    uid: str
    ip: str
    pod: dict[str, Any]
    log_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    ready: bool = False
    waiting_reason: str | None = None
    failed: bool = False
    terminating: bool = False
    started: list[float] = field(default_factory=list)
    status_sent: dict[str, Any] | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    @property
    def container(self) -> dict[str, Any]:
        return self.pod["spec"]["containers"][0]

    @property
    def port(self) -> int:
        return int(self.container["ports"][0]["containerPort"])

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


class ProcessKubelet:
    def __init__(
        self,
        *,
        list_pods: Callable[[], list[dict[str, Any]]],
        get: Getter,
        patch_status: Callable[[str, str, dict[str, Any]], Any],
        confirm_delete: Callable[[str, str], Any],
        dns: dict[str, str],
        log_dir: Path,
        restart_backoff: float = 0.5,
    ) -> None:
        self._list_pods = list_pods
        self._get = get
        self._patch_status = patch_status
        self._confirm_delete = confirm_delete
        self.dns = dns
        self.log_dir = log_dir
        self.restart_backoff = restart_backoff
        self.pods: dict[tuple[str, str], PodProcess] = {}
        self.gone: list[PodProcess] = []  # terminated pods, for the test to inspect
        self._ips = iter(f"127.0.0.{n}" for n in range(10, 250))
        self._tasks: set[asyncio.Task[None]] = set()
        self._http = httpx.AsyncClient(timeout=2.0)
        self._loop_task: asyncio.Task[None] | None = None

    # -------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> ProcessKubelet:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._loop_task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for task in list(self._tasks):
            task.cancel()
        for p in list(self.pods.values()):
            self._signal(p, signal.SIGKILL)
            if p.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.proc.wait(5)
        await self._http.aclose()

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -------------------------------------------------------------- the test's levers
    def kill(self, namespace: str, name: str) -> int:
        """SIGKILL the container (a crash); the kubelet restarts it. Returns the old pid."""
        p = self.pods[(namespace, name)]
        assert p.proc is not None
        pid = p.proc.pid
        self._signal(p, signal.SIGKILL)
        return pid

    async def fail(self, namespace: str, name: str, reason: str = "Evicted") -> None:
        """Evict: stop the container for good and report the pod Failed."""
        p = self.pods[(namespace, name)]
        p.failed = True
        self._signal(p, signal.SIGKILL)
        status = {
            "phase": "Failed",
            "reason": reason,
            "message": "The node was low on resource: memory.",
            "podIP": p.ip,
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodFailed"}],
            "containerStatuses": [
                {
                    "name": p.container["name"],
                    "ready": False,
                    "restartCount": p.restarts,
                    "state": {"terminated": {"exitCode": 137, "reason": "Error"}},
                }
            ],
        }
        await self._write_status(p, status)

    # -------------------------------------------------------------- the sync loop
    async def _loop(self) -> None:
        tick = 0
        while True:
            try:
                await self._sync(probe=tick % 3 == 0)
            except Exception as exc:  # the kubelet outlives any one bad pass
                print(f"process kubelet: sync failed: {exc!r}", file=sys.stderr)
            tick += 1
            await asyncio.sleep(0.1)

    async def _sync(self, *, probe: bool) -> None:
        seen: set[tuple[str, str]] = set()
        for pod in self._list_pods():
            meta = pod["metadata"]
            key = (meta["namespace"], meta["name"])
            seen.add(key)
            p = self.pods.get(key)
            if p is not None and p.uid != meta["uid"]:
                # A new pod of the same name: the old one's termination is under way.
                continue
            if p is None:
                if meta.get("deletionTimestamp"):
                    continue
                if pod.get("status", {}).get("phase") in ("Failed", "Succeeded"):
                    continue
                p = PodProcess(
                    namespace=key[0],
                    name=key[1],
                    uid=meta["uid"],
                    ip=next(self._ips),
                    pod=pod,
                    log_dir=self.log_dir,
                )
                self.pods[key] = p
                self._start(p)
                await self._report(p)
                continue
            if meta.get("deletionTimestamp") and not p.terminating:
                p.terminating = True
                grace = meta.get("deletionGracePeriodSeconds")
                self._spawn_task(self._terminate(p, grace, confirm=True))
        for key, p in list(self.pods.items()):
            if key not in seen and not p.terminating:
                # Removed from the API without a graceful delete: stop it all the same.
                p.terminating = True
                self._spawn_task(self._terminate(p, None, confirm=False))
        for p in list(self.pods.values()):
            if p.terminating or p.failed:
                continue
            if p.proc is None or p.proc.poll() is not None:
                await self._restart(p)
            elif probe:
                await self._probe(p)

    # -------------------------------------------------------------- containers
    def _names(self, p: PodProcess) -> dict[str, str]:
        """What cluster DNS would resolve for this pod: the fixed `dns` map, plus every
        known pod's own name (hostname.subdomain.namespace.svc.cluster.local) as its IP."""
        names = dict(self.dns)
        for other in [*self.pods.values(), p]:
            spec = other.pod.get("spec") or {}
            if spec.get("hostname") and spec.get("subdomain"):
                fqdn = f"{spec['hostname']}.{spec['subdomain']}.{other.namespace}.svc.cluster.local"
                names[fqdn] = other.ip
        return names

    def _env(self, p: PodProcess) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEPOINT_")}
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        for item in p.container.get("env") or []:
            name = item["name"]
            if "value" in item:
                value = str(item["value"])
            else:
                source = item.get("valueFrom") or {}
                if "secretKeyRef" in source:
                    ref = source["secretKeyRef"]
                    secret = self._get("v1/secrets", p.namespace, ref["name"])
                    data = (secret or {}).get("data") or {}
                    if ref["key"] not in data:
                        raise ConfigError(f'secret "{ref["name"]}" key {ref["key"]} not found')
                    value = base64.b64decode(data[ref["key"]]).decode()
                elif "fieldRef" in source:
                    path = source["fieldRef"]["fieldPath"]
                    value = {
                        "metadata.name": p.name,
                        "metadata.namespace": p.namespace,
                        "status.podIP": p.ip,
                    }[path]
                else:
                    raise ConfigError(f"env {name}: unsupported source {source}")
            for host, local in self._names(p).items():
                value = value.replace(host, local)
            env[name] = value
        # The pod's network namespace: bind the pod IP, not every address of the host.
        env["CACHEPOINT_REPLICA_HOST"] = p.ip
        return env

    def _command(self, argv: list[str]) -> list[str]:
        # Commands resolve against the image's PATH; here that is the venv's bin.
        head = BIN / argv[0]
        return [str(head) if head.exists() else argv[0], *argv[1:]]

    def _start(self, p: PodProcess) -> None:
        try:
            env = self._env(p)
        except ConfigError as exc:
            p.waiting_reason = "CreateContainerConfigError"
            p.proc = None
            print(f"process kubelet: {p.namespace}/{p.name}: {exc}", file=sys.stderr)
            return
        p.waiting_reason = None
        argv = self._command([*p.container["command"], *(p.container.get("args") or [])])
        log = (self.log_dir / f"{p.namespace}_{p.name}_{p.uid[:8]}_{p.restarts}.log").open("wb")
        p.proc = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        p.ready = False
        p.started.append(asyncio.get_running_loop().time())

    async def _restart(self, p: PodProcess) -> None:
        if p.proc is not None:
            p.restarts += 1
            p.ready = False
            await self._report(p)
            await asyncio.sleep(self.restart_backoff)
        self._start(p)
        await self._report(p)

    async def _probe(self, p: PodProcess) -> None:
        probe = p.container.get("readinessProbe", {}).get("httpGet", {})
        path = probe.get("path", "/readyz")
        try:
            r = await self._http.get(p.url + path)
            ready = 200 <= r.status_code < 400
        except httpx.HTTPError:
            ready = False
        if ready != p.ready:
            p.ready = ready
            await self._report(p)

    def _signal(self, p: PodProcess, sig: signal.Signals) -> None:
        if p.proc is not None and p.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.proc.pid, sig)

    async def _terminate(self, p: PodProcess, grace: float | None, *, confirm: bool) -> None:
        spec = p.pod["spec"]
        grace = float(grace if grace is not None else spec.get("terminationGracePeriodSeconds", 30))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        hook = (p.container.get("lifecycle") or {}).get("preStop", {}).get("exec")
        running = p.proc is not None and p.proc.poll() is None
        if hook and running and grace > 0:
            # NOTE: kubelet runs preStop to completion (or the grace period) before
            # SIGTERM: this is where a member drains its streams.
            try:
                env = self._env(p)
                hook_proc = await asyncio.create_subprocess_exec(
                    *self._command(hook["command"]),
                    env=env,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
                try:
                    await asyncio.wait_for(hook_proc.wait(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    hook_proc.kill()
            except ConfigError:
                pass
        self._signal(p, signal.SIGTERM)
        while p.proc is not None and p.proc.poll() is None and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self._signal(p, signal.SIGKILL)
        if p.proc is not None:
            await asyncio.to_thread(p.proc.wait)
        self.pods.pop(p.key, None)
        self.gone.append(p)
        if confirm:
            await self._confirm_delete(p.namespace, p.name)

    # -------------------------------------------------------------- status
    async def _report(self, p: PodProcess) -> None:
        # NOTE: Failed is terminal, as on a real kubelet. A probe or restart that was in
        # flight when the pod was evicted (its GET fails once the process is killed)
        # must not write Running over the Failed status: the operator would then wait
        # forever on a pod that never comes back. Seen under CI load.
        if p.failed:
            return
        state: dict[str, Any]
        if p.waiting_reason:
            state = {"waiting": {"reason": p.waiting_reason}}
        elif p.proc is not None and p.proc.poll() is None:
            state = {"running": {"startedAt": _now()}}
        else:
            state = {"waiting": {"reason": "CrashLoopBackOff"}}
        ready = "True" if p.ready else "False"
        status = {
            "phase": "Running" if p.proc is not None else "Pending",
            "podIP": p.ip,
            "hostIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": _now()}],
            "containerStatuses": [
                {
                    "name": p.container["name"],
                    "ready": p.ready,
                    "restartCount": p.restarts,
                    "state": state,
                }
            ],
        }
        await self._write_status(p, status)

    async def _write_status(self, p: PodProcess, status: dict[str, Any]) -> None:
        current = self._get("v1/pods", p.namespace, p.name)
        if current is None or current["metadata"].get("uid") != p.uid:
            return
        await self._patch_status(p.namespace, p.name, status)
        p.status_sent = status


class NatsUsersReloader:
    """The NATS StatefulSet's config reloader: users.conf follows the users Secret.

    The chart mounts the operator-maintained Secret next to nats.conf and a reloader
    signals nats-server on change; here the Secret is read from the API server, written
    beside the config and nats-server gets SIGHUP (its reload signal)."""

    def __init__(self, get: Getter, namespace: str, secret: str, conf_dir: Path) -> None:
        self._get, self.namespace, self.secret, self.conf_dir = get, namespace, secret, conf_dir
        self.pid: int | None = None
        self.reloads = 0
        self._last: str | None = None

    def write(self) -> bool:
        secret = self._get("v1/secrets", self.namespace, self.secret)
        data = (secret or {}).get("data") or {}
        if "users.conf" not in data:
            return False
        text = base64.b64decode(data["users.conf"]).decode()
        if text == self._last:
            return False
        (self.conf_dir / "users.conf").write_text(text)
        self._last = text
        return True

    async def run(self) -> None:
        while True:
            if self.write() and self.pid is not None:
                os.kill(self.pid, signal.SIGHUP)
                self.reloads += 1
            await asyncio.sleep(0.1)
