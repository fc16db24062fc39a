"""Choosing the next token, and deciding when a generation stops."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cachepoint.engine.tokenizer import Tokenizer


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


def _draw_uniform(gen: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) on ``device``, from the row's own generator (or torch's)."""
    return torch.rand((), generator=gen, device=device)


def _inverse_cdf(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``[m, 1]`` indices: where each row's cumulative mass passes ``target`` times its
    total (``target`` in [0, 1), ``[m, 1]``).

    NOTE: a zero-mass token never passes (its cdf equals its predecessor's); the clamp
    only catches rounding at the very top, onto the last token with mass.
    """
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, target * cdf[:, -1:], right=True)
    last = (probs > 0).cumsum(dim=-1).argmax(dim=-1, keepdim=True)
    return torch.minimum(idx, last)


def _sample_rows(
    x: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor
) -> torch.Tensor:
    """One token per row of ``[m, vocab]`` clean logits, by inverse-CDF sampling with
    the per-row uniforms ``u`` (``[m]``). Returns ``[m]`` token ids on the device."""
    x = x.to(torch.float32)
    device = x.device
    vocab = x.shape[-1]
    top = x.max(dim=-1, keepdim=True).values
    # +inf is a certain choice (and inf - inf is NaN); all -inf has no distribution.
    finite = torch.isfinite(top).squeeze(-1)
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    # NOTE: shifted by the max, the largest term is exp(0) = 1, so the softmax can neither
    # overflow nor sum to zero, whatever the temperature and the logits' dtype. Rows
    # without a finite max are shifted by 0 instead; their draw is replaced below.
    shift = torch.where(finite.unsqueeze(-1), top, torch.zeros_like(top))
    probs = torch.softmax((x - shift) / temps.unsqueeze(-1), dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)
    target = u.to(torch.float32).unsqueeze(-1)
    picked = _inverse_cdf(probs, target)
    filters = [p.top_k > 0 or p.top_p < 1.0 for p in params]
    if any(filters):
        # NOTE: only filtering rows sample over the sorted order: a row's token must not
        # depend on whether a neighbour filters (the draw maps to a different token once
        # the order changes).
        ranked, order = probs.sort(dim=-1, descending=True, stable=True)
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        rank = torch.arange(vocab, device=device).unsqueeze(0)
        keep = rank < torch.tensor(ks, device=device).unsqueeze(-1)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        top_p = top_p.unsqueeze(-1)
        # NOTE: keep a token while the mass *before* it is under top_p, so the token
        # that crosses the threshold is kept (and top_p 1 keeps all, rounding or not).
        before = ranked.cumsum(dim=-1) - ranked
        keep &= (before < top_p) | (top_p >= 1.0)
        # NOTE: the likeliest token always stays: a top_p below float32's smallest value
        # (1e-50 rounds to 0.0, and 0.0 < 0.0 is false) would otherwise keep nothing.
        keep[:, 0] = True
        filtered = order.gather(-1, _inverse_cdf(ranked * keep, target))
        mask = torch.tensor(filters, device=device).unsqueeze(-1)
        picked = torch.where(mask, filtered, picked)
    return torch.where(finite, picked.squeeze(-1), x.argmax(dim=-1))


def sample_each(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int | Exception]:
    """One token per row of ``[batch, vocab]`` float logits, or the exception that row
    raised: one row's failure never costs its batch neighbours their token.

    Batched: greedy rows are one argmax; sampled rows are one set of tensor ops
    (temperature, top-k, top-p, inverse-CDF draw), and every id crosses to the host in
    a single ``tolist()``. Each sampled row draws its one uniform from its own
    generator, so a seeded sequence never depends on its batch neighbours.
    """
    # NOTE: torch.argmax ranks NaN above everything; a NaN logit is no evidence at all.
    clean = logits.masked_fill(logits.isnan(), float("-inf"))
    ids = clean.argmax(dim=-1)
    failed: dict[int, Exception] = {}
    rows: list[int] = []
    draws: list[torch.Tensor] = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        # NOTE: below MIN_TEMPERATURE the row is the argmax and draws nothing, as greedy.
        if p.temperature < MIN_TEMPERATURE:
            continue
        try:
            draws.append(_draw_uniform(gen, clean.device))
        except Exception as exc:  # a bad generator, a device error: this row only
            failed[row] = exc
            continue
        rows.append(row)
    if rows:
        try:
            index = torch.tensor(rows, device=clean.device)
            picked = _sample_rows(clean[index], [params[r] for r in rows], torch.stack(draws))
            ids = ids.index_copy(0, index, picked.to(ids.dtype))
        except Exception as exc:  # the batch's own ops failed: its sampled rows fail
            failed.update(dict.fromkeys(rows, exc))
    out: list[int | Exception] = [int(t) for t in ids.tolist()]
    for row, error in failed.items():
        out[row] = error
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

    Decoding is incremental (as vLLM's detokenizer): each new token is decoded together
    with a few tokens before it, and the text that window adds is appended. Re-decoding
    every token each step made a 3,000-token output cost more host time than its
    forward passes. A token whose bytes end inside a multi-byte character stays
    pending until the character completes, so a character split across tokens, or a
    stop string split across tokens, is still found. :meth:`delta` hands out text that
    is safe to stream: it holds back an unfinished UTF-8 character and any tail that
    might still grow into a stop string.
    """

    __slots__ = (
        "_emitted",
        "_ids",
        "_prefix",
        "_read",
        "_tail",
        "_text",
        "_tokenizer",
        "stop",
        "stopped_on",
    )

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)  # empty strings would match at once
        self._ids: list[int] = []
        self._text = ""  # text of ids[:_read], final
        self._tail = ""  # text ids[_read:] add so far (may end in an unfinished character)
        self._prefix = 0  # first id of the decode window (context for the tokenizer)
        self._read = 0  # ids whose text is in `_text`
        self._emitted = 0
        self.stopped_on: str | None = None  # the stop string that ended the sequence

    def _decode_tail(self) -> None:
        """Decode the window ``ids[_prefix:]``; commit its new text once it is whole."""
        dec = self._tokenizer.decode
        before = dec(self._ids[self._prefix : self._read])
        window = dec(self._ids[self._prefix :])
        if not window.startswith(before):
            # NOTE: a tokenizer whose window decode is not prefix-stable here: decode
            # everything once and start a fresh window after it.
            self._text, self._tail = dec(self._ids), ""
            self._prefix = self._read = len(self._ids)
            return
        self._tail = window[len(before) :]
        if not self._tail.endswith("\ufffd"):
            self._text += self._tail
            self._tail = ""
            self._prefix, self._read = self._read, len(self._ids)

    def append(self, token_id: int) -> str | None:
        """Add a generated token; returns the stop string it completed, if any."""
        if self.stopped_on is not None:
            raise RuntimeError("sequence already stopped")
        seen = len(self._text)
        self._ids.append(token_id)
        self._decode_tail()
        if self.stop:
            text = self.text
            # Only text that could contain a match not checked before: the new text
            # and, before it, one character less than the longest stop string.
            start = max(0, seen - max(len(s) for s in self.stop) + 1)
            hits = [(i, s) for s in self.stop if (i := text.find(s, start)) >= 0]
            if hits:
                cut, self.stopped_on = min(hits)
                self._text, self._tail = text[:cut], ""
        return self.stopped_on

    @property
    def text(self) -> str:
        """Decoded output so far, cut before a matched stop string."""
        return self._text + self._tail

    def delta(self, final: bool = False) -> str:
        """New text that can be streamed now (everything left when ``final``)."""
        text = self.text
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
