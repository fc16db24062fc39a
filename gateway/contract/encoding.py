"""Encoding a prompt's pieces with a bound on the work: tokenizing stops as soon as the
prompt is known to be longer than ``limit`` tokens, so a huge body costs no more work
than the limit it breaks.

Two proofs that a prompt is too long, cheapest first:
- its characters: no token stands for more than ``tokenizer.max_token_chars`` of them,
  so ``len(text) / max_token_chars`` tokens is a floor, known before any tokenizing;
- its tokens so far: pieces are encoded in batches of at most ``BATCH_CHARS``
  characters (a piece longer than ``CHUNK_CHARS`` in chunks cut just before a space
  that follows a non-space, where the tokenizer says the ids are the same as the
  whole's), and the count is checked after each batch.

So a 25 MB body costs at most about ``limit`` tokens of tokenizing (plus one batch),
never 25 MB of it. NOTE: batches go through ``encode_many`` (``encode_batch``), which
releases the GIL; the caller runs this in a worker thread, off the event loop.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

BATCH_CHARS = 262_144  # characters per encode_many call (~0.15 s of BPE here)
CHUNK_CHARS = 65_536  # a longer piece is cut into chunks of about this size
_SAFE_CUT = re.compile(r"(?<=\S) ")  # before a space that follows a non-space


class PromptTooLong(Exception):
    """The prompt has more than ``limit`` tokens: at least ``at_least`` (a floor, exact
    only when every piece was encoded)."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"prompt has at least {at_least} tokens, over {limit}")
        self.at_least = at_least
        self.limit = limit


def chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """``text`` cut just before spaces that follow a non-space, into parts of at most
    about ``size`` characters (a stretch with no such space stays whole)."""
    if len(text) <= size:
        return [text]
    out: list[str] = []
    start = 0
    n = len(text)
    while n - start > size:
        # NOTE: the last safe cut in the second half of the window, else the first one
        # after it; a run with none (one huge word) stays one part.
        cut = -1
        for m in _SAFE_CUT.finditer(text, start + size // 2, start + size):
            cut = m.start()
        if cut <= start:
            m2 = _SAFE_CUT.search(text, start + size)
            if m2 is None:
                break
            cut = m2.start()
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def encode_pieces(tokenizer: Any, pieces: Sequence[str], limit: int | None) -> list[list[int]]:
    """``[tokenizer.encode(p) for p in pieces]``, or ``PromptTooLong`` as soon as their
    total is known to pass ``limit`` (None: no limit)."""
    many = getattr(tokenizer, "encode_many", None)
    if limit is not None:
        per_token = getattr(tokenizer, "max_token_chars", None)
        chars = sum(map(len, pieces))
        if per_token and chars > limit * per_token:
            raise PromptTooLong(math.ceil(chars / per_token), limit)
    if many is None:  # a tokenizer without batches (tests' fakes): piece by piece
        out: list[list[int]] = []
        total = 0
        for p in pieces:
            out.append(tokenizer.encode(p))
            total += len(out[-1])
            if limit is not None and total > limit:
                raise PromptTooLong(total, limit)
        return out
    split = limit is not None and bool(getattr(tokenizer, "splits_at_spaces", False))
    # (piece index, text) in order; a long piece as several chunks when cuts are safe
    work: list[tuple[int, str]] = []
    for i, p in enumerate(pieces):
        parts = chunks(p) if split and len(p) > CHUNK_CHARS else [p]
        work.extend((i, part) for part in parts)
    ids: list[list[int]] = [[] for _ in pieces]
    total = 0
    k = 0
    while k < len(work):
        batch: list[tuple[int, str]] = []
        size = 0
        while k < len(work) and (not batch or size + len(work[k][1]) <= BATCH_CHARS):
            batch.append(work[k])
            size += len(work[k][1])
            k += 1
        for (i, _), got in zip(batch, many([t for _, t in batch]), strict=True):
            ids[i].extend(got)
            total += len(got)
        if limit is not None and total > limit:
            raise PromptTooLong(total, limit)
    return ids
