"""Routing policies: prefix affinity, load, queue bounds, ties and determinism."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from cachepoint.kvcore import BlockHash, PrefixIndex, hash_blocks
from cachepoint.routing import (
    POLICIES,
    CacheAwarePolicy,
    LeastLoadedPolicy,
    NoReplicaError,
    PrefixAffinityPolicy,
    ReplicaView,
    RoundRobinPolicy,
    make_policy,
)

BS = 16  # block size of every prompt here


def prompt(session: int, blocks: int) -> list[BlockHash]:
    """Hashes of a session's prompt: a shared system block, then session-private blocks."""
    tokens = list(range(BS)) + [session * 10_000 + i for i in range((blocks - 1) * BS)]
    return hash_blocks(tokens, BS, ("model",))


def view(name: str, held: Sequence[BlockHash] = (), **load: int | bool) -> ReplicaView:
    return ReplicaView(name, PrefixIndex(held), **load)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["cache_aware", "prefix_affinity"])
def test_returning_session_goes_to_the_replica_holding_its_prefix(name: str):
    turn1 = prompt(7, 6)
    turn2 = prompt(7, 9)  # the same session, three blocks longer
    replicas = [view("a", prompt(1, 6)), view("b", turn1), view("c")]
    decision = make_policy(name).choose(turn2, replicas, BS)
    assert decision.replica == "b"
    assert decision.matched_blocks == 6
    assert decision.matched_tokens == 6 * BS
    assert decision.policy == name


@pytest.mark.parametrize("name", ["cache_aware", "prefix_affinity", "least_loaded"])
def test_cold_tenant_goes_to_the_least_loaded(name: str):
    replicas = [
        view("a", prompt(1, 4), queued_prefill_tokens=900),
        view("b", prompt(2, 4), queued_prefill_tokens=300),
        view("c", prompt(3, 4), queued_prefill_tokens=600),
    ]
    cold = prompt(99, 5)  # shares only the system block, which all three hold
    assert make_policy(name).choose(cold, replicas, BS).replica == "b"


def test_overloaded_replica_loses_to_a_colder_one():
    session = prompt(5, 8)
    holder = view("hot", session, queued_prefill_tokens=50_000, waiting=12)
    cold = view("cold", queued_prefill_tokens=0)
    decision = CacheAwarePolicy(load_weight=0.5).choose(prompt(5, 9), [holder, cold], BS)
    assert decision.replica == "cold"
    scores = {c.replica: c.score for c in decision.candidates}
    assert scores["hot"] == 8 * BS - 0.5 * 50_000
    assert scores["cold"] == 0.0


def test_prefix_affinity_ignores_load_below_its_slack_and_not_above():
    session = prompt(5, 8)
    longer = prompt(5, 10)
    policy = PrefixAffinityPolicy(load_slack=4096)
    busy = [view("holder", session, queued_prefill_tokens=4000), view("idle")]
    assert policy.choose(longer, busy, BS).replica == "holder"
    swamped = [view("holder", session, queued_prefill_tokens=40_000), view("idle")]
    assert policy.choose(longer, swamped, BS).replica == "idle"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_replica_at_its_queue_bound_is_skipped(name: str):
    session = prompt(3, 6)
    full = view("full", session, waiting=4, max_waiting=4)
    other = view("other", waiting=3, max_waiting=4)
    decision = make_policy(name).choose(session, [full, other], BS)
    assert decision.replica == "other"
    assert [c.replica for c in decision.candidates] == ["other"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_routable_replica_raises_a_clear_error(name: str):
    policy = make_policy(name)
    with pytest.raises(NoReplicaError, match="no replicas are known"):
        policy.choose(prompt(1, 2), [], BS)
    with pytest.raises(NoReplicaError, match="none of 2 replicas is live"):
        policy.choose(prompt(1, 2), [view("a", live=False), view("b", live=False)], BS)
    with pytest.raises(NoReplicaError, match="queue bound"):
        policy.choose(prompt(1, 2), [view("a", waiting=1, max_waiting=1)], BS)


def test_dead_replica_is_never_chosen_even_when_it_holds_the_prefix():
    session = prompt(4, 6)
    decision = CacheAwarePolicy().choose(
        session, [view("dead", session, live=False), view("up")], BS
    )
    assert decision.replica == "up"


def test_last_token_block_is_not_counted_as_a_saving():
    session = prompt(2, 4)  # a 64-token prompt, every block held
    decision = CacheAwarePolicy().choose(session, [view("a", session)], BS, num_tokens=4 * BS)
    assert decision.matched_blocks == 3  # the block holding the last token is recomputed
    assert CacheAwarePolicy().choose(session, [view("a", session)], BS).matched_blocks == 4


def _choices(policy_name: str, seed: int, n: int = 60) -> list[str]:
    policy = make_policy(policy_name, seed=seed)
    idle = [view(f"r{i}", prompt(0, 1)) for i in range(5)]
    return [policy.choose(prompt(100 + k, 3), idle, BS).replica for k in range(n)]


@pytest.mark.parametrize("name", ["cache_aware", "prefix_affinity", "least_loaded"])
def test_same_seed_same_choices(name: str):
    first = _choices(name, seed=11)
    assert first == _choices(name, seed=11)
    assert set(first) == {f"r{i}" for i in range(5)}  # ties are spread, not piled on r0
    assert first != _choices(name, seed=12)


def test_round_robin_cycles_and_skips_unroutable():
    policy = RoundRobinPolicy()
    replicas = [view("a"), view("b", live=False), view("c")]
    picks = [policy.choose(prompt(1, 2), replicas, BS).replica for _ in range(4)]
    assert picks == ["a", "c", "a", "c"]


def test_least_loaded_breaks_token_ties_by_waiting_then_running():
    replicas = [
        view("a", queued_prefill_tokens=100, waiting=2, running=1),
        view("b", queued_prefill_tokens=100, waiting=1, running=5),
        view("c", queued_prefill_tokens=100, waiting=1, running=2),
    ]
    assert LeastLoadedPolicy().choose(prompt(1, 2), replicas, BS).replica == "c"


def test_make_policy_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        make_policy("nope")
    with pytest.raises(ValueError, match="bad options for routing policy 'round_robin'"):
        make_policy("round_robin", load_weight=1.0)
    with pytest.raises(ValueError, match="non-negative"):
        make_policy("cache_aware", load_weight=-1)
    assert set(POLICIES) == {"cache_aware", "prefix_affinity", "round_robin", "least_loaded"}


def test_decision_carries_span_attributes_for_the_route_span():
    session = prompt(9, 5)
    decision = CacheAwarePolicy().choose(session, [view("a", session), view("b")], BS)
    attrs = decision.span_attributes()
    assert attrs["cachepoint.route.replica"] == "a"
    assert attrs["cachepoint.route.policy"] == "cache_aware"
    assert attrs["cachepoint.route.matched_tokens"] == 5 * BS
    candidates = attrs["cachepoint.route.candidates"]
    assert isinstance(candidates, list)
    assert candidates[0].startswith("a:matched=80,load=0,score=80")
    assert len(candidates) == 2


def test_prefix_affinity_spreads_cold_sessions_to_replicas_without_the_shared_prompt():
    system = prompt(0, 3)  # a 3-block system prompt every session starts with
    warm = [view(f"warm{i}", system, running=1) for i in range(3)]
    fresh = view("fresh")  # a replica that has not seen the system prompt yet
    cold = system + prompt(42, 5)[3:]
    # Most of the fleet holds only the shared prompt: no session affinity, so load decides.
    assert make_policy("prefix_affinity").choose(cold, [*warm, fresh], BS).replica == "fresh"
    # Plain cache-aware scoring prefers the holders and would leave "fresh" idle.
    assert make_policy("cache_aware").choose(cold, [*warm, fresh], BS).replica.startswith("warm")
