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

from .gguf_vocab import build_backend, is_gguf, read_vocab

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

    __slots__ = ("_bos_id", "_eos_id", "_tok")

    def __init__(self, path: Path, eos_id: int | None = None, bos_id: int | None = None) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        self._tok = _RustTokenizer.from_file(str(path))
        self._eos_id = eos_id
        self._bos_id = bos_id

    @classmethod
    def from_backend(cls, tok: Any, eos_id: int | None, bos_id: int | None) -> HFTokenizer:
        """Wrap an already built ``tokenizers.Tokenizer`` (e.g. one from GGUF metadata)."""
        self = cls.__new__(cls)
        self._tok, self._eos_id, self._bos_id = tok, eos_id, bos_id
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

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))


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
