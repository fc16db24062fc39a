"""The embedded stack's event plane is authenticated: fresh
secrets under the state folder, owner-only; NATS admits no anonymous client; children
get their credentials in the environment, never on the command line."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
from pathlib import Path

import httpx
import nats
import pytest

from cachepoint.embedded.credentials import NATS_CONF, SECRETS_JSON, StackCredentials
from cachepoint.embedded.stack import nats_binary


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_credentials_are_fresh_private_and_valid_for_nats(tmp_path):
    a = StackCredentials.generate(["replica-0", "replica-1"])
    b = StackCredentials.generate(["replica-0", "replica-1"])
    assert a.nats["gateway"] != b.nats["gateway"] and a.internal_token != b.internal_token
    assert len(set(a.nats.values()) | {a.internal_token}) == 4  # no two alike
    (tmp_path / SECRETS_JSON).write_text("old")
    (tmp_path / SECRETS_JSON).chmod(0o644)
    conf = a.write(tmp_path)
    assert _mode(conf) == 0o600 and _mode(tmp_path / SECRETS_JSON) == 0o600
    saved = json.loads((tmp_path / SECRETS_JSON).read_text())
    assert saved == {"nats": a.nats, "internal_token": a.internal_token}
    check = subprocess.run([nats_binary(), "-t", "-c", str(conf)], capture_output=True)
    assert check.returncode == 0, check.stderr
    assert a.env_for("replica-1") == {
        "CACHEPOINT_NATS_USER": "replica-1",
        "CACHEPOINT_NATS_PASSWORD": a.nats["replica-1"],
        "CACHEPOINT_INTERNAL_TOKEN": a.internal_token,
    }
    assert a.env_for("gateway")["CACHEPOINT_NATS_USER"] == "gateway"
    assert a.env_for("nats") == {}


@pytest.mark.slow
def test_stack_runs_with_nats_auth_and_no_secret_on_a_command_line(default_stack):
    stack = default_stack
    creds = stack.credentials
    assert creds is not None
    secrets = [*creds.nats.values(), creds.internal_token]
    state = stack.state_dir
    assert _mode(state / NATS_CONF) == 0o600 and _mode(state / SECRETS_JSON) == 0o600
    for child in stack.children:
        cmdline = Path(f"/proc/{child.proc.pid}/cmdline").read_bytes().decode()
        assert not [s for s in secrets if s in cmdline], f"{child.name} has a secret in argv"
    environ = Path(f"/proc/{stack.children[1].proc.pid}/environ").read_bytes()
    assert b"\0CACHEPOINT_NATS_USER=replica-0\0" in environ

    async def anonymous() -> None:
        await nats.connect(stack.nats_url, allow_reconnect=False, connect_timeout=2)

    with pytest.raises(Exception, match=r"(?i)authorization violation"):
        asyncio.run(anonymous())
    # start() returned, so the gateway saw the replica's heartbeat; a call goes through.
    r = httpx.post(
        f"{stack.base_url}/v1/messages",
        headers={"x-api-key": stack.keys["api_key"]},
        json={
            "model": "cachepoint-tiny",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.headers["cachepoint-replica"] == "replica-0"
