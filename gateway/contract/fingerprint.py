"""A prompt's fingerprint, and what comparing two of them says about a cache miss.

Cache diagnostics (Anthropic's `diagnostics` request field, docs/gateway.md) compares
this turn's prompt with the turn named by ``previous_message_id`` and answers the first
place they diverge: the model, the tools, the system text, another prompt-affecting
parameter, or an earlier message. The fingerprint holds hashes and token positions,
never text:

- one 64-bit hash per section (tools, system) and per message, over the tokens each
  rendered to, which finds the section;
- the first 32 bits of each block's chained content hash (kvcore's `hash_blocks`, with
  no scope keys), which finds the first divergent block, so ``cache_missed_input_tokens``
  is exact: the tokens the previous turn's cache entries cover beyond the blocks the two
  prompts share, which is what this turn would have read had its prefix matched.

Size: about 40 bytes plus 8 a message plus 4 a block (``block_size`` tokens), so a
200,000-token prompt in 16-token blocks is about 50 kB; only requests that opt in are
fingerprinted. Pure: no I/O.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

from cachepoint.gateway.contract.prompt import RenderedPrompt
from cachepoint.kvcore import hash_blocks

VERSION = 1  # bumped when a field's meaning changes: an older fingerprint is then "not found"

# NOTE: the order a prompt is cached in (Anthropic's prompt caching: tools, system, then
# messages) is the order a divergence is looked for: the earliest one is the one reported,
# and it hides any behind it. Anthropic's docs list system before tools and do not say
# which wins when both change; the prompt's order is the one the cache itself sees.
SECTION_ORDER = ("tools", "system")

REASONS_WITH_TOKENS = frozenset(
    {"model_changed", "tools_changed", "system_changed", "messages_changed"}
)


class FingerprintError(ValueError):
    """Stored bytes that are not a fingerprint of this version."""


class _Wire(msgspec.Struct, array_like=True, frozen=True):
    v: int
    model: str
    params: int
    key_betas: int
    scope: str
    below_minimum: bool
    tools: int
    system: int
    messages: bytes  # array('Q'), native order of the writer: see `_ORDER`
    block_size: int
    blocks: bytes  # array('I')
    cached_end: int
    cached_ttl_s: int
    prompt_tokens: int
    little: bool  # the writer's byte order


_ORDER_LITTLE = struct.pack("=H", 1) == struct.pack("<H", 1)


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What diagnostics keeps of one request: hashes and positions, never text."""

    model: str  # the served model id: one model, one cache
    params: int  # hash of the other prompt-affecting parameters (tool_choice, thinking, ...)
    key_betas: int  # hash of the betas in the cache key (settings.cache_key_betas)
    scope: str  # the cache scope its entries were keyed under: org or global
    below_minimum: bool  # a marker was dropped as shorter than the minimum cacheable prefix
    tools: int  # hash of the tools section's tokens (0: no tools)
    system: int  # hash of the system section's tokens (0: no system)
    messages: tuple[int, ...]  # hash of each message's tokens, in order
    block_size: int  # tokens a block: the cache's granularity
    blocks: array[int]  # low 32 bits of each full block's chained content hash
    cached_end: int  # where the request's last cache breakpoint sits (0: none)
    prompt_tokens: int  # the rendered prompt's length
    cached_ttl_s: int = 300  # that breakpoint's TTL: how long its entry outlives the turn

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(
            _Wire(
                VERSION,
                self.model,
                self.params,
                self.key_betas,
                self.scope,
                self.below_minimum,
                self.tools,
                self.system,
                array("Q", self.messages).tobytes(),
                self.block_size,
                self.blocks.tobytes(),
                self.cached_end,
                self.cached_ttl_s,
                self.prompt_tokens,
                _ORDER_LITTLE,
            )
        )

    @classmethod
    def decode(cls, data: bytes) -> Fingerprint:
        try:
            w = msgspec.msgpack.decode(data, type=_Wire)
        except msgspec.DecodeError as exc:
            raise FingerprintError(f"not a fingerprint: {exc}") from None
        if w.v != VERSION:
            raise FingerprintError(f"fingerprint version {w.v}, this gateway reads {VERSION}")
        messages, blocks = array("Q"), array("I")
        try:
            messages.frombytes(w.messages)
            blocks.frombytes(w.blocks)
        except ValueError as exc:
            raise FingerprintError(f"not a fingerprint: {exc}") from None
        if w.little != _ORDER_LITTLE:
            messages.byteswap()
            blocks.byteswap()
        return cls(
            w.model,
            w.params,
            w.key_betas,
            w.scope,
            w.below_minimum,
            w.tools,
            w.system,
            tuple(messages),
            w.block_size,
            blocks,
            w.cached_end,
            w.prompt_tokens,
            w.cached_ttl_s,
        )


def _digest(parts: Sequence[bytes]) -> int:
    h = xxhash.xxh64()
    for p in parts:
        # NOTE: each span's length first, so that two spans can never read as one.
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h.intdigest()


def params_hash(request: Any, betas: Collection[str]) -> int:
    """The other parameters that change a prompt or its cache key: Anthropic answers
    ``unavailable`` when only these differ (tool_choice, thinking, context_management,
    output_config, the set of beta headers)."""
    fields = ("tool_choice", "thinking", "context_management", "output_config")
    doc = {
        f: (v.model_dump(mode="json") if hasattr(v, "model_dump") else v)
        for f in fields
        if (v := getattr(request, f, None)) is not None
    }
    doc["betas"] = sorted(betas)
    return xxhash.xxh64_intdigest(msgspec.json.encode(doc, order="sorted"))


def betas_hash(key_betas: Collection[str]) -> int:
    """The cache-key betas, as a fingerprint keeps them."""
    return xxhash.xxh64_intdigest("\n".join(sorted(key_betas)).encode())


def fingerprint(
    rendered: RenderedPrompt,
    *,
    model: str,
    params: int,
    cached_end: int,
    block_size: int,
    key_betas: int = 0,
    scope: str = "org",
    below_minimum: bool = False,
    cached_ttl_s: int = 300,
) -> Fingerprint:
    """The fingerprint of one rendered prompt (``cached_end``: its last breakpoint)."""
    tokens = rendered.tokens
    sections: dict[str, list[bytes]] = {"tools": [], "system": []}
    messages: dict[int, list[bytes]] = {}
    for span in rendered.blocks:
        piece = tokens[span.start : span.end].tobytes()
        if span.section == "messages":
            index = int(span.path.split(".", 2)[1])
            messages.setdefault(index, []).append(piece)
        else:
            sections[span.section].append(piece)
    count = max(messages) + 1 if messages else 0
    hashes = hash_blocks(tokens, block_size)
    blocks = array("I", (int.from_bytes(h[:4], "little") for h in hashes))
    return Fingerprint(
        model=model,
        params=params,
        key_betas=key_betas,
        scope=scope,
        below_minimum=below_minimum,
        tools=_digest(sections["tools"]) if sections["tools"] else 0,
        system=_digest(sections["system"]) if sections["system"] else 0,
        messages=tuple(_digest(messages.get(i, ())) for i in range(count)),
        block_size=block_size,
        blocks=blocks,
        cached_end=cached_end,
        prompt_tokens=len(tokens),
        cached_ttl_s=cached_ttl_s,
    )


# The reasons only the server can give (docs/gateway.md, "Cache diagnostics"), where
# Anthropic's answer is null or `unavailable`: the prompt did not change, the cache key did.
SERVER_REASONS = frozenset({"scope_changed", "betas_changed", "below_minimum"})


@dataclass(frozen=True, slots=True)
class Divergence:
    """Why a turn could not reuse all of the one before: Anthropic's `cache_miss_reason`
    (``reason``), and the server's own, which is more precise where it knows more."""

    reason: str | None  # Anthropic's type; None where its answer is null (no prompt change)
    server_reason: str  # ``reason``, or scope_changed | betas_changed | below_minimum
    missed_tokens: int  # cache_missed_input_tokens (0 for unavailable, which carries none)
    shared_tokens: int  # leading tokens in full blocks the two prompts share

    def as_reason(self) -> dict[str, Any]:
        """The ``cache_miss_reason`` object of Anthropic's API (``reason`` must be set)."""
        if self.reason in REASONS_WITH_TOKENS:
            return {"type": self.reason, "cache_missed_input_tokens": self.missed_tokens}
        return {"type": self.reason}


def shared_blocks(prev: Fingerprint, cur: Fingerprint) -> int:
    """Leading blocks the two prompts have in common (0 across block sizes)."""
    if prev.block_size != cur.block_size:
        return 0
    n = 0
    for a, b in zip(prev.blocks, cur.blocks, strict=False):
        if a != b:
            break
        n += 1
    return n


def diagnose(prev: Fingerprint, cur: Fingerprint) -> Divergence | None:
    """Why ``cur`` could not reuse all of ``prev``'s cached prefix; None when it only
    appended to it and could.

    The missed tokens: what ``prev``'s cache entries cover (to its last breakpoint, and
    no further than ``cur``'s), less the full blocks both prompts share under one cache
    key, which is what ``cur`` would have read had its prefix matched. Another model,
    scope or set of cache-key betas shares nothing (each has a cache of its own).
    """
    same_key = prev.scope == cur.scope and prev.key_betas == cur.key_betas
    shared = 0
    if prev.model == cur.model and same_key:
        shared = shared_blocks(prev, cur) * cur.block_size
    # NOTE: a turn reads no further than its own last breakpoint: a shorter one (a new
    # session's first turn after a long session) could never have read all of prev's.
    missed = max(0, min(prev.cached_end, cur.cached_end) - shared)

    def found(reason: str | None, server: str, tokens: int = missed) -> Divergence:
        return Divergence(reason, server, tokens, shared)

    if prev.model != cur.model:
        return found("model_changed", "model_changed")
    for section in SECTION_ORDER:
        if getattr(prev, section) != getattr(cur, section):
            name = f"{section}_changed"
            return found(name, name)
    if prev.params != cur.params:
        # NOTE: a cache-key beta is among the parameters Anthropic answers `unavailable`
        # for; the server knows it changed the key, so every block was missed.
        key = prev.key_betas != cur.key_betas
        return found("unavailable", "betas_changed" if key else "unavailable", 0)
    if cur.messages[: len(prev.messages)] != prev.messages:
        return found("messages_changed", "messages_changed")
    if prev.scope != cur.scope:
        return found(None, "scope_changed")
    if prev.cached_end == 0 and prev.below_minimum:
        return found(None, "below_minimum", 0)
    return None
