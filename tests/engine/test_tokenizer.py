"""The byte tokenizer and tokenizer loading."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachepoint.engine import ByteTokenizer, load_tokenizer
from cachepoint.engine.tokenizer import BYTE_SPECIALS, BYTE_VOCAB_SIZE


@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text) == ids  # the same text always gives the same tokens


def test_byte_tokenizer_specials() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == BYTE_VOCAB_SIZE == 256 + len(BYTE_SPECIALS)
    assert tok.eos_id == tok.special_id("<|eos|>") == 257
    assert tok.bos_id == 256
    ids = [tok.bos_id, *tok.encode("hi"), tok.special_id("<|user|>"), tok.eos_id]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>hi<|user|><|eos|>"
    assert tok.special_id("<|nope|>") is None


def test_byte_tokenizer_rejects_ids_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="outside"):
        ByteTokenizer().decode([BYTE_VOCAB_SIZE])


def test_load_tokenizer_defaults_to_bytes_and_needs_tokenizer_json(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
