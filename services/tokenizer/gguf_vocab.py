"""A GGUF file's metadata, and the byte-level BPE tokenizer it describes.

A GGUF carries no ``tokenizer.json``: the vocabulary, merges and special ids are
metadata under llama.cpp's key names. This module rebuilds the same tokenizer that
transformers builds from those keys (``integrations/gguf/gguf_tokenizer_mapping.py``),
so our ids equal transformers' (tests/engine/test_reference_smollm2.py checks it).

Torch-free (the gateway may use it); reading goes through the ``gguf`` package.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"

# llama.cpp token types (gguf.TokenType): only CONTROL tokens become special tokens.
_CONTROL = 3

# NOTE: the split regexes of the pre-tokenizer types transformers knows. "smollm",
# "gpt2" and "default" are absent from transformers' table on purpose: they keep the
# plain GPT-2 byte-level regex (`ByteLevel(use_regex=True)`), which is what
# transformers gives SmolLM2, so it is what we mirror. Unknown types are refused
# rather than guessed, since a wrong split changes ids without any error.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "smollm": None,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


@dataclass(slots=True, frozen=True)
class GGUFVocab:
    """The tokenizer part of a GGUF's metadata."""

    model: str  # tokenizer.ggml.model: "gpt2" is byte-level BPE (the only kind built here)
    pre: str  # tokenizer.ggml.pre: which split regex the merges were learned with
    tokens: list[str]  # id -> token, as the file spells it
    token_types: list[int]  # id -> llama.cpp token type (3 = control)
    merges: list[str]  # "a b" pairs, best first
    bos_id: int | None  # tokenizer.ggml.bos_token_id
    eos_id: int | None  # tokenizer.ggml.eos_token_id
    chat_template: str | None  # tokenizer.chat_template (Jinja), when the file has one


def is_gguf(path: Path | str | None) -> bool:
    """Whether ``path`` names a GGUF file (by suffix) rather than a checkpoint folder."""
    return path is not None and Path(path).suffix.lower() == GGUF_SUFFIX


@cache
def _reader(path: Path, mtime_ns: int, size: int) -> Any:
    from gguf import GGUFReader

    # NOTE: memory-mapped; cached so the config, weights and tokenizer of one file
    # share one parse (about 1.5 s for SmolLM2's 49k-token vocabulary). The key holds
    # mtime and size so a file rewritten in place is parsed afresh.
    return GGUFReader(str(path), "r")


def gguf_reader(path: Path | str) -> Any:
    """The (cached, memory-mapped) ``gguf.GGUFReader`` of ``path``."""
    p = Path(path).resolve()
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: not a GGUF file")
    st = p.stat()
    return _reader(p, st.st_mtime_ns, st.st_size)


def gguf_field(path: Path | str, key: str, default: Any = None) -> Any:
    """One metadata value (scalar, string or list), or ``default`` when absent."""
    field = gguf_reader(path).fields.get(key)
    return default if field is None else field.contents()


# The keys whose ids end a turn: EOS, and llama.cpp's end-of-turn / end-of-message.
EOS_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)


def gguf_eos_ids(path: Path | str) -> tuple[int, ...]:
    """Every id that ends a turn in a GGUF file, EOS first; () when it names none."""
    ids = (gguf_field(path, key) for key in EOS_KEYS)
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def read_vocab(path: Path | str) -> GGUFVocab:
    """The tokenizer metadata of a GGUF file."""
    tokens = gguf_field(path, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path} has no tokenizer.ggml.tokens: no tokenizer to build")
    bos, eos = (
        gguf_field(path, "tokenizer.ggml.bos_token_id"),
        gguf_field(path, "tokenizer.ggml.eos_token_id"),
    )
    return GGUFVocab(
        model=str(gguf_field(path, "tokenizer.ggml.model", "")),
        pre=str(gguf_field(path, "tokenizer.ggml.pre", "default")),
        tokens=list(tokens),
        token_types=list(gguf_field(path, "tokenizer.ggml.token_type") or []),
        merges=list(gguf_field(path, "tokenizer.ggml.merges") or []),
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
        chat_template=gguf_field(path, "tokenizer.chat_template"),
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def build_backend(vocab: GGUFVocab) -> Any:
    """A ``tokenizers.Tokenizer`` equal to the one transformers builds from this metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    if vocab.model != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {vocab.model!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    if vocab.pre not in _SPLITS:
        raise ValueError(
            f"GGUF pre-tokenizer {vocab.pre!r} is not supported (known: {', '.join(_SPLITS)})"
        )
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # NOTE: a token written outside the byte alphabet (rare mislabels) is respelled
    # byte by byte, as transformers does, so its id stays reachable.
    ids = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(vocab.tokens)
    }
    merges: list[tuple[str, str]] = []
    for m in vocab.merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ValueError(f"malformed GGUF merge {m!r}: expected two tokens")
        merges.append((left, right))
    tok = Tokenizer(
        BPE(
            vocab=ids,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _SPLITS[vocab.pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    # NOTE: control tokens (<|im_start|>, <|endoftext|>, ...) match whole in text and
    # are skipped on decode; one spelled outside the byte alphabet is a llama.cpp
    # mislabel that transformers skips too.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(vocab.tokens, vocab.token_types, strict=False)
        if kind == _CONTROL and set(t) <= alphabet
    ]
    tok.add_special_tokens(control)
    return tok


_NAME_JUNK = re.compile(r"[^a-z0-9._-]+")


def normalize_model_name(name: str) -> str:
    """A model id from a free-form name: lower case, runs of other characters -> ``-``."""
    out = _NAME_JUNK.sub("-", name.strip().lower()).strip("-")
    if not out:
        raise ValueError(f"cannot make a model id from {name!r}")
    return out


def gguf_model_name(path: Path | str) -> str:
    """The model id a GGUF file names itself by (``general.name``, else the file stem)."""
    name = gguf_field(path, "general.name")
    return normalize_model_name(str(name) if name else Path(path).stem)
