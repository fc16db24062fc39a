"""Routing policies as tiny strategy classes. Pure: no I/O, no clock, no asyncio.

Every policy scores the *routable* replicas (live, below their queue bound) and
returns a `RouteDecision` carrying every candidate's score, so the gateway's
`route` span shows why a replica won.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from cachepoint.kvcore import BlockHash
from cachepoint.routing.decision import Candidate, NoReplicaError, RouteDecision
from cachepoint.routing.view import ReplicaView


class RoutingPolicy(Protocol):
    """Chooses a replica for a prompt given as its chained block hashes."""

    @property
    def name(self) -> str: ...

    def choose(
        self,
        block_hashes: Sequence[BlockHash],
        replicas: Sequence[ReplicaView],
        block_size: int,
        *,
        num_tokens: int | None = None,
    ) -> RouteDecision:
        """Pick one of ``replicas``; raise `NoReplicaError` when none is routable.

        ``num_tokens`` (the prompt length) caps the expected hit the way the
        replica does: the block holding the last token is always recomputed.
        """
        ...


def routable(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    """The replicas a policy may choose; raises `NoReplicaError` when there are none."""
    out = [r for r in replicas if r.routable]
    if not out:
        if not replicas:
            raise NoReplicaError("no replicas are known")
        if not any(r.live for r in replicas):
            raise NoReplicaError(f"none of {len(replicas)} replicas is live")
        raise NoReplicaError(f"every live replica of {len(replicas)} is at its queue bound")
    return out


def usable_blocks(
    block_hashes: Sequence[BlockHash], block_size: int, num_tokens: int | None
) -> int:
    """How many leading blocks a replica could hit (never the one holding the last token)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if num_tokens is None:
        return len(block_hashes)
    return min(len(block_hashes), max(num_tokens - 1, 0) // block_size)


def _load_key(view: ReplicaView) -> tuple[int, int, int]:
    return (view.queued_prefill_tokens, view.waiting, view.running)


def _decide(
    policy: str,
    chosen: Candidate,
    candidates: list[Candidate],
) -> RouteDecision:
    return RouteDecision(
        replica=chosen.replica,
        policy=policy,
        matched_blocks=chosen.matched_blocks,
        matched_tokens=chosen.matched_tokens,
        score=chosen.score,
        candidates=tuple(candidates),
        host_blocks=chosen.host_blocks,
        disk_blocks=chosen.disk_blocks,
        routed_blocks=chosen.routed_blocks,
    )


def _no_penalty(load: int) -> float:
    return 0.0


def _score_all(
    block_hashes: Sequence[BlockHash],
    views: list[ReplicaView],
    block_size: int,
    num_tokens: int | None,
    penalty: Callable[[int], float] = _no_penalty,
) -> list[Candidate]:
    """Saved tokens minus ``penalty(queued prefill tokens)`` for every view, in order.

    A device hit saves its tokens; a host or disk hit saves them times the replica's
    `TierValue` for that tier (its transfer time against recompute). Blocks routed to
    the replica and not yet in its events (`RoutedBlocks`), right after what it holds,
    save their tokens as device hits: the replica will have them, or be computing them
    and make this request wait for them, by the time it runs.
    """
    hashes = block_hashes[: usable_blocks(block_hashes, block_size, num_tokens)]
    out = []
    for view in views:
        index = view.index
        load = view.queued_prefill_tokens
        if hashes and index.has_lower:
            m = index.match_tiers(hashes)
            value = view.tier_value
            matched = m.blocks
            saved = block_size * (m.device + value.host * m.host + value.disk * m.disk)
            host, disk = m.host, m.disk
        else:
            # NOTE: the device-only path computes exactly what it did before tiers.
            matched = index.match(hashes) if hashes else 0
            saved = matched * block_size
            host = disk = 0
        routed = view.routed.run(hashes, matched) if view.routed else 0
        if routed:
            matched += routed
            saved += routed * block_size
        out.append(
            Candidate(
                view.name,
                matched,
                matched * block_size,
                load,
                saved - penalty(load),
                saved,
                host,
                disk,
                routed,
            )
        )
    return out


def _best_near(cands: list[Candidate], tolerance: float, rng: random.Random) -> Candidate:
    """The best score; within ``tolerance`` of it the least loaded, exact ties sampled."""
    best = max(c.score for c in cands)
    near = [c for c in cands if c.score >= best - tolerance]
    least = min(c.load_tokens for c in near)
    tied = [c for c in near if c.load_tokens == least]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def _least_loaded(
    cands: list[Candidate], views: list[ReplicaView], rng: random.Random
) -> Candidate:
    """Fewest queued prefill tokens, then waiting, then running; exact ties sampled."""
    keys = [_load_key(v) for v in views]
    least = min(keys)
    tied = [c for c, k in zip(cands, keys, strict=True) if k == least]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


@dataclass(slots=True)
class CacheAwarePolicy:
    """Prefill tokens saved minus ``load_weight`` × queued prefill tokens; the best wins.

    A host or disk hit saves its tokens times the replica's `TierValue` (transfer
    time against recompute), so a device hit beats a lower-tier hit of the same
    length, which beats a miss unless its copy is slower than recompute.

    Candidates within ``tie_tolerance`` tokens of the best score count as equal;
    among those the least loaded wins, and exact load ties are sampled with a
    seeded generator, so a burst of cold tenants spreads over idle replicas
    instead of piling onto the first one listed.
    """

    # NOTE: 0.1, not 0.5: on Mooncake's conversation trace (bench/sim_baseline.py) it
    # reaches 89.0 % / 71.5 % of the bound at 1 % / 0.5 % per replica against 86.5 % /
    # 68.9 % at 0.5, and beats every load-penalized-LRU baseline; the price is a TTFT
    # p90 about 5 % higher at the trace's rate and 16 % at four times it (docs/sim.md).
    load_weight: float = 0.1  # tokens of score lost per queued prefill token
    tie_tolerance: float | None = None  # score gap counted as a tie; None: one block
    seed: int | None = 0  # seeds the tie-break sampler; None draws from the OS
    name: str = "cache_aware"  # the name `make_policy` knows it by
    _rng: random.Random = field(init=False, repr=False)  # the tie-break sampler

    def __post_init__(self) -> None:
        if self.load_weight < 0:
            raise ValueError("load_weight must be non-negative")
        self._rng = random.Random(self.seed)

    def choose(
        self,
        block_hashes: Sequence[BlockHash],
        replicas: Sequence[ReplicaView],
        block_size: int,
        *,
        num_tokens: int | None = None,
    ) -> RouteDecision:
        views = routable(replicas)
        weight = self.load_weight
        cands = _score_all(block_hashes, views, block_size, num_tokens, lambda q: weight * q)
        tol = float(block_size) if self.tie_tolerance is None else self.tie_tolerance
        return _decide(self.name, _best_near(cands, tol, self._rng), cands)


@dataclass(slots=True)
class RoundRobinPolicy:
    """Each routable replica in turn, whatever it holds: the baseline with no cache awareness."""

    name: str = "round_robin"  # the name `make_policy` knows it by
    _next: int = field(default=0, init=False, repr=False)  # position of the next pick

    def choose(
        self,
        block_hashes: Sequence[BlockHash],
        replicas: Sequence[ReplicaView],
        block_size: int,
        *,
        num_tokens: int | None = None,
    ) -> RouteDecision:
        views = routable(replicas)
        cands = _score_all(block_hashes, views, block_size, num_tokens)
        chosen = cands[self._next % len(cands)]
        self._next += 1
        return _decide(self.name, chosen, [_zero_score(c) for c in cands])


@dataclass(slots=True)
class LeastLoadedPolicy:
    """Fewest queued prefill tokens (then waiting, then running); ties sampled with a seed."""

    seed: int | None = 0  # seeds the tie-break sampler; None draws from the OS
    name: str = "least_loaded"  # the name `make_policy` knows it by
    _rng: random.Random = field(init=False, repr=False)  # the tie-break sampler

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def choose(
        self,
        block_hashes: Sequence[BlockHash],
        replicas: Sequence[ReplicaView],
        block_size: int,
        *,
        num_tokens: int | None = None,
    ) -> RouteDecision:
        views = routable(replicas)
        cands = _score_all(block_hashes, views, block_size, num_tokens)
        chosen = _least_loaded(cands, views, self._rng)
        scored = [replace(c, score=float(-c.load_tokens)) for c in cands]
        return _decide(self.name, next(c for c in scored if c.replica == chosen.replica), scored)


def _zero_score(c: Candidate) -> Candidate:
    return replace(c, score=0.0)


@dataclass(slots=True)
class PrefixAffinityPolicy:
    """Stay with the replica holding the prefix until its queue costs more than it saves.

    score = saved tokens − load_weight × max(0, queued prefill tokens − load_slack)

    NOTE: a returning session moved off its replica takes its chain with it: the
    prefix is computed again and stored on a second pool, and the first copy
    ages out there, taking pool space from other sessions. On Mooncake's
    conversation trace `CacheAwarePolicy`'s penalty on any queued work moves
    enough sessions to cost 1–5 points of hit ratio (more at higher load) for a
    few milliseconds of median TTFT (docs/sim.md). Here queued work below
    ``load_slack`` (32k tokens: about 1.5 s of prefill for an 8B model on an H100)
    costs nothing; beyond it each queued token costs a saved token, the
    TTFT-greedy trade. Ties go as in `CacheAwarePolicy`.
    """

    load_weight: float = 1.0  # score lost per queued token beyond the slack
    load_slack: int = 32768  # queued prefill tokens that cost nothing
    tie_tolerance: float | None = None  # score gap counted as a tie; None: one block
    seed: int | None = 0  # seeds the tie-break sampler; None draws from the OS
    name: str = "prefix_affinity"  # the name `make_policy` knows it by
    _rng: random.Random = field(init=False, repr=False)  # the tie-break sampler

    def __post_init__(self) -> None:
        if self.load_weight < 0 or self.load_slack < 0:
            raise ValueError("load_weight and load_slack must be non-negative")
        self._rng = random.Random(self.seed)

    def choose(
        self,
        block_hashes: Sequence[BlockHash],
        replicas: Sequence[ReplicaView],
        block_size: int,
        *,
        num_tokens: int | None = None,
    ) -> RouteDecision:
        views = routable(replicas)
        weight, slack = self.load_weight, self.load_slack
        cands = _score_all(
            block_hashes, views, block_size, num_tokens, lambda q: weight * max(0, q - slack)
        )
        # NOTE: a prefix held by most of the fleet (a popular system prompt) is no
        # reason to prefer a replica: every holder is as good, and preferring them
        # starves replicas that do not hold it yet, leaving their pools idle. Such a
        # request is cold; it goes to the least loaded replica, ties sampled.
        # NOTE: by priced saving, not blocks: a prefix most of the fleet holds only
        # in host memory is still a reason to prefer the one replica holding it on
        # the device. On device-only replicas the saving is blocks × block_size, so
        # this is the same rule as counting blocks.
        common = sorted(c.saved_tokens for c in cands)[(len(cands) - 1) // 2]
        if max(c.saved_tokens for c in cands) <= common:
            return _decide(self.name, _least_loaded(cands, views, self._rng), cands)
        tol = float(block_size) if self.tie_tolerance is None else self.tie_tolerance
        return _decide(self.name, _best_near(cands, tol, self._rng), cands)
