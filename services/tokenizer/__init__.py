"""Tokenizers: a lossless byte-level default, a checkpoint folder's ``tokenizer.json``,
or the one a GGUF file's metadata describes (gguf_vocab.py).

Nothing here downloads anything: a tokenizer is either the built-in byte tokenizer or
read from a local folder.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

from cachepoint.tokenizer.gguf_vocab import build_backend, is_gguf, read_vocab

# NOTE: specials sit right after the 256 byte values so that every id below 256 is
# exactly one byte; the role tokens let the gateway render turns without escaping text.
BYTE_SPECIALS: tuple[str, ...] = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|sep|>",
)
BYTE_VOCAB_SIZE = 256 + len(BYTE_SPECIALS)


class Tokenizer(Protocol):
    """What the engine and the gateway need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def bos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def special_id(self, name: str) -> int | None: ...


class BatchTokenizer(Protocol):
    """What bounded, loop-friendly encoding uses (the gateway's renderer): both tokenizers
    here have it; a tokenizer without it is encoded piece by piece."""

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]: ...

    @property
    def max_token_chars(self) -> int: ...

    @property
    def splits_at_spaces(self) -> bool: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then the :data:`BYTE_SPECIALS`.

    ``decode(encode(s)) == s`` for every string that UTF-8 can encode (everything but
    lone surrogates). Incomplete UTF-8 at the end of a decode becomes U+FFFD, which a
    streaming consumer should hold back until the next token completes it.
    """

    __slots__ = ()

    _SPECIAL_IDS: ClassVar[dict[str, int]] = {name: 256 + i for i, name in enumerate(BYTE_SPECIALS)}

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    @property
    def bos_id(self) -> int:
        return self._SPECIAL_IDS["<|bos|>"]

    @property
    def eos_id(self) -> int:
        return self._SPECIAL_IDS["<|eos|>"]

    @property
    def pad_id(self) -> int:
        return self._SPECIAL_IDS["<|pad|>"]

    def special_id(self, name: str) -> int | None:
        return self._SPECIAL_IDS.get(name)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    @property
    def max_token_chars(self) -> int:
        """At most this many characters of text in one token (one byte each)."""
        return 1

    @property
    def splits_at_spaces(self) -> bool:
        """Text may be encoded in parts cut anywhere (bytes do not merge)."""
        return True

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        parts: list[str] = []
        for i in ids:
            if 0 <= i < 256:
                out.append(i)
            elif 256 <= i < BYTE_VOCAB_SIZE:
                if not skip_special_tokens:
                    parts.append(out.decode("utf-8", errors="replace"))
                    out.clear()
                    parts.append(BYTE_SPECIALS[i - 256])
            else:
                raise ValueError(f"token id {i} outside the byte vocabulary")
        parts.append(out.decode("utf-8", errors="replace"))
        return "".join(parts)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` read through the ``tokenizers`` package."""

    __slots__ = ("_bos_id", "_eos_id", "_max_chars", "_splits", "_tok")

    def __init__(self, path: Path, eos_id: int | None = None, bos_id: int | None = None) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        self._tok = _RustTokenizer.from_file(str(path))
        self._eos_id = eos_id
        self._bos_id = bos_id
        self._max_chars: int | None = None  # max_token_chars, computed on first use
        self._splits: bool | None = None  # splits_at_spaces, computed on first use

    @classmethod
    def from_backend(cls, tok: Any, eos_id: int | None, bos_id: int | None) -> HFTokenizer:
        """Wrap an already built ``tokenizers.Tokenizer`` (e.g. one from GGUF metadata)."""
        self = cls.__new__(cls)
        self._tok, self._eos_id, self._bos_id = tok, eos_id, bos_id
        self._max_chars = self._splits = None
        return self

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    def special_id(self, name: str) -> int | None:
        tid = self._tok.token_to_id(name)
        return None if tid is None else int(tid)

    def encode(self, text: str) -> list[int]:
        # NOTE: no automatic BOS/EOS: the renderer decides where specials go, so the
        # same text always maps to the same ids wherever it sits in a prompt.
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]`` in one call. NOTE: ``encode_batch`` releases
        the GIL while it works (``encode`` holds it throughout: 0.9 s for 1.3 MB of text
        measured here, during which no other thread ran), so a worker thread encoding
        a large prompt leaves the event loop free."""
        if not texts:
            return []
        done = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [list(e.ids) for e in done]

    @property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token stands for: the longest
        vocabulary entry (byte-level entries spell one byte per character, added tokens
        their content). With a normalizer, which may shrink text (NFKC composes pairs),
        four times that. NOTE: the bound proves a text too long to tokenize: it has
        at least ``len(text) / max_token_chars`` tokens."""
        if self._max_chars is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            longest = max((len(k) for k in vocab), default=1)
            self._max_chars = longest * (1 if self._tok.normalizer is None else 4)
        return self._max_chars

    @property
    def splits_at_spaces(self) -> bool:
        """Whether a text may be encoded in parts cut just before a space that follows a
        non-space, with the same ids as the whole: true of byte-level BPE without a
        normalizer (GPT-2's and Llama 3's pre-tokenizers never put a non-space and the
        space after it in one piece, and BPE merges only within a piece)."""
        if self._splits is None:
            self._splits = _byte_level_unnormalized(self._tok)
        return self._splits

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))


# Pre-tokenizer parts after which a cut before " " (following a non-space) is a piece
# boundary: the byte-level regexes (GPT-2's, Llama 3's as a Split), digit splitting.
_SPACE_SAFE_PRE = frozenset({"ByteLevel", "Split", "Digits"})


def _byte_level_unnormalized(tok: Any) -> bool:
    if tok.normalizer is not None or tok.pre_tokenizer is None:
        return False
    pre = json.loads(tok.to_str()).get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = {p.get("type") for p in parts}
    return "ByteLevel" in kinds and kinds <= _SPACE_SAFE_PRE


def _special_from_tokenizer_config(cfg: dict[str, Any], key: str, tok: HFTokenizer) -> int | None:
    value = cfg.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return tok.special_id(value) if isinstance(value, str) else None


def load_tokenizer(model_dir: Path | None) -> Tokenizer:
    """The byte tokenizer when ``model_dir`` is None, else the folder's ``tokenizer.json``,
    or the tokenizer a ``.gguf`` file's metadata describes.

    BOS/EOS come from ``tokenizer_config.json`` when present, else ``config.json``.
    """
    if model_dir is None:
        return ByteTokenizer()
    if is_gguf(model_dir):
        vocab = read_vocab(model_dir)
        return HFTokenizer.from_backend(build_backend(vocab), vocab.eos_id, vocab.bos_id)
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a model folder needs its tokenizer.json")
    tok = HFTokenizer(path)
    eos = bos = None
    tok_cfg_path = Path(model_dir) / "tokenizer_config.json"
    if tok_cfg_path.is_file():
        tok_cfg = json.loads(tok_cfg_path.read_text())
        eos = _special_from_tokenizer_config(tok_cfg, "eos_token", tok)
        bos = _special_from_tokenizer_config(tok_cfg, "bos_token", tok)
    cfg_path = Path(model_dir) / "config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        if eos is None and cfg.get("eos_token_id") is not None:
            raw = cfg["eos_token_id"]
            eos = int(raw[0] if isinstance(raw, list) else raw)
        if bos is None and cfg.get("bos_token_id") is not None:
            bos = int(cfg["bos_token_id"])
    # NOTE: the ids are resolved through the loaded vocabulary, so set them afterwards
    # rather than parsing tokenizer.json twice.
    tok._eos_id, tok._bos_id = eos, bos
    return tok
