"""OpenAI's requests on the Messages pipeline, without a server: the translation of a
Chat Completions request, OpenAI's buckets from a replica's cache report, the stream's
chunks, and the rate-limit headers."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from cachepoint.billing import buckets, cache_writes
from cachepoint.gateway.contract.openai import finish_reason, translate
from cachepoint.gateway.contract.toolcalls import TextPart, ToolCall
from cachepoint.gateway.errors import ApiError
from cachepoint.gateway.pipeline import ReportLimits, buckets_of
from cachepoint.gateway.schemas.openai import ChatCompletionRequest
from cachepoint.gateway.streaming_openai import ChatChunks, openai_usage
from cachepoint.gateway.tenancy.ratelimit import Admission, Window
from cachepoint.protocol import CacheReport


def req(**kw) -> ChatCompletionRequest:
    kw.setdefault("model", "m")
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    return ChatCompletionRequest.model_validate(kw)


def test_roles_become_system_turns_tool_uses_and_tool_results():
    t = translate(
        req(
            messages=[
                {"role": "system", "content": "Be kind."},
                {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                {"role": "user", "content": "And tomorrow?"},
            ]
        ),
        default_max_tokens=100,
    )
    body = t.body.model_dump(exclude_none=True)
    assert [b["text"] for b in body["system"]] == ["Be kind.", "Be brief."]
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["user", "assistant", "user"]  # the tool result and the next user turn merge
    (use,) = body["messages"][1]["content"]
    assert (use["type"], use["id"], use["input"]) == ("tool_use", "call_1", {"city": "Paris"})
    result, follow = body["messages"][2]["content"]
    assert (result["type"], result["tool_use_id"], result["content"]) == (
        "tool_result",
        "call_1",
        "18 C",
    )
    assert follow == {"type": "text", "text": "And tomorrow?"}
    assert (t.body.max_tokens, t.clamp) == (100, True)  # nothing asked: what the window leaves


@pytest.mark.parametrize(
    ("choice", "parallel", "want"),
    [
        ("none", None, {"type": "none"}),
        ("auto", None, {"type": "auto"}),
        ("required", None, {"type": "any"}),
        ({"type": "function", "function": {"name": "get"}}, None, {"type": "tool", "name": "get"}),
        (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("required", False, {"type": "any", "disable_parallel_tool_use": True}),
    ],
)
def test_tool_choice_maps_to_the_messages_tool_choice(choice, parallel, want):
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    kw = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}
    t = translate(req(**{k: v for k, v in kw.items() if v is not None}), 10)
    assert t.body.tool_choice.model_dump(exclude_none=True) == want
    assert t.body.tools[0].input_schema == {"type": "object"}


def test_sampling_outside_anthropics_ranges_rides_beside_the_body():
    t = translate(req(temperature=1.7, seed=7, top_p=0.5, stop="END", max_tokens=9), 100)
    assert (t.temperature, t.seed, t.clamp) == (1.7, 7, False)
    assert t.body.temperature is None  # the Messages range stops at 1: set on the payload
    assert (t.body.top_p, t.body.stop_sequences, t.body.max_tokens) == (0.5, ["END"], 9)
    both = translate(req(max_tokens=9, max_completion_tokens=5), 100)
    assert both.body.max_tokens == 5  # max_completion_tokens wins
    assert translate(req(user="u1", safety_identifier="s1"), 1).body.metadata.user_id == "s1"


def test_an_image_data_url_becomes_a_base64_image_block():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    t = translate(req(messages=[{"role": "user", "content": [image]}]), 1)
    block = t.body.messages[0].content[0].model_dump()
    assert block["source"] == {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}
    with pytest.raises(ApiError) as exc:
        translate(req(messages=[{"role": "user", "content": [bad]}]), 1)
    assert exc.value.param == "messages[0].content[0]"


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
            "messages[1]",
        ),
        ({"messages": [{"role": "system", "content": "only"}]}, "messages"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}
                ]
            },
            "messages[0].content[0]",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"n": 3}, "n"),
        ({"logit_bias": {"50": 1.0}}, "logit_bias"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"min_p": 0.1}, "min_p"),
    ],
)
def test_what_cannot_be_honoured_names_the_parameter(kw, param):
    with pytest.raises(ApiError) as exc:
        translate(req(**kw), 1)
    assert (exc.value.status, exc.value.param) == (400, param)


def _report(prompt: int, engine_hit: int, entry_hit: int = 0, w1: int = 0) -> CacheReport:
    return CacheReport(
        prompt_tokens=prompt,
        engine_hit_tokens=engine_hit,
        entry_hit_tokens=entry_hit,
        written_5m_tokens=0,
        written_1h_tokens=w1,
    )


def test_openais_buckets_bill_engine_hits_as_reads_and_no_writes():
    implicit = ReportLimits(300, 10, implicit_min=128)
    b = buckets_of(_report(300, 288), 4, implicit)
    assert (b.input_tokens, b.cache_read_input_tokens, b.cache_creation_input_tokens) == (
        12,
        288,
        0,
    )
    short = ReportLimits(100, 10, implicit_min=128)
    assert buckets_of(_report(100, 96), 4, short).cache_read_input_tokens == 0  # under the minimum
    # The Messages contract on the same report: engine hits without a marker are input.
    assert buckets_of(_report(300, 288), 4, ReportLimits(300, 10)).cache_read_input_tokens == 0
    # A 24h entry written over what was reused: only the new part is a (long) write.
    b = buckets_of(_report(300, 288, entry_hit=0, w1=300), 4, implicit)
    assert (b.cache_read_input_tokens, b.cache_write_1h_tokens, b.input_tokens) == (288, 12, 0)
    b = buckets_of(_report(300, 0, w1=300), 4, implicit)
    assert (b.cache_read_input_tokens, b.cache_write_1h_tokens) == (0, 300)
    # The entry read back: a read of the whole blocks, the rest input, nothing written.
    b = buckets_of(_report(300, 288, entry_hit=300), 4, implicit)
    assert (b.cache_read_input_tokens, b.cache_write_1h_tokens, b.input_tokens) == (288, 0, 12)
    usage = openai_usage(b)
    assert (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]) == (300, 288)
    assert usage["total_tokens"] == 304


def test_a_24h_write_bills_in_the_long_bucket():
    assert cache_writes(0, [(100, "5m"), (300, "24h")]) == (0, 300)
    assert cache_writes(64, [(300, "24h")]) == (0, 236)
    assert buckets(300, 64, 0, 236, 1).cache_write_1h_tokens == 236


def _lines(chunks: list[bytes]) -> list[object]:
    out: list[object] = []
    for c in chunks:
        assert c.startswith(b"data: ") and c.endswith(b"\n\n")
        payload = c[6:-2]
        out.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return out


def test_chat_chunks_are_openais_role_deltas_tool_calls_finish_usage_done():
    em = ChatChunks("chatcmpl-1", "m", include_usage=True)
    b = buckets(20, 16, 0, 0, 3)
    chunks = em.opening(b) + em.part(TextPart("Hi")) + em.part(TextPart(""))
    chunks += em.part(ToolCall("call_9", "get", {"city": "Paris"})) + em.close()
    chunks += em.closing("end_turn", None, b)
    first, text, call, last, usage, done = _lines(chunks)
    assert first["choices"][0]["delta"]["role"] == "assistant" and first["usage"] is None
    assert text["choices"][0]["delta"] == {"content": "Hi"}
    tc = call["choices"][0]["delta"]["tool_calls"][0]
    assert (tc["index"], tc["id"], json.loads(tc["function"]["arguments"])) == (
        0,
        "call_9",
        {"city": "Paris"},
    )
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    assert done == "[DONE]"
    err = json.loads(em.error("overloaded_error", "busy")[6:-2])
    assert err == {
        "error": {"message": "busy", "type": "server_error", "param": None, "code": "overloaded"}
    }
    assert em.ping.startswith(b":")  # an SSE comment: the SDK skips it


def test_finish_reasons():
    assert [finish_reason(r, False) for r in ("end_turn", "stop_sequence", "max_tokens")] == [
        "stop",
        "stop",
        "length",
    ]
    assert finish_reason("end_turn", True) == "tool_calls"


def test_openais_rate_limit_headers():
    now = datetime(2026, 12, 7, tzinfo=UTC)
    a = Admission(
        Window(60, 59, now + timedelta(seconds=1)),
        Window(10_000, 0, now + timedelta(minutes=6)),
        retry_after_s=2.2,
    )
    got = dict(a.openai_headers(now))
    assert got["x-ratelimit-limit-requests"] == "60"
    assert got["x-ratelimit-remaining-requests"] == "59"
    assert got["x-ratelimit-reset-requests"] == "1s"
    assert got["x-ratelimit-reset-tokens"] == "6m0s"
    assert got["retry-after"] == "3"
    quick = Admission(Window(1, 0, now + timedelta(milliseconds=17)), None, None)
    assert dict(quick.openai_headers(now))["x-ratelimit-reset-requests"] == "17ms"
