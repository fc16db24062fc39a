"""How far can an eviction policy that ranks blocks by hit class and idle age go?

Run:  .venv/bin/python bench/sim_eviction_ceiling.py [--trace FILE] [--fracs 0.16 0.08]

One pool holding ``frac`` of the trace's distinct blocks (16 % and 8 % are what 16
replicas at 1 % and 0.5 % hold together, so routing cannot lose a hit), replayed at
the trace's own block granularity: a request hits the longest run of its leading
hash ids that is cached, then every id of the request is (re)inserted. Reported as
the share of the infinite-cache bound, for:

- ``lru``: least recently used first (a request's deeper blocks before its prefix);
- ``class/age ceiling``: one LRU list per class, evicting the oldest block of the
  class whose score ``P(reused within H s | class, idle for a s)`` is lowest, with
  the score tables computed from the *whole trace*, future included. Class is
  ``min(prior uses of the block, 2)``, which remembers uses across evictions (kvcore's
  ``hits`` restarts when a block is refilled, so this is the more informed of the
  two); ``--length-classes`` also splits classes by the prompt's log2 length;
- ``oracle``: Belady, the block whose next use is furthest away goes first.

An online policy has to learn what the ceiling is handed, so it can only do worse;
the point is how little even the handed tables buy over LRU.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import math
import sys
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cachepoint.sim.cli import DEFAULT_TRACES, TRACE_ENV, default_trace
from cachepoint.sim.trace import load_trace

Key = tuple[str | None, int]  # (tenant, hash id): tenants never share a block
AGES = [0.0] + [10 * 1.25**i for i in range(40)]  # score-table ages, 10 s to 60 h


@dataclass(frozen=True, slots=True)
class Request:
    t: float  # arrival, seconds
    keys: tuple[Key, ...]  # its blocks, prompt order
    input_length: int  # prompt tokens


def load(path: str) -> list[Request]:
    trace = load_trace(path)
    return [
        Request(r.arrival_s, tuple((r.tenant, h) for h in r.hash_ids), r.input_length)
        for r in trace.requests
    ]


def bound_and_distinct(reqs: Sequence[Request]) -> tuple[int, int]:
    """Blocks an infinite cache would hit (every block seen before), and distinct blocks."""
    seen: set[Key] = set()
    hits = 0
    for q in reqs:
        for k in q.keys:
            hits += k in seen
            seen.add(k)
    return hits, len(seen)


def run_priority(
    reqs: Sequence[Request], cap: int, priority: Callable[[int, int, Request], float]
) -> int:
    """Hits of a pool that evicts the lowest ``priority(request index, position, request)``."""
    heap: list[tuple[float, int, Key]] = []
    live: dict[Key, int] = {}  # key -> seq of its live heap entry
    hits = seq = 0
    for r, q in enumerate(reqs):
        n = 0
        while n < len(q.keys) and q.keys[n] in live:
            n += 1
        hits += n
        for i, k in enumerate(q.keys):
            seq += 1
            live[k] = seq
            heapq.heappush(heap, (priority(r, i, q), seq, k))
        while len(live) > cap:
            _, s, k = heapq.heappop(heap)
            if live.get(k) == s:
                del live[k]
    return hits


def next_uses(reqs: Sequence[Request]) -> list[list[int]]:
    """For each request and position, the index of the next request using that block."""
    nxt: dict[Key, int] = {}
    out: list[list[int]] = [[] for _ in reqs]
    for r in range(len(reqs) - 1, -1, -1):
        out[r] = [nxt.get(k, sys.maxsize) for k in reqs[r].keys]
        for k in reqs[r].keys:
            nxt[k] = r
    return out


ClassFn = Callable[[int, Request], int]  # (prior uses of the block, request) -> class


def use_class(uses: int, q: Request) -> int:
    return min(uses, 2)


def use_and_length_class(uses: int, q: Request) -> int:
    return 10 * min(uses, 2) + min(max(int(math.log2(max(q.input_length, 1))) - 11, 0), 5)


def score_tables(reqs: Sequence[Request], cls: ClassFn, horizon: float) -> dict[int, list[float]]:
    """P(next use within ``horizon`` s | class, idle at least a s), per AGES bucket,
    from every gap between uses in the trace (blocks never used again count as
    surviving every age)."""
    last: dict[Key, tuple[float, int]] = {}
    uses: Counter[Key] = Counter()
    gaps: defaultdict[int, list[float]] = defaultdict(list)
    for q in reqs:
        for k in q.keys:
            if k in last:
                t0, c = last[k]
                gaps[c].append(q.t - t0)
            last[k] = (q.t, cls(uses[k], q))
            uses[k] += 1
    never = Counter(c for _, c in last.values())
    tables: dict[int, list[float]] = {}
    for c in set(gaps) | set(never):
        g = sorted(gaps[c])
        total = len(g) + never[c]
        row = []
        for a in AGES:
            alive = total - bisect.bisect_right(g, a)
            within = bisect.bisect_right(g, a + horizon) - bisect.bisect_right(g, a)
            row.append(within / alive if alive else 0.0)
        tables[c] = row
    return tables


def run_class_age(reqs: Sequence[Request], cap: int, cls: ClassFn, horizon: float) -> int:
    """Hits of the per-class LRU pool that evicts the lowest-scoring class head."""
    tables = score_tables(reqs, cls, horizon)

    def score(c: int, age: float) -> float:
        return tables[c][bisect.bisect_right(AGES, age) - 1]

    lists: defaultdict[int, OrderedDict[Key, float]] = defaultdict(OrderedDict)
    where: dict[Key, int] = {}
    uses: Counter[Key] = Counter()
    hits = 0
    for q in reqs:
        n = 0
        while n < len(q.keys) and q.keys[n] in where:
            n += 1
        hits += n
        for k in q.keys:
            c = cls(uses[k], q)
            uses[k] += 1
            if k in where:
                del lists[where[k]][k]
            where[k] = c
            lists[c][k] = q.t
        while len(where) > cap:
            best: tuple[float, int, Key] | None = None
            for c, lst in lists.items():
                if lst:
                    k, t0 = next(iter(lst.items()))
                    s = score(c, q.t - t0)
                    if best is None or s < best[0]:
                        best = (s, c, k)
            assert best is not None
            _, c, k = best
            del lists[c][k]
            del where[k]
    return hits


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="The module docstring explains the model; bench/RESULTS.md has the figures.",
    )
    p.add_argument(
        "--trace",
        metavar="FILE",
        help=(
            f"trace JSONL; default ${TRACE_ENV}, else {' or '.join(DEFAULT_TRACES)}, "
            "else the simulator's bundled 500-request sample"
        ),
    )
    p.add_argument(
        "--fracs",
        type=float,
        nargs="+",
        default=[0.16, 0.08],
        help="pool sizes as shares of the distinct blocks (0.16 0.08)",
    )
    p.add_argument(
        "--horizons",
        type=float,
        nargs="+",
        default=[60.0, 200.0, 600.0],
        help="score horizons H in seconds to try (60 200 600)",
    )
    p.add_argument(
        "--length-classes", action="store_true", help="also split classes by prompt length"
    )
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    args = p.parse_args(argv)
    path = args.trace or default_trace()
    if path is None:
        p.error(f"no trace given and none found at {' or '.join(DEFAULT_TRACES)}")
    reqs = load(path)[: args.limit]
    bound, distinct = bound_and_distinct(reqs)
    print(f"trace {path}: {len(reqs):,} requests, {distinct:,} distinct blocks, bound {bound:,}")
    future = next_uses(reqs)
    classes: list[tuple[str, ClassFn]] = [("uses", use_class)]
    if args.length_classes:
        classes.append(("uses+length", use_and_length_class))
    for frac in args.fracs:
        cap = int(distinct * frac)
        t0 = time.perf_counter()

        print(f"pool of {cap:,} blocks ({frac:.1%} of distinct):")
        rows = [("lru", run_priority(reqs, cap, lambda r, i, q: q.t - i * 1e-6))]
        for label, fn in classes:
            for h in args.horizons:
                name = f"class/age ceiling ({label}, H={h:g} s)"
                rows.append((name, run_class_age(reqs, cap, fn, h)))
        rows.append(("oracle (Belady)", run_priority(reqs, cap, lambda r, i, q: -future[r][i])))
        for name, hits in rows:
            print(f"  {name:42} {hits / bound:6.1%} of the bound")
        print(f"  ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
