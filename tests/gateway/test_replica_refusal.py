"""A replica that refuses a request with 503 (draining, shutting down) ran nothing: the
gateway routes the request again, elsewhere, and the client never sees the refusal.
Only when no other replica can take it does the client get it,
as a 529 overloaded_error."""

from __future__ import annotations

import anthropic
import pytest

from cachepoint.gateway.app import create_app
from cachepoint.gateway.fleet.directory import ReplicaDirectory
from cachepoint.gateway.fleet.routing import DirectoryRouter
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.replica.echo import create_echo_app
from cachepoint.replica.model_source import RANDOM_MODEL_NAME

from .test_model_routing import hb

MSGS = [{"role": "user", "content": "hi"}]


def _gateway(serve, seeded_db, replicas: dict[str, tuple[str, int]]) -> tuple[str, str]:
    """A gateway routing over a directory fed by hand: name -> (url, queued tokens)."""
    directory = ReplicaDirectory()
    for name, (url, queued) in replicas.items():
        directory.on_heartbeat(hb(name, RANDOM_MODEL_NAME, queued=queued, url=url))
    router = DirectoryRouter(directory, policy="cache_aware", block_size=16)
    db, keys = seeded_db
    return serve(create_app(GatewaySettings(database_url=db), router)), keys["a"]


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_a_refusing_replica_is_skipped_for_another(serve, seeded_db, stream):
    refusing = serve(create_echo_app("r0", fail_with=503))
    good = serve(create_echo_app("r1", output_tokens=2))
    # r0 looks idle and r1 busy: every request goes to r0 first.
    url, key = _gateway(serve, seeded_db, {"r0": (refusing, 0), "r1": (good, 90_000)})
    c = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    for _ in range(3):
        if stream:
            with c.messages.stream(model=RANDOM_MODEL_NAME, max_tokens=2, messages=MSGS) as s:
                msg = s.get_final_message()
        else:
            msg = c.messages.create(model=RANDOM_MODEL_NAME, max_tokens=2, messages=MSGS)
        assert msg.content[0].text == "xx"


def test_the_refusal_reaches_the_client_when_no_other_replica_can_take_it(serve, seeded_db):
    refusing = serve(create_echo_app("r0", fail_with=503))
    url, key = _gateway(serve, seeded_db, {"r0": (refusing, 0)})
    c = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as info:
        c.messages.create(model=RANDOM_MODEL_NAME, max_tokens=2, messages=MSGS)
    assert info.value.status_code == 529
    assert info.value.body["error"]["type"] == "overloaded_error"
    assert "echo replica configured to answer 503" in info.value.body["error"]["message"]
