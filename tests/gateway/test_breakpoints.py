from __future__ import annotations

import pytest

from cachepoint.gateway.contract.breakpoints import (
    SCOPE_BETA,
    ContractError,
    ScopePolicy,
    prefix_digest,
    resolve,
)
from cachepoint.gateway.contract.render import Renderer
from cachepoint.gateway.schemas.messages import MessagesRequest
from cachepoint.tokenizer import ByteTokenizer

R = Renderer(ByteTokenizer())
CC = {"type": "ephemeral"}


def text(t: str, **cc) -> dict:
    return {"type": "text", "text": t, **({"cache_control": cc} if cc else {})}


NO_GLOBAL = ScopePolicy()


def plan(body: dict, *, betas=(), policy=NO_GLOBAL, min_tokens=0, block=4):
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 4} | body)
    rendered = R.render(req)
    return rendered, resolve(
        rendered,
        req.cache_control,
        model="m",
        tenant_key="org:a",
        betas=set(betas),
        cache_key_betas={"context-1m-2025-08-07"},
        policy=policy,
        min_cacheable_tokens=min_tokens,
        block_size=block,
    )


def test_breakpoints_five_markers_is_the_documented_error():
    body = {"messages": [{"role": "user", "content": [text(f"t{i}", **CC) for i in range(5)]}]}
    with pytest.raises(
        ContractError,
        match=r"^A maximum of 4 blocks with cache_control may be provided\. Found 5\.$",
    ):
        plan(body)


def test_breakpoints_automatic_caching_counts_towards_four():
    body = {
        "cache_control": CC,
        "messages": [
            {"role": "user", "content": [text(f"t{i}", **CC) for i in range(4)] + [text("last")]}
        ],
    }
    with pytest.raises(ContractError, match="Found 5"):
        plan(body)
    rendered, p = plan({"cache_control": CC, "messages": [{"role": "user", "content": "hello"}]})
    assert [b.position for b in p.breakpoints] == [rendered.blocks[-1].end]


def test_breakpoints_refused_on_thinking_and_empty_text():
    body = {
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "x", "signature": "s", "cache_control": CC}
                ],
            },
        ]
    }
    with pytest.raises(ContractError, match=r"^messages\.1\.content\.0\.cache_control: .*thinking"):
        plan(body)
    with pytest.raises(
        ContractError, match=r"messages\.0\.content\.0\.cache_control: .*empty text"
    ):
        plan({"messages": [{"role": "user", "content": [text("", **CC)]}]})


def test_breakpoints_1h_after_5m_is_an_error():
    body = {
        "system": [text("a", type="ephemeral", ttl="5m")],
        "messages": [{"role": "user", "content": [text("b", type="ephemeral", ttl="1h")]}],
    }
    with pytest.raises(ContractError, match=r"^messages\.0\.content\.0\.cache_control: a ttl='1h'"):
        plan(body)
    ok = {
        "system": [text("a", type="ephemeral", ttl="1h")],
        "messages": [{"role": "user", "content": [text("b", type="ephemeral")]}],
    }
    _, p = plan(ok)
    assert [b.ttl for b in p.breakpoints] == ["1h", "5m"]


def test_breakpoints_below_minimum_are_dropped_not_errors():
    _rendered, p = plan(
        {"messages": [{"role": "user", "content": [text("short", **CC)]}]}, min_tokens=1024
    )
    assert p.breakpoints == ()
    assert p.dropped_below_minimum == ("messages.0.content.0",)


def test_breakpoints_lookback_boundaries_nearest_first_capped():
    content = [text(f"b{i}") for i in range(30)] + [text("end", **CC)]
    rendered, p = plan({"messages": [{"role": "user", "content": content}]})
    (bp,) = p.breakpoints
    ends = [s.end for s in rendered.blocks]
    assert bp.boundaries == tuple(reversed(ends[:-1]))[:19]


def _global_body():
    return {
        "tools": [{"name": "t", "input_schema": {"type": "object"}}],
        "system": [text("static " * 10, type="ephemeral", scope="global"), text("dynamic tail")],
        "messages": [{"role": "user", "content": [text("q", **CC)]}],
    }


def test_breakpoints_global_needs_beta_and_policy():
    allow = ScopePolicy(allow_global=True)
    _, no_beta = plan(_global_body(), policy=allow)
    _, no_policy = plan(_global_body(), betas=[SCOPE_BETA])
    _rendered, ok = plan(_global_body(), betas=[SCOPE_BETA], policy=allow)
    assert no_beta.scope == no_policy.scope == "org"
    assert ok.scope == "global"
    g, o = ok.breakpoints
    assert (g.scope, o.scope) == ("global", "org")
    assert "scope:global" in g.extra_keys
    assert "org:a" not in g.extra_keys
    assert "org:a" in o.extra_keys
    # Global covers only full blocks ending at or before the marker; org chains on.
    assert ok.key_spans[0] == (0, g.extra_keys)
    assert ok.key_spans[1][0] == g.position // 4
    assert ok.key_spans[1][1] == o.extra_keys


def test_breakpoints_global_on_a_message_falls_back_to_org():
    body = {
        "messages": [{"role": "user", "content": [text("q", type="ephemeral", scope="global")]}]
    }
    _, p = plan(body, betas=[SCOPE_BETA], policy=ScopePolicy(allow_global=True))
    assert p.scope == "org"
    assert p.requested_global


def test_breakpoints_global_allowlist():
    rendered, _ = plan(_global_body())
    digest = prefix_digest(rendered.tokens[: rendered.blocks[1].end])
    _, listed = plan(
        _global_body(), betas=[SCOPE_BETA], policy=ScopePolicy(True, frozenset({digest}))
    )
    _, unlisted = plan(
        _global_body(), betas=[SCOPE_BETA], policy=ScopePolicy(True, frozenset({"0" * 64}))
    )
    assert (listed.scope, unlisted.scope) == ("global", "org")


def test_breakpoints_cache_key_betas_change_keys():
    body = {"messages": [{"role": "user", "content": [text("q", **CC)]}]}
    _, a = plan(body)
    _, b = plan(body, betas=["context-1m-2025-08-07"])
    _, c = plan(body, betas=["token-counting-2024-11-01"])
    assert a.breakpoints[0].extra_keys != b.breakpoints[0].extra_keys
    assert a.breakpoints[0].extra_keys == c.breakpoints[0].extra_keys
