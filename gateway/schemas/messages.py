"""The Messages API request and response, as the official SDK sends and parses them.

Unknown fields are refused (``extra="forbid"``) so a typo is a 400 naming the path,
never a silently ignored parameter. Integers and booleans are strict (``true`` is not
1), and no string may hold a lone UTF-16 surrogate, which no tokenizer can encode.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


# JSON decodes "\\ud800" without its pair to a lone surrogate code point: valid JSON,
# but not Unicode, so it cannot be encoded to UTF-8 (a pair decodes to one code point).
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: Any, path: str = "") -> tuple[str, str] | None:
    """(dotted path, code point) of the first string or key holding a lone surrogate."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return (path, f"U+{ord(found.group()):04X}") if found else None
    items: Any = ()
    if isinstance(value, dict):
        for key in value:
            found = _SURROGATE.search(key) if isinstance(key, str) else None
            if found:
                return (path or "body", f"U+{ord(found.group()):04X} in a key")
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    for key, item in items:
        hit = _lone_surrogate(item, f"{path}.{key}" if path else str(key))
        if hit is not None:
            return hit
    return None


def reject_lone_surrogates(data: Any) -> Any:
    """A ``mode="before"`` model validator: a ValueError naming the path of the first
    lone surrogate in a request body."""
    hit = _lone_surrogate(data)
    if hit is not None:
        path, what = hit
        raise ValueError(
            f"{path}: a lone surrogate ({what}) is not valid Unicode; "
            "send text as UTF-8 or escape it as a surrogate pair"
        )
    return data


class _Request(_Model):
    _unicode_only = model_validator(mode="before")(reject_lone_surrogates)


class CacheControl(_Model):
    """A `cache_control` marker. ``scope`` is Cachepoint's (behind a beta)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None
    scope: Literal["org", "global"] | None = None


class _Cacheable(_Model):
    cache_control: CacheControl | None = None


class TextBlock(_Cacheable):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None


class Base64Source(_Model):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlSource(_Model):
    type: Literal["url"]
    url: str


class PlainTextSource(_Model):
    type: Literal["text"]
    media_type: Literal["text/plain"] = "text/plain"
    data: str


class ContentSource(_Model):
    type: Literal["content"]
    content: str | list[TextBlock]


ImageSource = Annotated[Base64Source | UrlSource, Field(discriminator="type")]
DocumentSource = Annotated[
    Base64Source | UrlSource | PlainTextSource | ContentSource, Field(discriminator="type")
]


class ImageBlock(_Cacheable):
    type: Literal["image"]
    source: ImageSource


class DocumentBlock(_Cacheable):
    type: Literal["document"]
    source: DocumentSource
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None


class Caller(BaseModel):
    """Who made a tool call (``{"type": "direct"}``, or a server tool's id): the SDK's
    own ToolUseBlock carries it, so a replayed answer does."""

    model_config = ConfigDict(extra="allow")  # server tool callers add their own keys
    type: str = Field(min_length=1, max_length=64)


class ToolUseBlock(_Cacheable):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    # NOTE: the official SDK's ToolUseBlock.model_dump() writes both (as null when
    # unset); a client that echoes the assistant turn back sends them. The model never
    # sees them: the template renders the name and input.
    caller: Caller | None = None
    toolset_name: str | None = None


class ToolReferenceBlock(_Cacheable):
    """A deferred tool named inside a ``tool_result`` (client-side tool search, as
    Claude Code's ToolSearch does): the tool's definition is loaded from ``tools``."""

    type: Literal["tool_reference"]
    tool_name: str = Field(min_length=1, max_length=256)


# NOTE: documents too (a tool that reads a PDF returns one); rendered as a placeholder.
ToolResultContent = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ToolReferenceBlock, Field(discriminator="type")
]


class ToolResultBlock(_Cacheable):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultContent] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Cacheable):
    """Thinking may be replayed but never carries a breakpoint (checked by the contract)."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(_Cacheable):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock,
    Field(discriminator="type"),
]


Effort = Literal["low", "medium", "high", "xhigh", "max"]


class OutputConfig(_Model):
    """``output_config``: how hard the model should try, and a structured format.

    NOTE: effort and an advisory task budget change nothing for a model without a
    reasoning mode, so they are accepted (Claude Code sends ``effort`` on every
    request); a structured output ``format`` would be a promise this gateway cannot
    keep (no constrained decoding), so it is refused with its path.
    """

    effort: Effort | None = None
    task_budget: dict[str, Any] | None = None  # advisory, {"type": "tokens", "total": N}
    format: Any = None

    @field_validator("format", mode="before")
    @classmethod
    def _no_format(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("structured outputs are not available on a self-hosted model")
        return value


class MessageOutputConfig(_Model):
    """Per-turn ``output_config`` on a ``role: "system"`` message (effort only)."""

    effort: Effort | None = None


class Message(_Model):
    # NOTE: "system" mid-conversation is Claude Code's (its mid-conversation-tool-changes
    # beta: the environment and tool changes as a system turn in place); it renders as
    # a system turn where it stands, so the prefix before it stays cacheable.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]
    output_config: MessageOutputConfig | None = None

    @model_validator(mode="after")
    def _system_turns_hold_text(self) -> Message:
        if self.role == "system" and not isinstance(self.content, str):
            for i, block in enumerate(self.content):
                if not isinstance(block, TextBlock):
                    raise ValueError(f"content.{i}: a system message holds only text blocks")
        if self.output_config is not None and self.role != "system":
            raise ValueError("output_config: only a system message carries one")
        return self


# NOTE: tools Anthropic runs itself (web search, code execution, MCP ...) or defines
# without a schema (bash, text editor, computer, memory): a self-hosted model has neither
# the service nor the training, so they are refused with their path, not ignored.
# Tool search too: with it the API expands `tool_reference` blocks it produced itself;
# a client searches on its own side instead (a custom tool whose tool_result holds
# `tool_reference` blocks), as Claude Code's ToolSearch does.
_TOOL_SEARCH_HINT = (
    "; search deferred tools on the client side instead (a custom tool whose "
    "tool_result holds tool_reference blocks)"
)


def _refuse_server_tool(data: Any) -> Any:
    kind = data.get("type") if isinstance(data, dict) else None
    if isinstance(kind, str) and kind != "custom":
        hint = _TOOL_SEARCH_HINT if kind.startswith("tool_search_tool") else ""
        raise ValueError(f"server tool {kind} is not available on a self-hosted model{hint}")
    return data


class Tool(_Cacheable):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    # NOTE: left out of the prompt until a tool_reference names it (Claude Code marks
    # its MCP and rarely used tools so).
    defer_loading: StrictBool | None = None
    # NOTE: a streaming hint only: tool input is streamed whole per call here.
    eager_input_streaming: StrictBool | None = None

    _server_tools = model_validator(mode="before")(_refuse_server_tool)


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Model):
    # NOTE: Claude Code sends a JSON object as a string (device_id: 64 hex, account_uuid,
    # session_id: about 190 characters); 512 leaves room for keys it may add, and is the
    # ledger column's width.
    user_id: str | None = Field(None, max_length=512)


# ---------------------------------------------------------------- thinking


class ThinkingEnabled(_Model):
    """Manual extended thinking. ``budget_tokens < max_tokens`` unless the
    interleaved-thinking beta is on: checked in pipeline.prepare, which has the betas."""

    type: Literal["enabled"]
    budget_tokens: StrictInt = Field(ge=1024)
    display: Literal["summarized", "omitted", "updates"] | None = None
    block_binding: dict[str, Any] | None = None


class ThinkingAdaptive(_Model):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted", "updates"] | None = None
    block_binding: dict[str, Any] | None = None


class ThinkingDisabled(_Model):
    type: Literal["disabled"]


# NOTE: accepted and validated, then ignored for generation: a model without a reasoning
# mode answers without thinking blocks, as Anthropic's own non-thinking models do.
ThinkingConfig = Annotated[
    ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")
]


# ---------------------------------------------------------------- context management
# The request shapes of `context_management` (Anthropic's field names); what the edits
# do is contract/context_edits.py's.


class InputTokens(_Model):
    """A count of prompt tokens: a ``trigger`` or a ``clear_at_least``."""

    type: Literal["input_tokens"]
    value: StrictInt = Field(ge=0)


class ToolUses(_Model):
    """A count of tool uses: a ``trigger`` or a ``keep``."""

    type: Literal["tool_uses"]
    value: StrictInt = Field(ge=0)


class ThinkingTurns(_Model):
    """Keep the thinking of the last ``value`` assistant turns."""

    type: Literal["thinking_turns"]
    value: StrictInt = Field(ge=1)


class AllThinkingTurns(_Model):
    """Keep every turn's thinking (the same as ``keep: "all"``)."""

    type: Literal["all"]


class ClearThinkingEdit(_Model):
    """Drop thinking blocks from older assistant turns. ``keep`` None = Anthropic's
    default (the last turn's)."""

    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | ThinkingTurns | AllThinkingTurns | None = None


class ClearToolUsesEdit(_Model):
    """Once the prompt passes ``trigger``, replace the oldest tool results (and with
    ``clear_tool_inputs`` their calls' inputs) by placeholders, keeping the last
    ``keep`` tool uses and those of ``exclude_tools``; only if at least
    ``clear_at_least`` tokens go. None = Anthropic's default for each."""

    type: Literal["clear_tool_uses_20250919"]
    trigger: Annotated[InputTokens | ToolUses, Field(discriminator="type")] | None = None
    keep: ToolUses | None = None
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: StrictBool | list[str] | None = None


ContextEdit = Annotated[ClearThinkingEdit | ClearToolUsesEdit, Field(discriminator="type")]


class ContextManagement(_Model):
    """``context_management``: edits applied to the history, in order."""

    edits: list[ContextEdit] = Field(default_factory=list)

    @model_validator(mode="after")
    def _once_each(self) -> ContextManagement:
        kinds = [edit.type for edit in self.edits]
        for kind in kinds:
            if kinds.count(kind) > 1:
                raise ValueError(f"{kind} appears more than once in edits")
        return self


# NOTE: Anthropic's words for an id it could not have issued (Claude Code repeats the
# request until the id is dropped, so the message says exactly what is wanted).
BAD_PREVIOUS_ID = "must be the `id` from a prior /v1/messages response (starts with `msg_`)"


class Diagnostics(_Model):
    """``diagnostics``: the opt-in to cache diagnostics (docs/gateway.md). Sent, even as
    ``{"previous_message_id": null}`` on a first turn, it has the request fingerprinted;
    with an id it also compares this prompt with that turn's."""

    previous_message_id: str | None = None

    @field_validator("previous_message_id")
    @classmethod
    def _ours(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("msg_") or len(value) > 128):
            raise ValueError(BAD_PREVIOUS_ID)
        return value


def _not_here(what: str) -> Any:
    """A ``mode="before"`` field validator refusing a feature this gateway cannot run."""

    def check(value: Any) -> Any:
        if value is not None and value != []:
            raise ValueError(f"{what} not available on a self-hosted model")
        return value

    return check


class MessagesRequest(_Request):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: StrictInt = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    # Anthropic's ranges; strict, so a boolean is not a number (an integer is).
    temperature: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: StrictBool | None = None
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None
    thinking: ThinkingConfig | None = None
    context_management: ContextManagement | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
    output_config: OutputConfig | None = None
    # NOTE: whether it was sent at all matters (an explicit null opts in): read it
    # with `diagnostics_requested`.
    diagnostics: Diagnostics | None = None
    # NOTE: typed Any so that any value, whatever its shape, gets the clear refusal.
    mcp_servers: Any = None
    container: Any = None

    _no_mcp = field_validator("mcp_servers", mode="before")(_not_here("MCP servers are"))
    _no_container = field_validator("container", mode="before")(_not_here("containers are"))


class CountTokensRequest(_Request):
    """count_tokens takes the same body without the generation parameters."""

    model: str = Field(min_length=1, max_length=256)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None
    thinking: ThinkingConfig | None = None
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None
    # NOTE: accepted and ignored, whatever its shape: a client that sends one body to
    # both endpoints must not get a 400 here (Anthropic's count_tokens takes none).
    diagnostics: Any = None
    mcp_servers: Any = None

    _no_mcp = field_validator("mcp_servers", mode="before")(_not_here("MCP servers are"))


# ---------------------------------------------------------------- responses


class CacheCreation(BaseModel):
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int


class Usage(BaseModel):
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int
    cache_creation: CacheCreation


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    """A tool call the model made (parsed from its output by contract.toolcalls)."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ClearedToolUses(BaseModel):
    """An applied ``clear_tool_uses_20250919`` edit (contract/context_edits.py)."""

    type: Literal["clear_tool_uses_20250919"] = "clear_tool_uses_20250919"
    cleared_tool_uses: int
    cleared_input_tokens: int


class ClearedThinking(BaseModel):
    """An applied ``clear_thinking_20251015`` edit (contract/context_edits.py)."""

    type: Literal["clear_thinking_20251015"] = "clear_thinking_20251015"
    cleared_thinking_turns: int
    cleared_input_tokens: int


class ContextManagementOut(BaseModel):
    """``context_management`` in a response: the edits that changed the prompt."""

    applied_edits: list[ClearedToolUses | ClearedThinking]


def diagnostics_requested(body: MessagesRequest) -> bool:
    """True when the body carries ``diagnostics``, even as null (the opt-in)."""
    return "diagnostics" in body.model_fields_set


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextOut | ToolUseOut]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: Usage
    # NOTE: only when the request sent context_management (the route leaves it out
    # otherwise), as Anthropic answers.
    context_management: ContextManagementOut | None = None
    # NOTE: only when the request sent diagnostics (left out otherwise): null when
    # nothing diverged, else Anthropic's {"cache_miss_reason": {...}}, plus, as an
    # extension the SDKs ignore, {"cachepoint": {...}} (gateway/diagnostics.py).
    diagnostics: dict[str, Any] | None = None


class CountTokensResponse(BaseModel):
    input_tokens: int


class ModelInfo(BaseModel):
    """One model, in both SDKs' shapes at once: Anthropic's fields (type, display_name,
    created_at, ...) and OpenAI's (object, created, owned_by); each SDK reads its own
    and keeps the others as extras."""

    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str
    max_input_tokens: int | None = None  # the context window (prompt + max_tokens)
    max_tokens: int | None = None  # the largest max_tokens a 1-token prompt could take
    object: Literal["model"] = "model"  # OpenAI's
    created: int = 0  # OpenAI's: created_at in epoch seconds
    owned_by: str = "cachepoint"  # OpenAI's


class ModelList(BaseModel):
    object: Literal["list"] = "list"  # OpenAI's
    data: list[ModelInfo]
    has_more: bool = False
    first_id: str | None
    last_id: str | None
