from __future__ import annotations

from cachepoint.gateway.contract.render import Renderer
from cachepoint.gateway.schemas.messages import MessagesRequest
from cachepoint.kvcore import hash_blocks
from cachepoint.tokenizer import ByteTokenizer

R = Renderer(ByteTokenizer())
T = ByteTokenizer()


def req(**kw) -> MessagesRequest:
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return MessagesRequest.model_validate(base | kw)


def test_render_is_canonical_and_deterministic():
    tools = [{"name": "a", "input_schema": {"type": "object", "properties": {"z": {}, "b": {}}}}]
    tools_reordered = [
        {"input_schema": {"properties": {"b": {}, "z": {}}, "type": "object"}, "name": "a"}
    ]
    one = R.render(req(tools=tools))
    two = R.render(req(tools=tools_reordered))
    assert one.tokens == two.tokens  # sorted keys: dict order never matters


def test_render_spans_are_exact_byte_positions():
    r = R.render(
        req(
            system=[{"type": "text", "text": "sys"}],
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}],
                }
            ],
        )
    )
    bos, sysm, user, sep = (
        T.bos_id,
        T.special_id("<|system|>"),
        T.special_id("<|user|>"),
        T.special_id("<|sep|>"),
    )
    expected = [
        bos,
        sysm,
        *b"sys",
        sep,
        user,
        *b"ab",
        sep,
        *b"c",
        sep,
        T.special_id("<|assistant|>"),
    ]
    assert r.tokens.tolist() == expected
    paths = [(s.path, s.start, s.end) for s in r.blocks]
    assert paths == [
        ("system.0", 2, 6),
        ("messages.0.content.0", 7, 10),
        ("messages.0.content.1", 10, 12),
    ]


def test_render_tool_change_changes_everything_after():
    a = R.render(req(tools=[{"name": "t", "input_schema": {"type": "object"}}], system="static"))
    b = R.render(req(tools=[{"name": "u", "input_schema": {"type": "object"}}], system="static"))
    first_diff = next(i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y)
    assert first_diff < a.blocks[0].end  # inside the tool block
    ha, hb = hash_blocks(a.tokens, 4), hash_blocks(b.tokens, 4)
    k = first_diff // 4
    assert ha[:k] == hb[:k]
    assert all(x != y for x, y in zip(ha[k:], hb[k:], strict=False))  # everything after changes


def test_render_dynamic_system_tail_changes_only_what_follows():
    def render(tail: str):
        return R.render(
            req(
                system=[
                    {
                        "type": "text",
                        "text": "static part " * 4,
                        "cache_control": {"type": "ephemeral"},
                    },
                    {"type": "text", "text": tail},
                ]
            )
        )

    a, b = render("user=alice"), render("user=bob")
    static_end = a.blocks[0].end
    assert a.tokens[:static_end] == b.tokens[:static_end]
    assert a.tokens[static_end:] != b.tokens[static_end:]
    full = static_end // 4
    assert hash_blocks(a.tokens, 4)[:full] == hash_blocks(b.tokens, 4)[:full]


def test_render_every_block_kind_and_cacheability():
    r = R.render(
        req(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                        },
                        {
                            "type": "document",
                            "source": {"type": "text", "media_type": "text/plain", "data": "doc"},
                        },
                        {"type": "text", "text": ""},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"b": 1, "a": 2}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "ok"}],
                        },
                    ],
                },
            ]
        )
    )
    kinds = [(s.kind, s.cacheable) for s in r.blocks]
    assert kinds == [
        ("image", True),
        ("document", True),
        ("text", False),
        ("thinking", False),
        ("tool_use", True),
        ("tool_result", True),
    ]
    text = T.decode(r.tokens.tolist())
    assert '{"a":2,"b":1}' in text  # tool input with sorted keys
    assert "AAAA" not in text  # images are referenced by digest, not inlined
