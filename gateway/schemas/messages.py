"""The Messages API request and response, as the official SDK sends and parses them.

Unknown fields are refused (``extra="forbid"``) so a typo is a 400 naming the path,
never a silently ignored parameter.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class ToolUseBlock(_Cacheable):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


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


class MessagesRequest(_Model):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool | None = None
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None


class CountTokensRequest(_Model):
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


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextOut]
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


class ModelList(BaseModel):
    data: list[ModelInfo]
    has_more: bool = False
    first_id: str | None
    last_id: str | None
