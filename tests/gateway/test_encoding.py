"""Bounded encoding (contract/encoding.py): the same ids as encoding each piece whole,
and tokenizing that stops as soon as a prompt is known to be too long."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepoint.gateway.contract import encoding
from cachepoint.gateway.contract.encoding import PromptTooLong, chunks, encode_pieces
from cachepoint.replica.model_source import preset_path
from cachepoint.tokenizer import ByteTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(preset_path("smollm2"))


# Text that stresses the cut rule: words, runs of spaces and newlines, code, digits,
# punctuation runs, non-ASCII letters, and specials.
_ALPHABET = st.sampled_from(
    ["a", "Z", "é", "中", "1", "9", " ", "  ", "\n", "\t", ".", "#", "-", "'s", "<|im_start|>"]
)
TEXT = st.lists(_ALPHABET, max_size=400).map("".join)


class Recording:
    """A tokenizer that records the characters it was asked to encode."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.chars = 0

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        self.chars += sum(map(len, texts))
        return self.inner.encode_many(texts)  # type: ignore[attr-defined]

    @property
    def max_token_chars(self) -> int:
        return self.inner.max_token_chars  # type: ignore[attr-defined]

    @property
    def splits_at_spaces(self) -> bool:
        return self.inner.splits_at_spaces  # type: ignore[attr-defined]


@given(text=TEXT, size=st.integers(2, 40))
@settings(max_examples=300)
def test_chunks_rejoin_and_cut_only_before_a_space_after_a_non_space(text, size):
    parts = chunks(text, size)
    assert "".join(parts) == text
    for part in parts[1:]:
        assert part.startswith(" ")
    for before in parts[:-1]:
        assert not before[-1].isspace()


@given(text=TEXT, size=st.integers(2, 64))
@settings(max_examples=300)
def test_chunked_smollm2_ids_equal_the_whole_texts(smollm2, text, size):
    assert smollm2.splits_at_spaces
    ids = [i for part in chunks(text, size) for i in smollm2.encode(part)]
    assert ids == smollm2.encode(text)


def test_encode_pieces_equals_piece_by_piece_on_long_text(smollm2, monkeypatch):
    monkeypatch.setattr(encoding, "CHUNK_CHARS", 500)
    monkeypatch.setattr(encoding, "BATCH_CHARS", 1200)
    prose = "The quick brown fox, at 12:30, jumped over   the lazy dog.\n    def f(x): return x\n"
    pieces = [prose * 40, "short", "", "é" * 3000, prose * 7]
    assert encode_pieces(smollm2, pieces, 10**6) == [smollm2.encode(p) for p in pieces]
    assert encode_pieces(smollm2, pieces, None) == [smollm2.encode(p) for p in pieces]


def test_the_character_bound_refuses_before_any_tokenizing():
    rec = Recording(ByteTokenizer())
    with pytest.raises(PromptTooLong) as info:
        encode_pieces(rec, ["x" * 5000, "y" * 6000], limit=10_000)
    assert rec.chars == 0
    assert info.value.at_least == 11_000 and info.value.limit == 10_000


def test_tokenizing_stops_soon_after_the_limit(smollm2, monkeypatch):
    monkeypatch.setattr(encoding, "CHUNK_CHARS", 4096)
    monkeypatch.setattr(encoding, "BATCH_CHARS", 16_384)
    rec = Recording(smollm2)
    text = "lorem ipsum dolor sit amet " * 40_000  # ~1 MB, ~200k tokens
    with pytest.raises(PromptTooLong) as info:
        encode_pieces(rec, [text], limit=2000)
    # a floor of the true count, reached within one batch of the limit
    assert 2000 < info.value.at_least <= len(smollm2.encode(text))
    assert rec.chars <= 2 * 16_384 + 4096
    assert rec.chars < len(text) / 20


def test_a_tokenizer_without_batches_is_encoded_piece_by_piece():
    class Plain:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def encode(self, text: str) -> list[int]:
            self.calls.append(text)
            return list(text.encode())

    plain = Plain()
    assert encode_pieces(plain, ["ab", "c"], 10) == [[97, 98], [99]]
    with pytest.raises(PromptTooLong):
        encode_pieces(plain, ["x" * 6, "y" * 6, "z" * 6], 10)
    assert plain.calls[-1] == "y" * 6  # the third piece was never encoded
