"""Hit-density eviction: give up the free block least likely to be hit soon, learned online.

Free blocks sit in one LRU list per *class* (how often the block was hit since it
was filled: 0, 1, 2 or more). When the pool needs blocks, the queue looks at the
oldest block of each class and evicts the one whose class and idle age predict the
lowest chance of a hit within a horizon. Those chances are learned from the queue's
own traffic: every block that leaves by a hit says "reused after idling ``a``
seconds", every block evicted says "still unused at ``a``", and every block still
queued says "unused so far". Until it has seen enough, it evicts in plain LRU order.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .block import KVBlock
from .clock import Clock
from .free_queue import FreeBlockQueue

NUM_CLASSES = 3  # classes by hits since filled: 0, 1, 2 or more
BUCKETS_PER_OCTAVE = 4  # resolution of the idle-age histograms
MIN_AGE = 1 / 16  # seconds; younger ages share the first bucket
NUM_BUCKETS = BUCKETS_PER_OCTAVE * 24  # the last bucket starts at MIN_AGE * 2**24 s (12 days)
_HEAD = NUM_CLASSES  # `_where` marker of a block in the head list
_LOG_BASE = BUCKETS_PER_OCTAVE / math.log(2)
# Lower edge and width of each bucket, in seconds (bucket 0 starts at 0; the last
# one is open-ended, and its width only scales how much exposure it needs).
_EDGES = [0.0] + [MIN_AGE * 2 ** (b / BUCKETS_PER_OCTAVE) for b in range(1, NUM_BUCKETS + 1)]
_WIDTHS = [_EDGES[b + 1] - _EDGES[b] for b in range(NUM_BUCKETS)]


def age_bucket(age: float) -> int:
    """The histogram bucket of an idle age in seconds (log-spaced, clamped at both ends)."""
    if age <= MIN_AGE:
        return 0
    return min(int(_LOG_BASE * math.log(age / MIN_AGE)), NUM_BUCKETS - 1)


@dataclass(frozen=True, slots=True)
class HitDensityEviction:
    """Evict the oldest block of whichever hit class is least likely to be reused soon.

    Scores are ``P(reused within H | class, idle for a so far)``, estimated online
    from decayed histograms of the idle ages at which blocks of each class were
    reused or evicted, and the ages of the blocks still queued (evicted and queued
    blocks are censored observations). The model is a reuse rate per idle second
    that falls with age, shared by the classes, times a factor per class
    (proportional hazards). The horizon ``H`` is ``horizon_share`` of the pool's
    measured eviction age.

    NOTE: the horizon follows the eviction age for the same reason
    `ReuseCreditEviction`'s credit does: what "soon" means moves with load (blocks
    last minutes at a trace's own rate, seconds at several times it), and a fixed
    number of seconds would be right at one load only. The decay lets the tables
    follow a workload that changes; the warm-up in LRU order keeps a fresh or
    cleared pool from acting on a handful of observations.
    """

    horizon_share: float = 1.0  # the scoring horizon, as a share of the eviction age
    half_life: float = 4.0  # in pool sizes: observations after which one counts half
    min_observations: int = 64  # decayed observations before scores replace LRU order
    name: str = "hit_density"  # how reports and settings name this strategy

    def __post_init__(self) -> None:
        if not self.horizon_share >= 0:
            raise ValueError("horizon_share must be non-negative")
        if not self.half_life > 0:
            raise ValueError("half_life must be positive")
        if self.min_observations < 0:
            raise ValueError("min_observations must be non-negative")

    def make_queue(self, blocks: list[KVBlock], clock: Clock) -> HitDensityQueue:
        return HitDensityQueue(
            blocks,
            clock,
            horizon_share=self.horizon_share,
            half_life=self.half_life,
            min_observations=self.min_observations,
        )


class ReuseHistogram:
    """One class's idle ages at reuse and at eviction, and the reuse rates fitted to them.

    A piecewise-constant hazard model: in each age bucket, reuses per second of
    exposure (how long blocks of the class sat idle at ages within the bucket).
    Evicted blocks and blocks still queued count as exposure without a reuse. The
    queue fits the rates over every class at once and hands each its own.

    NOTE: counting an evicted block as "at risk" for its whole last bucket, as a
    plain life table does, makes the ages where the queue evicts look colder than
    they are; the queue then evicts the class younger, which makes the next ages
    look colder still. Exposure in seconds has no such spiral.
    """

    __slots__ = ("cumulative", "left", "partial", "rate", "reused", "weight")

    def __init__(self) -> None:
        self.reused = [0.0] * NUM_BUCKETS  # decayed reuses by idle-age bucket
        self.left = [0.0] * NUM_BUCKETS  # decayed reuses and evictions by idle-age bucket
        self.partial = [0.0] * NUM_BUCKETS  # decayed seconds the leavers spent in their bucket
        self.rate = [0.0] * NUM_BUCKETS  # reuses per idle second, by bucket
        self.cumulative = [0.0] * (NUM_BUCKETS + 1)  # expected reuses before each bucket
        self.weight = 0.0  # decayed observations, reuses and evictions

    def record(self, age: float, *, reused: bool) -> None:
        """A block of the class left the queue after idling ``age`` s: hit, or evicted."""
        b = age_bucket(age)
        self.left[b] += 1.0
        self.partial[b] += age - _EDGES[b]
        if reused:
            self.reused[b] += 1.0
        self.weight += 1.0

    def decay(self, factor: float) -> None:
        self.reused = [x * factor for x in self.reused]
        self.left = [x * factor for x in self.left]
        self.partial = [x * factor for x in self.partial]
        self.weight *= factor

    def exposure(self, alive: list[int], alive_partial: list[float]) -> list[float]:
        """Idle seconds the class spent at each age bucket; ``alive`` and
        ``alive_partial`` describe its queued blocks.

        NOTE: queued blocks are censored observations too; without them a class the
        queue never evicts would look as if every block of it came back.
        """
        left, partial = self.left, self.partial
        out = [0.0] * NUM_BUCKETS
        through = 0.0  # blocks that lived past the bucket
        for b in range(NUM_BUCKETS - 1, -1, -1):
            out[b] = through * _WIDTHS[b] + partial[b] + alive_partial[b]
            through += left[b] + alive[b]
        return out

    def set_rates(self, rates: list[float]) -> None:
        """Adopt fitted reuse rates (per idle second, by bucket) and integrate them."""
        self.rate = rates
        cumulative = self.cumulative
        for b in range(NUM_BUCKETS):
            cumulative[b + 1] = cumulative[b] + rates[b] * _WIDTHS[b]

    def expected(self, age: float) -> float:
        """Expected reuses of a block between age 0 and ``age`` (the cumulative hazard)."""
        b = age_bucket(age)
        return self.cumulative[b] + self.rate[b] * (age - _EDGES[b])

    def score(self, age: float, horizon: float) -> float:
        """P(reused within ``horizon`` | not reused by ``age``)."""
        return max(0.0, 1.0 - math.exp(self.expected(age) - self.expected(age + horizon)))


def decreasing_rates(hits: list[float], seconds: list[float]) -> list[float]:
    """Hits per second by bucket, fitted non-increasing in age (pool adjacent violators).

    A bucket without exposure takes the rate of the younger ages before it.
    """
    runs: list[list[float]] = []  # [hits, seconds, buckets]
    for h, x in zip(hits, seconds, strict=True):
        if x <= 0.0 and runs:
            runs[-1][2] += 1
            continue
        runs.append([h, x, 1])
        while len(runs) > 1 and runs[-2][0] * runs[-1][1] < runs[-1][0] * runs[-2][1]:
            last = runs.pop()
            runs[-1][0] += last[0]
            runs[-1][1] += last[1]
            runs[-1][2] += last[2]
    out: list[float] = []
    for h, x, span in runs:
        out.extend([h / x if x > 0.0 else 0.0] * int(span))
    # NOTE: past the oldest age with a reuse the fit is zero, and a zero would make
    # every class look alike there and leave the choice to LRU, just where blocks
    # hit more often are still the better bet. A rate falling as 1/age (a power-law
    # idle time, as reuse distances usually are) keeps the classes apart.
    hot = max((b for b in range(NUM_BUCKETS) if out[b] > 0.0), default=-1)
    if 0 <= hot < NUM_BUCKETS - 1:
        edge = _EDGES[hot + 1]
        for b in range(hot + 1, NUM_BUCKETS):
            out[b] = out[hot] * edge / _EDGES[b + 1]
    return out


class HitDensityQueue:
    """The free queue of `HitDensityEviction`: a head list, then one LRU list per class.

    Empty and expired blocks (``appendleft``) sit in the head list and go first, as
    in every strategy. ``popleft_n`` then compares the class lists' heads: by score
    once the tables hold ``min_observations``, else by freeing order (plain LRU).
    O(1) per append and remove, O(classes) per evicted block; every quarter pool of
    observations a refresh walks the queue and refits the tables (O(1) amortized).
    """

    __slots__ = (
        "_clock",
        "_freed_at",
        "_next",
        "_observations",
        "_refresh_every",
        "_seq",
        "_stats",
        "_where",
        "classes",
        "decay_factor",
        "eviction_age",
        "factors",
        "head",
        "horizon_share",
        "learned",
        "min_observations",
    )

    AGE_WEIGHT = 1 / 64  # weight of each evicted block in the eviction-age mean
    MIN_REFRESH = 64  # fewest observations between decays and table rebuilds
    PRIOR_REUSES = 4.0  # pseudo-reuses that pull a class's factor towards 1

    def __init__(
        self,
        blocks: Iterable[KVBlock],
        clock: Clock,
        *,
        horizon_share: float = 1.0,
        half_life: float = 4.0,
        min_observations: int = 64,
    ) -> None:
        blocks = list(blocks)
        size = max((b.block_id for b in blocks), default=-1) + 1
        self.head = FreeBlockQueue(blocks)  # empty and expired blocks: taken first
        self.classes = [FreeBlockQueue() for _ in range(NUM_CLASSES)]  # cached blocks by hits
        self.horizon_share = horizon_share  # the scoring horizon, share of eviction_age
        self.min_observations = min_observations  # decayed, before scores replace LRU order
        # NOTE: the queued blocks enter the tables undecayed at every refresh, so the
        # decayed flow of observations must scale with the pool, as must the cost of
        # the refresh's walk over them.
        self._refresh_every = max(self.MIN_REFRESH, size // 4)  # observations per refresh
        self.decay_factor = 0.5 ** (self._refresh_every / (half_life * max(size, 1)))
        self.eviction_age = 0.0  # mean seconds an evicted block sat free; 0 until one is
        self._clock = clock  # the pool's clock
        self._stats = [ReuseHistogram() for _ in range(NUM_CLASSES)]  # what each class taught
        self._observations = 0  # reuses and evictions since the last refresh
        self.learned = False  # the tables hold min_observations: heads compete by score
        self.factors = [1.0] * NUM_CLASSES  # each class's reuse rate relative to the shared one
        # NOTE: block ids are dense (0..n-1), so flat arrays are the cheapest per-block
        # state; the intrusive links cannot say which list a block is in.
        self._where = bytearray([_HEAD]) * size  # block id -> class, or _HEAD
        self._freed_at = array("d", bytes(8 * size))  # block id -> clock when it was queued
        self._seq = array("q", bytes(8 * size))  # block id -> freeing order, for LRU ties
        self._next = itertools.count()  # the next freeing order

    # ------------------------------------------------------------- protocol

    def __len__(self) -> int:
        return self.head.num_free + sum(q.num_free for q in self.classes)

    def __iter__(self) -> Iterator[KVBlock]:
        yield from self.head
        for queue in self.classes:
            yield from queue

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def append(self, block: KVBlock) -> None:
        cls = min(block.hits, NUM_CLASSES - 1)
        self.classes[cls].append(block)  # raises if already queued, before any state changes
        i = block.block_id
        if i >= len(self._where):
            self._grow(i + 1)
        self._where[i] = cls
        self._freed_at[i] = self._clock()
        self._seq[i] = next(self._next)

    def appendleft(self, block: KVBlock) -> None:
        self.head.appendleft(block)
        if block.block_id >= len(self._where):
            self._grow(block.block_id + 1)
        self._where[block.block_id] = _HEAD

    def remove(self, block: KVBlock) -> None:
        i = block.block_id
        cls = self._where[i] if i < len(self._where) else _HEAD
        if cls == _HEAD:
            self.head.remove(block)
            return
        self.classes[cls].remove(block)
        if block.block_hash is not None:  # a block emptied by `clear` teaches nothing
            self._stats[cls].record(self._clock() - self._freed_at[i], reused=True)
            self._observed()

    def popleft_n(self, n: int) -> list[KVBlock]:
        if n > len(self):
            raise IndexError(f"asked for {n} free blocks, have {len(self)}")
        out = self.head.popleft_n(min(n, self.head.num_free))
        if len(out) == n:
            return out
        now = self._clock()
        classes, freed_at, where = self.classes, self._freed_at, self._where
        keys = [self._key(c, now) for c in range(NUM_CLASSES)]
        while len(out) < n:
            cls = keys.index(min(keys))
            queue = classes[cls]
            block = queue.popleft()
            out.append(block)
            refreshed = False
            if block.block_hash is not None:  # else emptied by `clear` while queued
                sat = now - freed_at[block.block_id]
                self._stats[where[block.block_id]].record(sat, reused=False)
                age = self.eviction_age
                self.eviction_age = sat if age == 0.0 else age + self.AGE_WEIGHT * (sat - age)
                refreshed = self._observed()
            if refreshed:  # new tables: rescore every head
                keys = [self._key(c, now) for c in range(NUM_CLASSES)]
            else:
                keys[cls] = self._key(cls, now)
        return out

    # ------------------------------------------------------------ learning

    def score(self, cls: int, age: float) -> float:
        """Estimated P(a block of class ``cls`` idle for ``age`` s is hit within the horizon)."""
        return self._stats[cls].score(age, self.horizon_share * self.eviction_age)

    def _key(self, cls: int, now: float) -> tuple[float, int]:
        """The class head's eviction key, lowest first: (score, freeing order); (inf, 0)
        for an empty class.

        NOTE: until the tables hold ``min_observations`` every score is 0, so the
        oldest head goes: plain LRU order.
        """
        block = self.classes[cls].peekleft()
        if block is None:
            return (math.inf, 0)
        i = block.block_id
        if not self.learned:
            return (0.0, self._seq[i])
        horizon = self.horizon_share * self.eviction_age
        return (self._stats[cls].score(now - self._freed_at[i], horizon), self._seq[i])

    def _observed(self) -> bool:
        """Count one observation; every so many, decay and rebuild. True if it did."""
        self._observations += 1
        if self._observations < self._refresh_every:
            return False
        self._observations = 0
        now = self._clock()
        stats = self._stats
        exposure = []
        for c, hist in enumerate(stats):
            hist.decay(self.decay_factor)
            exposure.append(hist.exposure(*self._alive(self.classes[c], now)))
        self.learned = sum(h.weight for h in stats) >= self.min_observations
        # NOTE: proportional hazards: one reuse rate by age, shared by the classes,
        # times one factor per class. The shared rate pools every class's data, so
        # it reaches the oldest ages any class is kept to; a class's own data only
        # has to fix its factor, and PRIOR_REUSES pseudo-observations at factor 1
        # keep a class with little data near the shared rate. Two rounds of
        # alternating fits are plenty.
        hits = [sum(col) for col in zip(*(h.reused for h in stats), strict=True)]
        prior = self.PRIOR_REUSES
        factor = [1.0] * NUM_CLASSES
        base = [0.0] * NUM_BUCKETS
        for _ in range(2):
            weighted = [
                sum(f * x[b] for f, x in zip(factor, exposure, strict=True))
                for b in range(NUM_BUCKETS)
            ]
            base = decreasing_rates(hits, weighted)
            for c, hist in enumerate(stats):
                expected = sum(r * x for r, x in zip(base, exposure[c], strict=True))
                factor[c] = (sum(hist.reused) + prior) / (expected + prior)
        for c in range(1, NUM_CLASSES):
            # NOTE: a block hit more often never ranks below one hit less at the same
            # age. A chain's prefix has at least its tail's hits, so this keeps tails
            # going first; evicting a prefix would strand its tail.
            factor[c] = max(factor[c], factor[c - 1])
        self.factors = factor
        for c, hist in enumerate(stats):
            hist.set_rates([factor[c] * r for r in base])
        return True

    def _alive(self, queue: FreeBlockQueue, now: float) -> tuple[list[int], list[float]]:
        """The queue's blocks by age bucket: how many, and their seconds into the bucket.

        One walk, oldest first, so the bucket only ever steps down: no logarithms.
        """
        alive = [0] * NUM_BUCKETS
        partial = [0.0] * NUM_BUCKETS
        freed_at = self._freed_at
        b = NUM_BUCKETS - 1
        for block in queue:
            age = now - freed_at[block.block_id]
            while b and age < _EDGES[b]:
                b -= 1
            alive[b] += 1
            partial[b] += age - _EDGES[b]
        return alive, partial

    def _grow(self, size: int) -> None:
        extra = size - len(self._where)
        self._where.extend(bytes([_HEAD]) * extra)
        self._freed_at.extend([0.0] * extra)
        self._seq.extend([0] * extra)
