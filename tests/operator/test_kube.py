"""The operator's login: credentials from the environment as it is when kopf logs in."""

from __future__ import annotations

from pathlib import Path

import kubernetes
import pytest
import yaml

from cachepoint.operator import kube


def test_kubeconfig_is_read_at_login_not_at_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    path = tmp_path / "config"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://10.9.8.7:6443"}}],
                "users": [{"name": "u", "user": {"token": "abc123"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(path))  # after `kubernetes` was imported
    info = kube.connection_info(kube.configure())
    assert info.server == "https://10.9.8.7:6443"
    assert (info.scheme, info.token) == ("Bearer", "abc123")
    assert kubernetes.client.Configuration.get_default_copy().host == "https://10.9.8.7:6443"


def test_a_bare_token_has_no_scheme() -> None:
    config = kubernetes.client.Configuration(host="https://k8s:443")
    config.api_key["authorization"] = "tok"
    info = kube.connection_info(config)
    assert (info.server, info.scheme, info.token) == ("https://k8s:443", None, "tok")
