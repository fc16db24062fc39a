"""Rendering a Messages request through the served model's own Jinja chat template.

The request becomes the conversation transformers' ``apply_chat_template`` takes
(``messages`` with ``tool_calls`` and ``tool`` turns, ``tools`` as JSON function
signatures), rendered in the same sandboxed Jinja environment transformers builds
(``transformers/utils/chat_template_utils.py``: ``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, ``tojson``, ``raise_exception``, ``strftime_now``, ``namespace``),
with ``add_generation_prompt=True``.

Exact block ends: each content block's text is followed by an end marker (a private-use
sentinel holding a per-render nonce, so request text cannot forge one). The marked
string is cut at the markers and each piece is encoded on its own, so a block ends on
an exact token position and a prefix always tokenizes the same way. Cuts are moved to a
point where byte-level BPE cannot merge across them (see ``_snap``); docs/models.md
("Templates") says why this equals transformers' whole-string encoding.
"""

from __future__ import annotations

import json
import re
import secrets
from array import array
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from cachepoint.gateway.contract.blocks import (
    block_text,
    cacheable_block,
    rendered_block,
    tool_result_body,
)
from cachepoint.gateway.contract.deferred import is_deferred
from cachepoint.gateway.contract.encoding import encode_pieces
from cachepoint.gateway.contract.prompt import (
    BlockSpan,
    RenderableRequest,
    RenderedPrompt,
    Section,
    Tokenizer,
)
from cachepoint.gateway.contract.render import Renderer
from cachepoint.gateway.errors import ApiError, invalid
from cachepoint.gateway.schemas.messages import (
    CacheControl,
    CountTokensRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from cachepoint.tokenizer import load_tokenizer
from cachepoint.tokenizer.gguf_vocab import gguf_field, is_gguf, read_vocab

# NOTE: SmolLM2's template has no tool support (it never reads `tools` or
# `tool_calls`), so tools would vanish from the prompt. Requests that offer tools or
# replay tool calls then go through this ChatML template instead: Qwen2.5-Instruct's
# tool layout (JSON signatures inside <tools> in the system turn, <tool_call> JSON in
# assistant turns, <tool_response> in a user turn), without Qwen's default system
# prompt ("You are Qwen, ..."), which would misname any other model.
# NOTE: one change from Qwen's layout: the tools come before the system text, in
# Anthropic's cache order (tools, system, messages). A breakpoint on a tool then caches
# tools only, and one on the system caches tools + system, so two sessions whose
# system texts differ (Claude Code's names the working directory) still share their
# tools' entry, as they would on Anthropic's API.
CHATML_TOOLS_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" }}
    {%- if messages[0]['role'] == 'system' %}
        {{- '\n\n' + messages[0]['content'] }}
    {%- endif %}
    {%- if tool_instruction %}
        {{- "\n\n" + tool_instruction }}
    {%- endif %}
    {{- "<|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501

BLOCK_JOIN = "\n\n"  # between the blocks of one turn (they share one `content` string)
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"  # private-use sentinels around a marker
_SPECIAL_LIKE = re.compile(r"<[^<>\s]{1,64}>|\[[A-Z_/]{1,32}\]")  # candidates for specials


class TemplateError(ValueError):
    """A chat template this renderer cannot use (found when the gateway starts)."""


def load_chat_template(model_dir: Path | str | None) -> str | None:
    """The chat template a checkpoint ships: a GGUF's ``tokenizer.chat_template``, a
    folder's ``chat_template.jinja`` or ``tokenizer_config.json`` ``chat_template``
    (a string, or the list of named templates whose ``default`` is used)."""
    if model_dir is None:
        return None
    path = Path(model_dir)
    if is_gguf(path):
        return read_vocab(path).chat_template or None
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    cfg_path = path / "tokenizer_config.json"
    if not cfg_path.is_file():
        return None
    raw = json.loads(cfg_path.read_text()).get("chat_template")
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default")
    return raw if isinstance(raw, str) and raw else None


class _Marked(dict[str, Any]):
    """A dict whose JSON (through our ``tojson``) is followed by a block's end marker."""

    __slots__ = ("mark",)

    def __init__(self, mark: str, data: dict[str, Any]) -> None:
        super().__init__(data)
        self.mark = mark


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        out = json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )
        return out + x.mark if isinstance(x, _Marked) else out

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class _Namespace(jinja2.utils.Namespace):
        def __setitem__(self, name: str, value: Any) -> None:
            if name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}")
            super().__setitem__(name, value)

    # NOTE: the environment transformers builds (trim_blocks, lstrip_blocks,
    # loopcontrols; tojson without HTML escaping), so a template renders the same text.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = _Namespace
    return env


@dataclass(slots=True)
class _Block:
    path: str  # JSON path in the request
    section: Section  # tools | system | messages
    kind: str  # tool, text, tool_use, tool_result, ...
    cacheable: bool  # may carry cache_control
    cache_control: CacheControl | None  # the marker on it, if any


@dataclass(slots=True)
class Conversation:
    """A request as transformers' chat format, with an end marker after every block."""

    messages: list[dict[str, Any]]  # role/content/tool_calls dicts
    tools: list[dict[str, Any]] | None  # JSON function signatures, None = none offered
    tool_instruction: str | None  # what tool_choice any/tool asks of the model
    blocks: list[_Block]  # block i's end marker is ``marker(i)``
    nonce: str  # the markers' per-render secret


def _tool_result_text(block: ToolResultBlock) -> str:
    body = tool_result_body(block)
    return f"Error: {body}" if block.is_error else body


def to_conversation(request: RenderableRequest, *, marks: bool = True) -> Conversation:
    """The request in transformers' chat format (``marks=False``: without markers)."""
    nonce = secrets.token_hex(8)
    blocks: list[_Block] = []

    def mark(b: _Block) -> str:
        blocks.append(b)
        return f"{_MARK_OPEN}{nonce}:{len(blocks) - 1}{_MARK_CLOSE}" if marks else ""

    tools: list[dict[str, Any]] | None = None
    choice = getattr(request, "tool_choice", None)
    if request.tools and not (choice is not None and choice.type == "none"):
        tools = []
        for i, tool in enumerate(request.tools):
            m = mark(_Block(f"tools.{i}", "tools", "tool", True, tool.cache_control))
            if is_deferred(tool):
                # NOTE: never in the tools section (contract/deferred.py); its marker is
                # left out, so its span is empty where it stands. With every tool
                # deferred the list stays [] (not None), so the same template renders
                # every turn.
                continue
            fn: dict[str, Any] = {"name": tool.name}
            if tool.description is not None:
                fn["description"] = tool.description
            fn["parameters"] = tool.input_schema
            # NOTE: both levels carry the marker: whichever the template dumps ends the span.
            tools.append(_Marked(m, {"type": "function", "function": _Marked(m, fn)}))

    messages: list[dict[str, Any]] = []
    system = request.system
    if isinstance(system, str):
        m = mark(_Block("system", "system", "text", system != "", None))
        messages.append({"role": "system", "content": system + m})
    elif system:
        parts = []
        for j, sb in enumerate(system):
            b = _Block(f"system.{j}", "system", "text", sb.text != "", sb.cache_control)
            parts.append(sb.text + mark(b))
        messages.append({"role": "system", "content": BLOCK_JOIN.join(parts)})

    for n, msg in enumerate(request.messages):
        if isinstance(msg.content, str):
            b = _Block(f"messages.{n}.content", "messages", "text", msg.content != "", None)
            messages.append({"role": msg.role, "content": msg.content + mark(b)})
            continue
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        for k, block in enumerate(msg.content):
            b = _Block(
                f"messages.{n}.content.{k}",
                "messages",
                block.type,
                cacheable_block(block),
                block.cache_control,
            )
            if not rendered_block(block):
                mark(b)  # thinking: an empty span, nothing in the text (blocks.py)
            elif isinstance(block, ToolUseBlock) and msg.role == "assistant":
                m = mark(b)
                fn_call = {"name": block.name, "arguments": _Marked(m, block.input)}
                calls.append({"type": "function", "id": block.id, "function": fn_call})
            elif isinstance(block, ToolResultBlock) and msg.role == "user":
                _flush_user(messages, text)
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.tool_use_id,
                        "content": _tool_result_text(block) + mark(b),
                    }
                )
            else:
                body = block.text if isinstance(block, TextBlock) else block_text(block)
                text.append(body + mark(b))
        if msg.role == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": BLOCK_JOIN.join(text)}
            if calls:
                out["tool_calls"] = calls
            messages.append(out)
        else:
            _flush_user(messages, text, msg.role)  # a user turn, or a system one in place
    instruction = None
    if tools and choice is not None and choice.type == "any":
        instruction = "You must call one or more of these functions."
    elif tools and choice is not None and choice.type == "tool" and choice.name:
        instruction = f'You must call the function "{choice.name}".'
    return Conversation(messages, tools, instruction, blocks, nonce)


def _flush_user(messages: list[dict[str, Any]], text: list[str], role: str = "user") -> None:
    """Close a run of user blocks as one user turn (tool results are turns of their own)."""
    if text:
        messages.append({"role": role, "content": BLOCK_JOIN.join(text)})
        text.clear()


def uses_tools(conv: Conversation) -> bool:
    return conv.tools is not None or any(
        m["role"] == "tool" or "tool_calls" in m for m in conv.messages
    )


class TemplateRenderer:
    """Renders requests through one chat template, with exact block ends."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str) -> None:
        self.tokenizer = tokenizer
        self._specials: dict[str, bool] = {}  # candidate text -> is a special token
        env = _environment()
        self.source = chat_template
        self._native = env.from_string(chat_template)
        # NOTE: a template that reads neither `tools` nor `tool_calls` would drop them
        # silently; such requests use the ChatML tool layout instead (module header).
        self.native_tools = "tools" in chat_template and "tool_calls" in chat_template
        self._tools = self._native if self.native_tools else env.from_string(CHATML_TOOLS_TEMPLATE)
        self._kwargs = {
            name: tokenizer.decode([tid], skip_special_tokens=False)  # type: ignore[attr-defined]
            for name, tid in (("bos_token", tokenizer.bos_id), ("eos_token", _eos(tokenizer)))
            if tid is not None and hasattr(tokenizer, "decode")
        }
        self._check_markers_are_transparent()

    def template_for(self, conv: Conversation) -> Any:
        return self._tools if uses_tools(conv) else self._native

    def render_text(self, conv: Conversation) -> str:
        """The template's output (with markers if ``conv`` has them). A template that
        refuses the conversation (``raise_exception``) is a 400 naming its reason."""
        import jinja2

        try:
            return str(
                self.template_for(conv).render(
                    messages=conv.messages,
                    tools=conv.tools,
                    documents=None,
                    add_generation_prompt=True,
                    tool_instruction=conv.tool_instruction,
                    **self._kwargs,
                )
            )
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise invalid(f"the model's chat template cannot render this request: {exc}") from exc

    def _check_markers_are_transparent(self) -> None:
        # NOTE: a marker sits inside message text; a template that edits text (trim,
        # slicing, length checks) would render differently with it. Refuse such a
        # template at start rather than serve a prompt the model was not trained on.
        probe = CountTokensRequest.model_validate(
            {
                "model": "probe",
                "system": [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "x\n"}],
                "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
                "messages": [
                    {"role": "user", "content": " hi\n"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "text", "text": "ok "},
                            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                        ],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "2"}],
                    },
                    {"role": "assistant", "content": "done "},
                    {"role": "user", "content": "again"},
                ],
            }
        )
        bare = probe.model_copy(update={"tools": None, "messages": probe.messages[:1]})
        for req in (probe, bare):
            try:
                marked = self.render_text(to_conversation(req))
            except ApiError:
                continue  # a template that refuses this shape is checked on what it renders
            plain = self.render_text(to_conversation(req, marks=False))
            if re.sub(f"{_MARK_OPEN}[0-9a-f]+:[0-9]+{_MARK_CLOSE}", "", marked) != plain:
                raise TemplateError(
                    "the chat template changes message text (trim, slicing, ...): block "
                    "boundaries cannot be placed exactly, so it is not supported"
                )

    def _is_special(self, s: str, start: int, end: int) -> bool:
        text = s[start:end]
        known = self._specials.get(text)
        if known is None:
            # NOTE: special_id finds any vocabulary entry; a special (added, control)
            # token is one that decoding skips.
            tid = self.tokenizer.special_id(text)
            decode = getattr(self.tokenizer, "decode", None)
            known = tid is not None and (decode is None or decode([tid]) == "")
            self._specials[text] = known
        return known

    def _special_at(self, s: str, c: int) -> bool:
        m = _SPECIAL_LIKE.match(s, c)
        return m is not None and self._is_special(s, c, m.end())

    def _special_before(self, s: str, c: int) -> bool:
        if c == 0 or s[c - 1] not in ">]":
            return False
        lo = max(0, c - 66)
        for m in _SPECIAL_LIKE.finditer(s, lo, c):
            if m.end() == c and self._is_special(s, m.start(), c):
                return True
        return False

    def _snap(self, s: str, c: int, lower: int, bound: int) -> int:
        """The cut for a block that ends at ``c``: ``c`` itself, or the nearest point in
        the template's or the block's own text where byte-level BPE cannot merge across.

        Safe cuts: the ends of the text, before or after a special token, and between a
        non-space and a space (GPT-2's pre-tokenizer never puts both in one piece, and
        the whole run of spaces then lies on one side, so it splits as in the whole
        string). From a non-space end the cut moves forward over non-space template
        characters (the ``}`` closing a ``<tool_call>`` after the arguments' JSON) to the
        first space or special token, never past ``bound`` (the next block's end). From
        a space end it moves back to the start of that run of spaces, never before
        ``lower`` (the previous cut): the block's trailing spaces then go with the next
        piece. The cut depends only on the text up to the next block's end, which is the
        same in every later turn, so a prefix always tokenizes the same way."""
        n = len(s)
        if c <= 0 or c >= n or self._special_at(s, c) or self._special_before(s, c):
            return c
        if s[c - 1].isspace():
            if not s[c].isspace() and s[c - 1] != " " and (c < 2 or not s[c - 2].isspace()):
                return c  # one newline or tab, then text: never merged
            p = c
            while p > lower and s[p - 1].isspace():
                p -= 1
            return p if p > lower else c
        p = c
        while p <= bound and p < n:
            if s[p].isspace() or self._special_at(s, p):
                return p
            p += 1
        return n if p >= n else c

    def render(self, request: RenderableRequest, limit: int | None = None) -> RenderedPrompt:
        """The prompt, or ``PromptTooLong`` once it is known to pass ``limit`` tokens."""
        conv = to_conversation(request)
        marked = self.render_text(conv)
        pattern = re.compile(f"{_MARK_OPEN}{conv.nonce}:([0-9]+){_MARK_CLOSE}")
        clean: list[str] = []
        ends: dict[int, int] = {}
        last = 0
        length = 0
        for m in pattern.finditer(marked):
            clean.append(marked[last : m.start()])
            length += m.start() - last
            ends[int(m.group(1))] = length  # the last occurrence wins
            last = m.end()
        clean.append(marked[last:])
        s = "".join(clean)

        # Cuts in text order; a block whose marker the template dropped ends where the
        # block before it ended (a breakpoint on it caches less, never more).
        order = sorted(ends.items(), key=lambda kv: kv[1])
        cut_of: dict[int, int] = {}
        lower = 0
        for j, (idx, c) in enumerate(order):
            bound = order[j + 1][1] if j + 1 < len(order) else len(s)
            cut_of[idx] = lower = max(lower, self._snap(s, c, lower, bound))
        cuts = sorted(set(cut_of.values()))
        bounds = [*cuts, len(s)]
        starts = [0, *bounds[:-1]]
        pieces = [s[a:b] for a, b in zip(starts, bounds, strict=True) if b > a]
        encoded = iter(encode_pieces(self.tokenizer, pieces, limit))
        tokens: list[int] = []
        at_cut: dict[int, int] = {}
        prev = 0
        for c in bounds:
            if c > prev:
                tokens.extend(next(encoded))
            at_cut[c] = len(tokens)
            prev = max(prev, c)

        positions: list[tuple[int, int]] = []  # (token end, block index)
        prev_end = 0
        for i in range(len(conv.blocks)):
            end = at_cut[cut_of[i]] if i in cut_of else prev_end
            positions.append((end, i))
            prev_end = end
        positions.sort()
        spans: list[BlockSpan] = []
        start = 0
        for end, i in positions:
            b = conv.blocks[i]
            spans.append(
                BlockSpan(b.path, b.section, b.kind, start, end, b.cacheable, b.cache_control)
            )
            start = end
        return RenderedPrompt(array("i", tokens), tuple(spans))


def _eos(tokenizer: Tokenizer) -> int | None:
    return getattr(tokenizer, "eos_id", None)


def build_renderer(model_dir: Path | str | None) -> Renderer:
    """The gateway's renderer for ``--model-dir``: the checkpoint's tokenizer and, when
    it ships one, its chat template; None: the byte tokenizer, rendered canonically."""
    path = None if model_dir is None else Path(model_dir)
    tokenizer = load_tokenizer(path)
    source = load_chat_template(path)
    return Renderer(tokenizer, None if source is None else TemplateRenderer(tokenizer, source))


def checkpoint_context_window(model_dir: Path | str | None) -> int | None:
    """The context length a checkpoint declares: a GGUF's ``<arch>.context_length``, a
    folder's ``config.json`` ``max_position_embeddings``; None when it says nothing."""
    if model_dir is None:
        return None
    path = Path(model_dir)
    if is_gguf(path):
        arch = gguf_field(path, "general.architecture")
        value = gguf_field(path, f"{arch}.context_length") if arch else None
    else:
        cfg = path / "config.json"
        raw = json.loads(cfg.read_text()) if cfg.is_file() else {}
        value = raw.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None
