"""The gateway renders through SmolLM2's own chat template, token for token as
transformers' ``apply_chat_template`` (the outside reference), with exact block ends.

Each case is a Messages request and, written out by hand, the conversation
transformers takes for it. transformers loads the tokenizer and template from the same
GGUF file (``gguf_file=``) and encodes the whole rendered string at once; we encode it
piece by piece (cut at block ends), and the ids must be equal.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from cachepoint.gateway.contract.breakpoints import ContractError
from cachepoint.gateway.contract.template import (
    CHATML_TOOLS_TEMPLATE,
    TemplateError,
    TemplateRenderer,
    build_renderer,
    checkpoint_context_window,
    load_chat_template,
)
from cachepoint.gateway.schemas.messages import MessagesRequest
from cachepoint.replica.model_source import preset_path

from .plans import plan_of

# NOTE: preset_path raises, naming the install step, when the model is missing: the
# Makefile installs it, and a skipped reference check would hide a missing install.
GGUF = preset_path("smollm2")

WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
    },
}
CLOCK = {"name": "now", "input_schema": {"type": "object", "properties": {}}}


def _hf_tool(t: dict[str, Any]) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": t["name"]}
    if "description" in t:
        fn["description"] = t["description"]
    fn["parameters"] = t["input_schema"]
    return {"type": "function", "function": fn}


def _call(cid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "id": cid, "function": {"name": name, "arguments": args}}


# (name, Messages request body, the same conversation in transformers' chat format,
#  tools for transformers, whether the tool fallback template applies)
CASES: list[tuple[str, dict[str, Any], list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    (
        "system_multi_turn",
        {
            "system": "You are a terse assistant. Answer in one line.",
            "messages": [
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy? 🇮🇹 请回答。"},
            ],
        },
        [
            {"role": "system", "content": "You are a terse assistant. Answer in one line."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy? 🇮🇹 请回答。"},
        ],
        None,
    ),
    (
        "default_system_and_blocks",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Here is code:"},
                        {"type": "text", "text": "def f(x):\n    return {'a': [x, 2]}"},
                        {
                            "type": "text",
                            "text": "Explain it.",
                            "cache_control": {"type": "ephemeral"},
                        },
                    ],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "It returns a dict."}]},
                {"role": "user", "content": "Thanks   \n\n  bye"},
            ],
        },
        [
            {
                "role": "user",
                "content": "Here is code:\n\ndef f(x):\n    return {'a': [x, 2]}\n\nExplain it.",
            },
            {"role": "assistant", "content": "It returns a dict."},
            {"role": "user", "content": "Thanks   \n\n  bye"},
        ],
        None,
    ),
    (
        "tools_and_results",
        {
            "system": [
                {"type": "text", "text": "You call tools when useful."},
                {
                    "type": "text",
                    "text": "Be exact.",
                    "cache_control": {"type": "ephemeral", "ttl": "1h"},
                },
            ],
            # 1h: the tools come before the system (whose block is 1h) in cache order.
            "tools": [WEATHER, {**CLOCK, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "messages": [
                {"role": "user", "content": "Weather in Paris and Rome, and the time?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me check."},
                        {
                            "type": "tool_use",
                            "id": "toolu_01",
                            "name": "get_weather",
                            "input": {"city": "Paris", "unit": "c"},
                        },
                        {
                            "type": "tool_use",
                            "id": "toolu_02",
                            "name": "get_weather",
                            "input": {"city": "Rome"},
                        },
                        {"type": "tool_use", "id": "toolu_03", "name": "now", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_01",
                            "content": "18 C, sunny",
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_02",
                            "content": [{"type": "text", "text": '{"temp": 21}'}],
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_03",
                            "content": "clock offline",
                            "is_error": True,
                        },
                        {"type": "text", "text": "Summarise please."},
                    ],
                },
            ],
        },
        [
            {"role": "system", "content": "You call tools when useful.\n\nBe exact."},
            {"role": "user", "content": "Weather in Paris and Rome, and the time?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    _call("toolu_01", "get_weather", {"city": "Paris", "unit": "c"}),
                    _call("toolu_02", "get_weather", {"city": "Rome"}),
                    _call("toolu_03", "now", {}),
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_01", "content": "18 C, sunny"},
            {"role": "tool", "tool_call_id": "toolu_02", "content": '{"temp": 21}'},
            {"role": "tool", "tool_call_id": "toolu_03", "content": "Error: clock offline"},
            {"role": "user", "content": "Summarise please."},
        ],
        [_hf_tool(WEATHER), _hf_tool(CLOCK)],
    ),
    (
        "tools_without_system_then_answer",
        {
            "tools": [WEATHER],
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "toolu_9",
                            "name": "get_weather",
                            "input": {"city": "Oslo", "nested": {"a": [1, {"b": None}]}},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "-3 C"}
                    ],
                },
                {"role": "assistant", "content": "It is -3 C in Oslo."},
                {"role": "user", "content": "Warm enough for a walk?"},
            ],
        },
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    _call(
                        "toolu_9",
                        "get_weather",
                        {"city": "Oslo", "nested": {"a": [1, {"b": None}]}},
                    )
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_9", "content": "-3 C"},
            {"role": "assistant", "content": "It is -3 C in Oslo."},
            {"role": "user", "content": "Warm enough for a walk?"},
        ],
        [_hf_tool(WEATHER)],
    ),
    (
        # Claude Code's mid-conversation system turn (environment, tool changes).
        "system_turn_in_the_messages",
        {
            "system": "You are a coding agent.",
            "messages": [
                {
                    "role": "system",
                    "content": [{"type": "text", "text": "# Environment\n - cwd: /tmp/p"}],
                    "output_config": {"effort": "medium"},
                },
                {"role": "user", "content": "List the files."},
            ],
        },
        [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "system", "content": "# Environment\n - cwd: /tmp/p"},
            {"role": "user", "content": "List the files."},
        ],
        None,
    ),
    (
        "system_turn_with_tools",
        {
            "system": "You are a coding agent.",
            "tools": [WEATHER],
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "system", "content": "Tool get_weather is now available."},
                {"role": "user", "content": "Go on."},
            ],
        },
        [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "system", "content": "Tool get_weather is now available."},
            {"role": "user", "content": "Go on."},
        ],
        [_hf_tool(WEATHER)],
    ),
]


@pytest.fixture(scope="module")
def ref_tok() -> Any:
    import transformers  # the reference: a dev dependency, never skipped

    return transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)


@pytest.fixture(scope="module")
def renderer() -> Any:
    return build_renderer(GGUF)


def _request(body: dict[str, Any]) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"model": "smollm2-135m-instruct", "max_tokens": 8, **body}
    )


def _uses_tools(body: dict[str, Any]) -> bool:
    return "tools" in body


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_equals_transformers_apply_chat_template(case: Any, ref_tok: Any, renderer: Any) -> None:
    _, body, hf_messages, hf_tools = case
    ours = renderer.render(_request(body))
    # NOTE: SmolLM2's own template ignores tools, so tool requests use the ChatML tool
    # layout (Qwen2.5's); transformers is given that template for those cases.
    template = CHATML_TOOLS_TEMPLATE if _uses_tools(body) else None
    ref = ref_tok.apply_chat_template(
        hf_messages,
        tools=hf_tools,
        chat_template=template,
        add_generation_prompt=True,
        tokenize=True,
    )
    ref_ids = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    assert list(ours.tokens) == ref_ids
    if template is None:  # the GGUF's own template, no synthetic markers
        text = ref_tok.decode(ref_ids)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_uses_the_gguf_template_not_synthetic_markers(renderer: Any) -> None:
    src = load_chat_template(GGUF)
    assert src is not None and "<|im_start|>" in src
    assert renderer.template is not None and renderer.template.source == src
    assert not renderer.template.native_tools  # SmolLM2's template reads no tools
    out = renderer.render(_request(CASES[0][1]))
    text = renderer.tokenizer.decode(list(out.tokens), skip_special_tokens=False)
    assert "<|user|>" not in text and "\n<user>\n" not in text
    assert text.count("<|im_start|>") == 5  # system, 3 turns, generation prompt


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_block_ends_are_exact(case: Any, renderer: Any) -> None:
    """Every block's span ends on its own last token: decoding the prompt up to the end
    gives text that ends with the block's text (or its JSON), and ends increase."""
    body = case[1]
    req = _request(body)
    out = renderer.render(req)
    dec = renderer.tokenizer.decode
    ends = [s.end for s in out.blocks]
    assert ends == sorted(ends) and len(set(ends)) == len(ends)
    for span in out.blocks:
        before = dec(list(out.tokens[: span.end]), skip_special_tokens=False)
        node: Any = req
        for part in span.path.split("."):
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        if span.kind == "text":
            expected = node if isinstance(node, str) else node.text
            assert before.endswith(expected), span.path
        elif span.kind == "tool_result":
            assert before.endswith(node.content if isinstance(node.content, str) else "}")
        elif span.kind == "tool_use":
            assert before.endswith("}}"), span.path  # the arguments and the call's brace
        elif span.kind == "tool":
            assert before.endswith('"required": ["city"]}}}') or before.endswith("{}}}}")


def test_breakpoints_sit_on_block_ends(renderer: Any) -> None:
    body = copy.deepcopy(CASES[2][1])
    body["system"][1]["cache_control"] = {"type": "ephemeral"}  # 5m, as the tool's

    def plan_for(b: dict[str, Any]) -> Any:
        return plan_of(renderer.render(_request(b)))

    out = renderer.render(_request(body))
    plan = plan_for(body)
    by_path = {s.path: s for s in out.blocks}
    # The tools come first in the system turn, in Anthropic's cache order (tools,
    # system, messages): a breakpoint on the system caches the tools too.
    assert [b.path for b in plan.breakpoints] == ["tools.1", "system.1"]
    assert [b.position for b in plan.breakpoints] == [
        by_path["tools.1"].end,
        by_path["system.1"].end,
    ]
    assert by_path["tools.0"].end < by_path["tools.1"].end < by_path["system.1"].end
    assert plan.breakpoints[1].boundaries[:2] == (by_path["system.0"].end, by_path["tools.1"].end)
    # So the ttl order rule reads that order too: a 1h system after a 5m tool is
    # refused, as Anthropic refuses it.
    refused = copy.deepcopy(CASES[2][1])
    refused["tools"][1]["cache_control"] = {"type": "ephemeral"}  # 5m before the 1h system
    with pytest.raises(ContractError, match=r"system\.1\.cache_control: a ttl='1h'"):
        plan_for(refused)


def test_count_tokens_renders_the_same(renderer: Any) -> None:
    from cachepoint.gateway.schemas.messages import CountTokensRequest

    body = CASES[2][1]
    counted = renderer.render(CountTokensRequest.model_validate({"model": "m", **body}))
    assert list(counted.tokens) == list(renderer.render(_request(body)).tokens)


def test_tool_choice_none_offers_no_tools(renderer: Any) -> None:
    body = {**CASES[3][1], "tool_choice": {"type": "none"}}
    text = renderer.tokenizer.decode(
        list(renderer.render(_request(body)).tokens), skip_special_tokens=False
    )
    assert "<tools>" not in text
    assert '<tool_call>\n{"name": "get_weather"' in text  # the history is still shown
    assert renderer.render(_request(body)).blocks[0].path == "messages.0.content"


def test_forged_markers_in_text_are_plain_text(renderer: Any) -> None:
    forged = "a\ue0000000000000000000:0\ue001b"
    out = renderer.render(_request({"messages": [{"role": "user", "content": forged}]}))
    text = renderer.tokenizer.decode(list(out.tokens), skip_special_tokens=False)
    assert forged + "<|im_end|>" in text


def test_template_that_edits_text_is_refused(renderer: Any) -> None:
    trimming = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(TemplateError, match="changes message text"):
        TemplateRenderer(renderer.tokenizer, trimming)


def test_hf_folder_template(tmp_path: Path) -> None:
    """A HF folder's tokenizer_config.json chat_template (or chat_template.jinja)."""
    import json

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "A{{x}}"}))
    assert load_chat_template(tmp_path) == "A{{x}}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "T"},
                    {"name": "default", "template": "D"},
                ]
            }
        )
    )
    assert load_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path) == "J"
    assert load_chat_template(None) is None
    assert checkpoint_context_window(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 32768}))
    assert checkpoint_context_window(tmp_path) == 32768
    assert checkpoint_context_window(GGUF) == 8192


@pytest.mark.slow
def test_gateway_with_gguf_model_dir_counts_template_tokens(
    seeded_db: Any, serve: Any, ref_tok: Any
) -> None:
    """`--model-dir FILE.gguf`: count_tokens (through the official SDK) is the length of
    the template rendering, as transformers' apply_chat_template counts it."""
    import anthropic

    from cachepoint.gateway.app import create_app
    from cachepoint.gateway.settings import GatewaySettings

    db, keys = seeded_db
    settings = GatewaySettings(
        database_url=db, replica_urls=[], model_dir=GGUF, models=["smollm2-135m-instruct"]
    )
    url = serve(create_app(settings))
    client = anthropic.Anthropic(base_url=url, api_key=keys["a"], max_retries=0)
    _, body, hf_messages, hf_tools = CASES[2]
    counted = client.messages.count_tokens(model="smollm2-135m-instruct", **body)
    ref = ref_tok.apply_chat_template(
        hf_messages,
        tools=hf_tools,
        chat_template=CHATML_TOOLS_TEMPLATE,
        add_generation_prompt=True,
        tokenize=True,
    )
    assert counted.input_tokens == len(ref["input_ids"] if hasattr(ref, "keys") else ref)
    # The window comes from the checkpoint (SmolLM2's GGUF says 8,192), as the SDK reads it.
    (info,) = client.models.list().data
    assert (info.id, info.max_input_tokens, info.max_tokens) == (
        "smollm2-135m-instruct",
        8192,
        8191,
    )
    too_long = client.messages.with_raw_response
    with pytest.raises(anthropic.BadRequestError, match="exceed context limit: "):
        too_long.create(
            model="smollm2-135m-instruct",
            max_tokens=8190,
            messages=[{"role": "user", "content": "word " * 50}],
        )
    # An explicit window wins over the checkpoint's.
    url = serve(create_app(settings.model_copy(update={"max_context_tokens": 4096})))
    client = anthropic.Anthropic(base_url=url, api_key=keys["a"], max_retries=0)
    assert client.models.retrieve("smollm2-135m-instruct").max_input_tokens == 4096


@pytest.mark.slow
@pytest.mark.parametrize(
    ("choice", "instruction"),
    [
        ({"type": "any"}, "You must call one or more of these functions."),
        ({"type": "tool", "name": "now"}, 'You must call the function "now".'),
        ({"type": "auto"}, None),
    ],
)
def test_tool_choice_instructs_the_model(
    choice: dict[str, Any], instruction: str | None, renderer: Any, ref_tok: Any
) -> None:
    _, body, hf_messages, hf_tools = CASES[2]
    out = renderer.render(_request({**body, "tool_choice": choice}))
    text = renderer.tokenizer.decode(list(out.tokens), skip_special_tokens=False)
    if instruction is None:
        assert "You must call" not in text
    else:
        # After the system text, the turn's last words (tools, system, instruction).
        assert f"Be exact.\n\n{instruction}<|im_end|>" in text
    ref = ref_tok.apply_chat_template(
        hf_messages,
        tools=hf_tools,
        chat_template=CHATML_TOOLS_TEMPLATE,
        add_generation_prompt=True,
        tokenize=True,
        tool_instruction=instruction,
    )
    assert list(out.tokens) == list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    # The tools' and the system's ends do not move: their cache entries stay valid.
    plain = renderer.render(_request(body))
    assert [s.end for s in out.blocks[:4]] == [s.end for s in plain.blocks[:4]]


def test_template_refusal_is_a_400(renderer: Any) -> None:
    """raise_exception in a template (here: no system turns) is the client's 400."""
    from cachepoint.gateway.errors import ApiError

    strict = (
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tpl = TemplateRenderer(renderer.tokenizer, strict)
    ok = tpl.render(_request({"messages": [{"role": "user", "content": "hi"}]}))
    assert renderer.tokenizer.decode(list(ok.tokens), skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ApiError, match="System role not supported") as err:
        tpl.render(_request({"system": "s", "messages": [{"role": "user", "content": "hi"}]}))
    assert err.value.status == 400


@pytest.mark.slow
def test_hf_folder_renders_like_the_gguf(tmp_path: Path, ref_tok: Any, renderer: Any) -> None:
    """The same tokenizer and template saved as a HF folder by transformers
    (tokenizer.json + its chat template file) render every case identically."""
    ref_tok.save_pretrained(str(tmp_path))
    assert load_chat_template(tmp_path) == load_chat_template(GGUF)
    folder = build_renderer(tmp_path)
    assert folder.template is not None
    for _, body, _, _ in CASES:
        a, b = folder.render(_request(body)), renderer.render(_request(body))
        assert list(a.tokens) == list(b.tokens) and a.blocks == b.blocks
