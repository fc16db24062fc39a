"""The shared NATS users Secret under concurrent writers (one handler per CacheReplica).

The apply functions run against an in-memory API that behaves like the real one for
what matters here: resourceVersion bumps on every write, and a JSON patch whose `test`
fails is refused with 422.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import pytest
from kubernetes.client.exceptions import ApiException

from cachepoint.operator import credentials, kube
from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.nats_auth import decode_secret

CONFIG = OperatorConfig(nats_users_secret="users", release_namespace="rel")


class FakeApi:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.version = 0

    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get((namespace, name)))

    def create_secret(self, secret: dict[str, Any]) -> bool:
        key = (secret["metadata"]["namespace"], secret["metadata"]["name"])
        if key in self.objects:
            return False
        self.version += 1
        obj = copy.deepcopy(secret)
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.objects[key] = obj
        return True

    def patch_secret(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        try:
            new = jsonpatch.apply_patch(self.objects[(namespace, name)], ops)
        except jsonpatch.JsonPatchTestFailed:
            raise ApiException(status=422, reason="Invalid") from None
        self.version += 1
        new["metadata"]["resourceVersion"] = str(self.version)
        self.objects[(namespace, name)] = new


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    fake = FakeApi()
    for name in ("get_secret", "create_secret", "patch_secret"):
        monkeypatch.setattr(kube, name, getattr(fake, name))
    return fake


def record(api: FakeApi) -> dict[str, Any]:
    data = decode_secret(api.objects[("rel", "users")])
    return dict(json.loads(data["members.json"]))


def test_a_write_that_lost_the_race_merges_instead_of_overwriting(
    api: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert credentials.sync_nats_users(CONFIG, "ns", "a", {"a-0": "a" * 24})
    raced = []

    def patch_after_another_writer(namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        if not raced:
            # Between our read and our write, another CacheReplica's handler adds its users.
            raced.append(True)
            credentials.sync_nats_users(CONFIG, "ns", "b", {"b-0": "b" * 24})
        api.patch_secret(namespace, name, ops)

    monkeypatch.setattr(kube, "patch_secret", patch_after_another_writer)
    assert credentials.sync_nats_users(CONFIG, "ns", "c", {"c-0": "c" * 24})
    assert set(record(api)) == {"ns/a", "ns/b", "ns/c"}  # nobody's users were lost
    conf = decode_secret(api.objects[("rel", "users")])["users.conf"]
    assert all(f'"ns_{x}-0"' in conf for x in "abc")


def test_removing_and_rewriting_are_idempotent(api: FakeApi) -> None:
    assert credentials.sync_nats_users(CONFIG, "ns", "a", {"a-0": "a" * 24})
    version = api.version
    assert not credentials.sync_nats_users(CONFIG, "ns", "a", {"a-0": "a" * 24})
    assert api.version == version  # nothing written when nothing changed
    assert credentials.sync_nats_users(CONFIG, "ns", "a", None)
    assert record(api) == {}
    assert not credentials.sync_nats_users(CONFIG, "ns", "a", None)
    no_users = OperatorConfig()
    assert not credentials.sync_nats_users(no_users, "ns", "x", {"x-0": "x" * 24})
