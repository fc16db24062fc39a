"""Choosing the next token, and deciding when a generation stops."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .tokenizer import Tokenizer


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one sequence picks tokens and when it stops."""

    max_tokens: int = 16  # generated tokens at most (EOS and stop tokens count)
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with this much mass
    top_k: int = 0  # keep only the k likeliest tokens; 0 = all
    stop: tuple[str, ...] = ()  # strings that end the generation (checked on decoded text)
    stop_token_ids: tuple[int, ...] = ()  # ids that end it besides EOS (e.g. end-of-turn)
    seed: int | None = None  # seeds this sequence's generator; None = nondeterministic
    ignore_eos: bool = False  # keep going past EOS (benchmarks)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be finite and >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator for one sequence: seeded when ``params.seed`` is set, None if greedy."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


# NOTE: below this a temperature only magnifies rounding noise between the top logits:
# the choice is the argmax in all but name, and dividing by it overflows float32
# (1e-300 is 0.0 there, so x / t gives inf and NaN). Such rows take the argmax.
MIN_TEMPERATURE = 1e-5


def _filter_top_k_top_p(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero out everything outside the top-k / nucleus of a ``[vocab]`` distribution."""
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        # NOTE: keep a token while the mass *before* it is under top_p, so the token
        # that crosses the threshold is kept.
        before = sorted_probs.cumsum(0) - sorted_probs
        keep &= before < top_p
    # NOTE: the likeliest token always stays: a top_p below float32's smallest value
    # (1e-50 rounds to 0.0, and 0.0 < 0.0 is false) would otherwise keep nothing.
    keep[0] = True
    filtered = torch.zeros_like(probs)
    filtered[order[keep]] = sorted_probs[keep]
    return filtered


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from one ``[vocab]`` row of logits with no NaN (they are -inf by now)."""
    x = row.to(torch.float32)
    top = x.max()
    if p.temperature < MIN_TEMPERATURE or not bool(torch.isfinite(top)):
        # +inf is a certain choice (and inf - inf is NaN); all -inf has no distribution.
        return int(x.argmax())
    # NOTE: shifted by the max, the largest term is exp(0) = 1, so the softmax can neither
    # overflow nor sum to zero, whatever the temperature and the logits' dtype.
    probs = torch.softmax((x - top) / p.temperature, dim=-1)
    if p.top_k > 0 or p.top_p < 1.0:
        probs = _filter_top_k_top_p(probs, p.top_k, p.top_p)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def sample_each(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int | Exception]:
    """One token per row of ``[batch, vocab]`` float logits, or the exception that row
    raised: one row's failure never costs its batch neighbours their token.

    Greedy rows are one batched argmax; sampled rows go one by one, because each has
    its own generator (a seeded sequence must not depend on its batch neighbours).
    """
    # NOTE: torch.argmax ranks NaN above everything; a NaN logit is no evidence at all.
    clean = logits.masked_fill(logits.isnan(), float("-inf"))
    out: list[int | Exception] = [int(t) for t in clean.argmax(dim=-1).tolist()]
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        try:
            out[row] = _sample_row(clean[row], p, gen)
        except Exception as exc:  # a bad generator, a device error: this row only
            out[row] = exc
    return out


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Like :func:`sample_each`, but raises the first row's exception."""
    tokens: list[int] = []
    for token in sample_each(logits, params, generators):
        if isinstance(token, Exception):
            raise token
        tokens.append(token)
    return tokens


class StopChecker:
    """Watches a sequence's generated tokens for stop strings in the decoded text.

    Text is re-decoded from all tokens each time, so a stop string split across tokens
    (or inside one multi-byte character) is still found. :meth:`delta` hands out text
    that is safe to stream: it holds back an unfinished UTF-8 character and any tail
    that might still grow into a stop string.
    """

    __slots__ = ("_emitted", "_ids", "_text", "_tokenizer", "stop", "stopped_on")

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)  # empty strings would match at once
        self._ids: list[int] = []
        self._text = ""
        self._emitted = 0
        self.stopped_on: str | None = None  # the stop string that ended the sequence

    def append(self, token_id: int) -> str | None:
        """Add a generated token; returns the stop string it completed, if any."""
        if self.stopped_on is not None:
            raise RuntimeError("sequence already stopped")
        self._ids.append(token_id)
        self._text = self._tokenizer.decode(self._ids)
        if self.stop:
            hits = [(i, s) for s in self.stop if (i := self._text.find(s)) >= 0]
            if hits:
                cut, self.stopped_on = min(hits)
                self._text = self._text[:cut]
        return self.stopped_on

    @property
    def text(self) -> str:
        """Decoded output so far, cut before a matched stop string."""
        return self._text

    def delta(self, final: bool = False) -> str:
        """New text that can be streamed now (everything left when ``final``)."""
        text = self._text
        end = len(text)
        if not final and self.stopped_on is None:
            if text.endswith("\ufffd"):
                end -= 1
            hold = 0
            for s in self.stop:
                for n in range(min(len(s) - 1, end), hold, -1):
                    if text[end - n : end] == s[:n]:
                        hold = n
                        break
            end -= hold
        # NOTE: never take back what was already streamed, even if a re-decode shrank.
        end = max(end, self._emitted)
        chunk = text[self._emitted : end]
        self._emitted = end
        return chunk
