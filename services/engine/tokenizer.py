"""The tokenizers live in `cachepoint.tokenizer` (torch-free, shared with the gateway)."""

from cachepoint.tokenizer import (
    BYTE_SPECIALS,
    BYTE_VOCAB_SIZE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "BYTE_SPECIALS",
    "BYTE_VOCAB_SIZE",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
]
