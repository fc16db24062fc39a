"""The operator's load on the Kubernetes API at rest: N CacheReplicas, every member
Ready and its /v1/stats steady, counted per verb over a window.

Before the operator watched its pods, every timer tick LISTed the pods of its
CacheReplica twice and patched status whatever changed: 2 LIST and 1 PATCH per
CacheReplica per `statsInterval` (10 s in the chart), so 200 CacheReplicas made 40
LIST/s and 20 writes/s. Now the pods come from one watch (a kopf index) and status is
written only when it changed.

It runs the real operator (kopf, as `kopf run -A`) against the emulated API server of
tests/operator (RBAC from the chart, the CRD's schema), a fake kubelet that makes every
pod Ready, and one stub replica answering every member's /v1/stats. Only the
operator's own requests are counted (its bearer token), after every CacheReplica has
settled.

    .venv/bin/python bench/operator_load_bench.py --replicas 200 --window 60
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import kmock

from cachepoint.bench.kube.cluster import (
    CR,
    Cluster,
    StatsServer,
    cache_replica,
    prepare_cluster,
    run_kubelet,
    running_operator,
)
from cachepoint.bench.kube.emulator import ApiServer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replicas", type=int, default=200, help="CacheReplicas (default 200)")
    p.add_argument("--members", type=int, default=1, help="members each (default 1)")
    p.add_argument("--interval", type=float, default=10.0, help="the status timer, s (chart: 10)")
    p.add_argument("--window", type=float, default=60.0, help="seconds counted (default 60)")
    p.add_argument(
        "--settle-timeout", type=float, default=600.0, help="give up settling after this, s"
    )
    args = p.parse_args(argv)
    if args.replicas < 1 or args.members < 1 or args.interval <= 0 or args.window <= 0:
        p.error("--replicas and --members must be >= 1, --interval and --window > 0")
    return args


def _verb(request: Any) -> str:
    action = str(request.action.value).lower() if request.action else "?"
    return {"fetch": "get", "update": "patch"}.get(action, action)


class RequestCounter:
    """Counts the operator's requests in a window, and keeps kmock's request history
    short meanwhile.

    NOTE: kmock matches each new request against its reactions by scanning the whole
    history, so a long run slows quadratically (at 200 CacheReplicas the emulator, not
    the operator, became the bottleneck). The counter moves old requests out of the
    history into its tallies; the newest are kept, since requests still being answered
    are in there.
    """

    KEEP = 200

    def __init__(self, server: ApiServer) -> None:
        self.server = server
        self.counting = False
        self.before: set[int] = set()  # requests that came before the window
        self.counted: collections.Counter[tuple[str, str]] = collections.Counter()

    def _take(self, requests: list[Any]) -> None:
        if not self.counting:
            return
        for r in requests:
            if id(r) in self.before or not self.server.from_operator(r):
                continue
            sub = f"/{r.subresource}" if r.subresource else ""
            self.counted[_verb(r), f"{r.resource.plural}{sub}"] += 1
            if r.subresource == "status" and "statsError" in str(r.data):
                # A member whose /v1/stats poll failed or timed out: the status says so.
                self.counted[_verb(r), f"{r.resource.plural}{sub} (a statsError)"] += 1

    def trim(self, keep: int = KEEP) -> None:
        history: list[Any] = self.server._requests
        if len(history) > keep:
            old = history[: len(history) - keep]
            del history[: len(history) - keep]
            self._take(old)

    def start(self) -> None:
        self.trim()
        self.before = {id(r) for r in self.server._requests}
        self.counting = True

    def stop(self) -> None:
        self.trim(keep=0)
        self.counting = False

    async def run(self) -> None:
        while True:
            self.trim()
            await asyncio.sleep(0.5)


def settled(cluster: Cluster, n: int, members: int) -> int:
    done = 0
    for obj in cluster.list(CR):
        status = obj.get("status") or {}
        if status.get("readyReplicas") == members and status.get("members"):
            done += 1
    return done


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    # NOTE: progress goes to sys.__stderr__: KopfRunner swaps sys.stdout and sys.stderr
    # (click's test runner) while the operator runs.
    # NOTE: the timer's interval is read when the handlers are imported (kopf
    # decorators): set it before running_operator imports them.
    os.environ["CACHEPOINT_OPERATOR_STATS_INTERVAL"] = str(args.interval)
    os.environ["CACHEPOINT_OPERATOR_STATS_TIMEOUT"] = "2"
    stats = StatsServer()
    thread = threading.Thread(target=stats.httpd.serve_forever, daemon=True)
    thread.start()
    tmp = Path(tempfile.mkdtemp(prefix="operator-load-"))
    async with ApiServer() as server, kmock.Server(server):
        cluster = prepare_cluster(server, tmp / "kubeconfig")
        os.environ["KUBECONFIG"] = str(tmp / "kubeconfig")
        kubelet = asyncio.create_task(run_kubelet(cluster, period=0.5))
        counter = RequestCounter(server)
        trimmer = asyncio.create_task(counter.run())
        try:
            async with running_operator():
                t0 = time.monotonic()
                for i in range(args.replicas):
                    body = cache_replica(f"r{i:04d}", replicas=args.members, port=stats.port)
                    await cluster.create(body)
                    if (i + 1) % 25 == 0:
                        print(f"  created {i + 1}/{args.replicas}", file=sys.__stderr__)
                last = -1
                while (done := settled(cluster, args.replicas, args.members)) < args.replicas:
                    if time.monotonic() - t0 > args.settle_timeout:
                        raise SystemExit(f"only {done}/{args.replicas} settled in time")
                    if done != last:
                        print(f"  settling: {done}/{args.replicas}", file=sys.__stderr__)
                        last = done
                    await asyncio.sleep(1.0)
                settle_s = time.monotonic() - t0
                print(f"  settled in {settle_s:.0f} s; measuring", file=sys.__stderr__)
                # One more interval so every timer has seen its settled status once.
                await asyncio.sleep(args.interval * 1.5)
                counter.start()
                w0 = time.monotonic()
                await asyncio.sleep(args.window)
                counter.stop()
                window = time.monotonic() - w0
        finally:
            for task in (kubelet, trimmer):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    stats.httpd.shutdown()
    by_verb: collections.Counter[str] = collections.Counter()
    by_resource: collections.Counter[str] = collections.Counter()
    for (verb, resource), n in counter.counted.items():
        if not resource.endswith(")"):  # the statsError tally is a subset, not more
            by_verb[verb] += n
        by_resource[f"{verb} {resource}"] += n
    return {"settle_s": settle_s, "window": window, "by_verb": by_verb, "by_res": by_resource}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"operator API load: {args.replicas} CacheReplicas x {args.members} member(s), "
        f"status timer {args.interval:g} s, window {args.window:g} s"
    )
    result = asyncio.run(bench(args))
    w = result["window"]
    print(f"settled in {result['settle_s']:.1f} s")
    print(f"{'verb':<8} {'requests':>9} {'per s':>8}")
    for verb in ("list", "watch", "get", "create", "patch", "delete"):
        n = result["by_verb"].get(verb, 0)
        print(f"{verb:<8} {n:>9} {n / w:>8.2f}")
    writes = sum(result["by_verb"].get(v, 0) for v in ("create", "patch", "delete"))
    print(f"{'writes':<8} {writes:>9} {writes / w:>8.2f}")
    old_lists = 2 * args.replicas / args.interval
    old_writes = args.replicas / args.interval
    print(
        f"before issue 17 (2 LIST + 1 status PATCH per tick): {old_lists:.1f} LIST/s, "
        f"{old_writes:.1f} writes/s"
    )
    print("by resource:")
    for key, n in sorted(result["by_res"].items(), key=lambda kv: -kv[1]):
        print(f"  {key:<40} {n:>7} {n / w:>8.2f}/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
