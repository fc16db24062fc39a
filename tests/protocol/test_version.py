"""The protocol version: the gateway sends it, a replica of another version answers 409
naming both (before reading the body), and a caller without the header is taken as
this version."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cachepoint.gateway.errors import ApiError
from cachepoint.gateway.fleet.upstream import ReplicaClient, ReplicaSession
from cachepoint.protocol import (
    PROTOCOL_VERSION,
    VERSION_HEADER,
    VERSION_MISMATCH_STATUS,
    GenerateRequest,
    version_mismatch,
)
from cachepoint.replica.api.errors import install_error_handlers
from cachepoint.replica.api.routes import generate
from cachepoint.replica.echo import create_echo_app

OTHER = str(PROTOCOL_VERSION + 1)


def test_the_same_version_or_none_is_accepted() -> None:
    assert version_mismatch(None) is None
    assert version_mismatch(str(PROTOCOL_VERSION)) is None
    assert version_mismatch(f" {PROTOCOL_VERSION} ") is None


def test_another_version_is_named_with_this_one() -> None:
    message = version_mismatch(OTHER)
    assert message is not None
    assert f"'{OTHER}'" in message and f"speaks {PROTOCOL_VERSION}" in message


def _replica_route() -> FastAPI:
    """The replica's real generate route, over a core that must never be reached."""
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(generate.router)
    app.state.scheduler = SimpleNamespace(settings=SimpleNamespace(internal_token=None))
    return app


@pytest.mark.parametrize("app", [_replica_route, create_echo_app], ids=["replica", "echo"])
def test_a_replica_answers_another_version_409_before_the_body(app) -> None:
    client = TestClient(app())
    # NOTE: a body that would not validate: the version is what is answered.
    r = client.post("/v1/generate", json={"token_ids": []}, headers={VERSION_HEADER: OTHER})
    assert r.status_code == VERSION_MISMATCH_STATUS == 409
    body = r.json()
    assert body["type"] == "error"
    assert f"'{OTHER}'" in body["error"]["message"]
    assert f"speaks {PROTOCOL_VERSION}" in body["error"]["message"]


@pytest.mark.parametrize("header", [None, str(PROTOCOL_VERSION)], ids=["absent", "current"])
def test_a_replica_reads_the_body_of_an_old_or_current_caller(header: str | None) -> None:
    client = TestClient(_replica_route())
    headers = {VERSION_HEADER: header} if header else {}
    r = client.post("/v1/generate", json={"token_ids": []}, headers=headers)
    assert r.status_code == 400 and "token_ids" in r.json()["error"]["message"]


def test_the_gateway_sends_its_version_and_reports_a_mismatch_clearly() -> None:
    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.get(VERSION_HEADER))
        message = version_mismatch(OTHER)  # as a replica of another version answers
        body = {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
        return web.json_response(body, status=VERSION_MISMATCH_STATUS)

    async def call() -> None:
        app = web.Application()
        app.router.add_post("/v1/generate", answer)
        http = ReplicaSession()
        async with TestServer(app) as server:
            replica = ReplicaClient("r0", str(server.make_url("/")), http)
            try:
                async with replica.stream(GenerateRequest(token_ids=[1])):
                    pass
            finally:
                await http.aclose()

    with pytest.raises(ApiError) as info:
        asyncio.run(call())
    assert seen == [str(PROTOCOL_VERSION)]
    assert info.value.status == 500 and info.value.kind == "api_error"
    assert "protocol version mismatch" in info.value.message
