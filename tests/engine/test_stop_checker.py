"""Incremental decoding in StopChecker gives the text a full re-decode gives."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cachepoint.engine.sampling import StopChecker
from cachepoint.replica.random_model import load_random_tokenizer, tokenizer_source
from cachepoint.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()
TEXT = "Grüße, 世界! naïve café — 🙂 déjà vu; stop here: END and more 🙂🙂 after"


def _feed(checker: StopChecker, ids: list[int]) -> list[str]:
    """Append ``ids`` until a stop string matches; the streamed chunks."""
    chunks = []
    for i in ids:
        hit = checker.append(i)
        chunks.append(checker.delta(final=hit is not None))
        if hit is not None:
            break
    else:
        chunks.append(checker.delta(final=True))
    return chunks


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 255), max_size=60),
    stops=st.lists(st.text(alphabet="ab\u00e9c", min_size=1, max_size=3), max_size=2),
)
def test_bytes_match_a_full_decode(ids: list[int], stops: list[str]) -> None:
    """Random bytes (partial UTF-8 included) with stop strings: the text and the
    streamed chunks equal the full decode cut at the first stop string."""
    checker = StopChecker(BYTES, stops)
    chunks = _feed(checker, ids)
    full = BYTES.decode(ids[: len(checker._ids)])
    hits = [(full.find(s), s) for s in stops if full.find(s) >= 0]
    expected = full[: min(hits)[0]] if hits else full
    assert checker.text == expected
    assert "".join(chunks) == expected


def test_bpe_tokenizer_matches_a_full_decode() -> None:
    """SmolLM2's byte-level BPE, one token at a time, over multi-byte characters."""
    tok = load_random_tokenizer(tokenizer_source("smollm2"))
    ids = tok.encode(TEXT)
    checker = StopChecker(tok, ["END"])
    chunks = _feed(checker, ids)
    assert checker.stopped_on == "END"
    assert checker.text == TEXT[: TEXT.index("END")]
    assert "".join(chunks) == checker.text
    plain = StopChecker(tok, [])
    _feed(plain, ids)
    assert plain.text == tok.decode(ids)


def test_decoding_is_incremental() -> None:
    """A long output decodes each token with a short window, not the whole output."""
    calls: list[int] = []

    class Counting(ByteTokenizer):
        def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
            calls.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    checker = StopChecker(Counting(), ["zz"])
    for _ in range(2000):
        checker.append(ord("a"))
    assert checker.text == "a" * 2000
    assert max(calls) <= 4
