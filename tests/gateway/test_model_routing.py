"""Routing by model and around draining replicas: the
router only ever chooses a replica that serves the request's (alias-resolved) model and
is not draining; when none can, the client gets a clear Anthropic error, never a 500."""

from __future__ import annotations

import msgspec
import pytest

from cachepoint.events import schema
from cachepoint.gateway.errors import ApiError
from cachepoint.gateway.fleet.directory import ReplicaDirectory
from cachepoint.gateway.fleet.routing import DirectoryRouter, RouteRequest
from cachepoint.kvcore import KeySpan, ManualClock, hash_blocks

PROMPT = list(range(64))


def hb(
    name: str,
    model: str,
    *,
    queued: int = 0,
    draining: bool = False,
    epoch: int = 1,
    url: str | None = None,
) -> schema.Heartbeat:
    return schema.Heartbeat(
        v=schema.SCHEMA_VERSION,
        name=name,
        url=url or f"http://{name}:8100",
        epoch=epoch,
        model=model,
        block_size=16,
        last_seq=0,
        queued_prefill_tokens=queued,
        running=0,
        waiting=0,
        max_waiting=8,
        blocks_total=64,
        blocks_active=0,
        blocks_cached_free=0,
        blocks_retained=0,
        hit_tokens=0,
        query_tokens=0,
        ts=0.0,
        draining=draining,
    )


def router(*beats: schema.Heartbeat) -> DirectoryRouter:
    d = ReplicaDirectory()
    for beat in beats:
        d.on_heartbeat(beat)
    return DirectoryRouter(d, policy="cache_aware", block_size=16)


def ask(r: DirectoryRouter, model: str, avoid: frozenset[str] = frozenset()) -> str:
    return r.pick(RouteRequest(PROMPT, [(0, ["org:a"])], model, avoid)).replica.name


def test_each_model_goes_only_to_its_own_replicas():
    # The model-a replica is by far the least loaded: load alone would send everything
    # there, model-b's requests included.
    r = router(
        hb("a0", "model-a"), hb("b0", "model-b", queued=90_000), hb("b1", "model-b", queued=50_000)
    )
    assert {ask(r, "model-a") for _ in range(5)} == {"a0"}
    assert {ask(r, "model-b") for _ in range(5)} <= {"b0", "b1"}


def test_a_model_no_replica_serves_is_a_clear_404():
    r = router(hb("a0", "model-a"), hb("b0", "model-b"))
    with pytest.raises(ApiError) as info:
        ask(r, "model-c")
    assert (info.value.status, info.value.kind) == (404, "not_found_error")
    assert "model-c" in info.value.message and "model-a, model-b" in info.value.message


def test_a_draining_heartbeat_takes_the_replica_out_of_routing_at_once():
    r = router(hb("a0", "model-a"), hb("a1", "model-a", queued=90_000))
    assert ask(r, "model-a") == "a0"
    r.directory.on_heartbeat(hb("a0", "model-a", draining=True))
    assert [v.name for v in r.directory.views("model-a")] == ["a1"]
    assert {ask(r, "model-a") for _ in range(5)} == {"a1"}
    # A later heartbeat of the same process cannot undo it; a new process (epoch) can.
    r.directory.on_heartbeat(hb("a0", "model-a"))
    assert ask(r, "model-a") == "a1"
    r.directory.on_heartbeat(hb("a0", "model-a", epoch=2))
    assert ask(r, "model-a") == "a0"


def test_when_every_replica_of_the_model_drains_the_client_gets_a_529():
    r = router(hb("a0", "model-a", draining=True), hb("b0", "model-b"))
    with pytest.raises(ApiError) as info:
        ask(r, "model-a")
    assert (info.value.status, info.value.kind) == (529, "overloaded_error")
    assert "draining" in info.value.message and "a0" in info.value.message


def test_a_retry_avoids_the_replicas_already_tried():
    r = router(hb("a0", "model-a"), hb("a1", "model-a", queued=90_000))
    assert ask(r, "model-a", frozenset({"a0"})) == "a1"
    with pytest.raises(ApiError) as info:
        ask(r, "model-a", frozenset({"a0", "a1"}))
    assert info.value.status == 529


def test_stats_polls_carry_draining_too():
    d = ReplicaDirectory()
    stats = {"epoch": 1, "block_size": 16, "model": "model-a", "queued_prefill_tokens": 0}
    stats |= {"running": 0, "waiting": 0, "max_waiting": 8}
    assert d.on_stats("a0", "http://a0:8100", stats)
    assert [v.name for v in d.views("model-a")] == ["a0"]
    assert d.on_stats("a0", "http://a0:8100", {**stats, "draining": True})
    assert d.views("model-a") == []


def test_a_heartbeat_without_the_draining_field_decodes_as_not_draining():
    """An older replica's heartbeat (no `draining` key) still decodes: rolling upgrade."""
    beat = msgspec.structs.asdict(hb("a0", "model-a"))
    del beat["draining"]
    old = schema.decode(msgspec.msgpack.encode(beat), schema.Heartbeat)
    assert old.draining is False
    new = schema.decode(schema.encode(hb("a0", "model-a", draining=True)), schema.Heartbeat)
    assert new.draining is True


def _pick(r: DirectoryRouter, tokens: list[int]) -> str:
    return r.pick(RouteRequest(tokens, [(0, ["org:a"])], "m")).replica.name


SHARED = list(range(48))  # three blocks of 16 every session of the tenant starts with


def _session(sid: int) -> list[int]:
    return SHARED + [1000 * (sid + 1) + i for i in range(32)]


def test_sessions_that_start_together_follow_the_first_before_any_event():
    """Without the routed blocks, three idle replicas tie and the sessions scatter."""
    r = router(hb("r0", "m"), hb("r1", "m"), hb("r2", "m"))
    first = _pick(r, _session(0))
    assert {_pick(r, _session(s)) for s in range(1, 6)} == {first}


def test_routed_blocks_leave_when_events_name_them_or_the_replica_goes():
    r = router(hb("r0", "m"), hb("r1", "m"))
    d = r.directory
    first = _pick(r, _session(0))
    routed = d.replicas[first].view.routed
    assert len(routed) == 5
    # The replica's events store the shared prefix: the index speaks for it now.
    stored = hash_blocks(SHARED, 16, (KeySpan(0, ("org:a",)),))
    ok = d.on_batch(
        schema.EventBatch(
            schema.SCHEMA_VERSION,
            first,
            1,
            1,
            0.0,
            [schema.Stored([bytes(h) for h in stored], None)],
        )
    )
    assert ok is False and len(routed) == 2
    assert _pick(r, _session(1)) == first  # held now, not routed
    r.report_failure(first)  # a failed call: nothing sent there is expected any more
    assert not routed


def test_routed_blocks_expire_and_a_new_epoch_drops_them():
    clock = ManualClock(0.0)
    d = ReplicaDirectory(clock=clock)
    for name in ("r0", "r1"):
        d.on_heartbeat(hb(name, "m"))
    r = DirectoryRouter(d, policy="cache_aware", block_size=16)
    first = _pick(r, _session(0))
    view = d.replicas[first].view
    clock.advance(view.routed.ttl_s + 1)
    d.on_heartbeat(hb("r0", "m"))
    d.on_heartbeat(hb("r1", "m"))
    _pick(r, list(range(5000, 5040)))  # any routing expires the stale entries first
    assert not any(x in view.routed for x in hash_blocks(SHARED, 16, (KeySpan(0, ("org:a",)),)))
    view.routed.add(hash_blocks(SHARED, 16), now=clock())
    d.on_heartbeat(hb(first, "m", epoch=2))  # restarted: it holds nothing that was sent
    assert not view.routed


def test_while_events_are_down_load_alone_routes_and_nothing_is_recorded():
    d = ReplicaDirectory()
    for name in ("r0", "r1"):
        d.on_heartbeat(hb(name, "m"))
    r = DirectoryRouter(d, policy="cache_aware", block_size=16, nats_up=lambda: False)
    _pick(r, _session(0))
    assert not any(st.view.routed for st in d.replicas.values())
