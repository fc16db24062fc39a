"""Credentials that survive Argo CD syncs and uninstall + reinstall.

Generated Secrets carry helm.sh/resource-policy: keep; postgresql.existingSecret replaces
the database Secret; secrets.generate=false makes the chart fail clearly instead of
rendering new random passwords where lookup cannot see the cluster.
"""

from __future__ import annotations

import pytest

from .conftest import RELEASE, render
from .test_chart import env, objects, one

FULLNAME = f"{RELEASE}-cachepoint"
KEEP = "helm.sh/resource-policy"


def test_generated_secrets_are_kept_on_uninstall(helm: str) -> None:
    secrets = objects(render(helm, "default"), "Secret")
    for name in (f"{FULLNAME}-gateway-db", f"{FULLNAME}-auth"):
        assert secrets[name]["metadata"]["annotations"][KEEP] == "keep", name


def test_an_external_url_is_not_generated_so_not_kept(helm: str) -> None:
    docs = render(helm, "external-postgres-url-values")
    secret = one(docs, "Secret", f"{FULLNAME}-gateway-db")
    assert KEEP not in secret["metadata"].get("annotations", {})


def test_existing_database_secret_feeds_postgresql_and_the_gateway(helm: str) -> None:
    docs = render(helm, "default", "--set", "postgresql.existingSecret=ledger-db")
    assert f"{FULLNAME}-gateway-db" not in objects(docs, "Secret")
    pg = one(docs, "StatefulSet", f"{FULLNAME}-postgresql")["spec"]["template"]["spec"]
    container = pg["containers"][0]
    assert "envFrom" not in container
    pg_env = env(container)
    assert pg_env["POSTGRES_PASSWORD"] == {
        "secretKeyRef": {"name": "ledger-db", "key": "POSTGRES_PASSWORD"}
    }
    assert (pg_env["POSTGRES_USER"], pg_env["POSTGRES_DB"]) == ("cachepoint", "cachepoint")
    gateway = one(docs, "Deployment", f"{FULLNAME}-gateway")
    gw_env = env(gateway["spec"]["template"]["spec"]["containers"][0])
    assert gw_env["CACHEPOINT_GATEWAY_DATABASE_URL"] == {
        "secretKeyRef": {"name": "ledger-db", "key": "DATABASE_URL"}
    }


def test_the_generated_database_secret_feeds_postgresql(helm: str) -> None:
    docs = render(helm, "default")
    pg = one(docs, "StatefulSet", f"{FULLNAME}-postgresql")["spec"]["template"]["spec"]
    assert env(pg["containers"][0])["POSTGRES_PASSWORD"] == {
        "secretKeyRef": {"name": f"{FULLNAME}-gateway-db", "key": "POSTGRES_PASSWORD"}
    }


@pytest.mark.parametrize(
    ("values", "names"),
    [
        ([], ["postgresql.existingSecret", "postgresql.password"]),
        (["--set", "postgresql.existingSecret=ledger-db"], ["auth.existingSecret"]),
        (["--set", "postgresql.password=pw"], ["auth.existingSecret"]),
    ],
)
def test_no_generation_fails_with_what_to_set(
    helm: str, values: list[str], names: list[str]
) -> None:
    with pytest.raises(AssertionError) as failed:
        render(helm, "default", "--set", "secrets.generate=false", *values)
    message = str(failed.value)
    assert "secrets.generate is false, so the chart makes no" in message
    for name in names:
        assert name in message


@pytest.mark.parametrize(
    "db", [["--set", "postgresql.existingSecret=ledger-db"], ["--set", "postgresql.password=pw"]]
)
def test_no_generation_renders_the_same_every_time(helm: str, db: list[str]) -> None:
    """What Argo CD needs: nothing random, so a sync never changes a credential."""
    args = ["--set", "secrets.generate=false", "--set", "auth.existingSecret=my-auth", *db]
    first, second = render(helm, "default", *args), render(helm, "default", *args)
    assert first == second
    assert f"{FULLNAME}-auth" not in objects(first, "Secret")


def test_generated_secrets_differ_between_renders_without_a_cluster(helm: str) -> None:
    """Why the policy exists: `helm template` (Argo CD) has no lookup, so it makes new ones."""
    first, second = render(helm, "default"), render(helm, "default")
    name = f"{FULLNAME}-auth"
    assert one(first, "Secret", name)["data"] != one(second, "Secret", name)["data"]
