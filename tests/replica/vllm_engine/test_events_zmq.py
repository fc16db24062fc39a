"""vLLM's KV events over ZMQ: vLLM's own publisher (``ZmqEventPublisher`` with its replay
buffer), our `subscribe`, `_replay` and `EventGap`, and the scheduler's resync.

The ZMQ side needs vLLM, so it runs in .venv-vllm (zmq_events_script.py, one process
for every scenario: importing vLLM takes seconds); this module checks what it
recorded against kvcore's own hashing, computed here in the main venv.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cachepoint.kvcore import hash_blocks

from ...conftest import VLLM_BIN

pytestmark = pytest.mark.slow  # vLLM's import alone takes most of ten seconds

SCRIPT = Path(__file__).with_name("zmq_events_script.py")
B = 4  # as in the script
KEYS = ("model:m", "org:zmq")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    python = VLLM_BIN / "python"
    if not python.exists():
        pytest.fail("no .venv-vllm: run `make vllm` (make test does) for the vLLM tests")
    out = tmp_path_factory.mktemp("zmq") / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEPOINT_")}
    result = subprocess.run(
        [str(python), str(SCRIPT), str(out)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env | {"PYTHONSAFEPATH": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


def ours(batch: dict[str, Any]) -> list[bytes]:
    """A stored batch's blocks as the gateway names them."""
    return hash_blocks(batch["tokens"], B, KEYS)


def labels(delivered: list[list[list[Any]]]) -> list[int]:
    """Each delivered batch's first token: the script's number for the batch."""
    return [batch[0][1] for batch in delivered]


def cached(scenario: dict[str, Any]) -> set[bytes]:
    return {bytes.fromhex(h) for h in scenario["cached"]}


def test_batches_arrive_in_order_and_land_in_kvcore_hash_space(run: dict[str, Any]) -> None:
    r = run["in_order"]
    assert r["error"] is None
    published = r["published"]
    n = len(published)
    # Probes until the subscription was seen to land, then 31 batches straight from the
    # PUB socket: no gap, so no replay.
    assert n == r["probes"] + 31 and r["warnings"] == []
    assert labels(r["delivered"]) == [b["label"] for b in published] == list(range(n))
    assert r["delivered"][-1] == [["BlockStored", n - 1], ["BlockRemoved", None]]
    # The last batch extends an earlier batch's chain and evicts another's last block:
    # both name blocks stored by earlier batches, so they mean this only in order.
    last = published[-1]
    expected = {h for b in published[:-1] for h in ours(b)}
    expected.discard(ours(published[last["removed"]])[-1])
    parent = ours(published[last["parent"]])[-1]
    child = hash_blocks(last["tokens"], B, KEYS, parent=parent)
    assert len(child) == 1
    assert cached(r) == expected | set(child)


def test_a_late_subscriber_gets_the_first_batches_replayed(run: dict[str, Any]) -> None:
    r = run["late_joiner"]
    assert r["error"] is None
    published = r["published"]
    # Batches 0..4 were sent before the subscriber existed: only the replay socket had
    # them. One replay, from vLLM's first batch on.
    assert len(r["warnings"]) == 1
    m = re.fullmatch(r"vLLM KV events 0\.\.(\d+) missed; replaying", r["warnings"][0])
    assert m is not None and int(m[1]) >= 4
    # Each batch once (replayed or live), in order; nothing after the last one.
    assert labels(r["delivered"]) == list(range(len(published)))
    assert len(published) >= 6
    assert cached(r) == {h for b in published for h in ours(b)}


@pytest.mark.parametrize(
    ("scenario", "why"),
    [
        ("lost_from_buffer", "vLLM's replay buffer lacks some"),
        ("lost_no_replay", "no replay endpoint"),
    ],
)
def test_a_gap_vllm_cannot_replay_is_an_event_gap(
    run: dict[str, Any], scenario: str, why: str
) -> None:
    r = run[scenario]
    # Six batches went out before the subscriber came, and the buffer keeps three: its
    # first batch ends `subscribe` with EventGap, and nothing at all reaches the mirror
    # (not the three vLLM could still replay, which would leave a hole behind them).
    assert r["error"] is not None
    m = re.fullmatch(r"EventGap: batches 0\.\.(\d+) lost(.*)", r["error"])
    assert m is not None and int(m[1]) >= 5, r["error"]
    assert why in m[2]
    assert r["delivered"] == [] and r["cached"] == []


def test_an_event_gap_resyncs_the_scheduler_once_and_its_mirror_follows_again(
    run: dict[str, Any],
) -> None:
    r = run["resync"]
    # One EventGap, one resync (a new epoch); the subscriber after it runs on.
    assert r["epochs"] == 2
    assert len(r["resync_warnings"]) == 1
    gap = re.search(r"batches 0\.\.(\d+) lost", r["resync_warnings"][0])
    assert gap is not None
    assert r["alive"] and r["events_failed"] is None
    # The mirror started over: it holds a run of the batches published after the resync,
    # up to the last, and nothing from before the gap.
    published = r["published"]
    have = cached(r)
    assert have
    first = next(b["label"] for b in published if set(ours(b)) <= have)
    assert first > int(gap[1]) + 1
    assert have == {h for b in published[first:] for h in ours(b)}
