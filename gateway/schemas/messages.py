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


ToolResultContent = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


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


class Message(_Model):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Cacheable):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Model):
    user_id: str | None = Field(None, max_length=256)


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


class CountTokensRequest(_Request):
    """count_tokens takes the same body without the generation parameters."""

    model: str = Field(min_length=1, max_length=256)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None


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


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextOut | ToolUseOut]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


class ModelInfo(BaseModel):
    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str
    max_input_tokens: int | None = None  # the context window (prompt + max_tokens)
    max_tokens: int | None = None  # the largest max_tokens a 1-token prompt could take


class ModelList(BaseModel):
    data: list[ModelInfo]
    has_more: bool = False
    first_id: str | None
    last_id: str | None
