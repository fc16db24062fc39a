"""The random-weight model's tokenizer choice and context length.

Torch-free: the replica's settings and the embedded stack resolve these before any
engine is built (the stack hands the same tokenizer and context to the gateway).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from cachepoint.replica.model_source import MODEL_PRESETS, preset_path
from cachepoint.tokenizer import Tokenizer, load_tokenizer
from cachepoint.tokenizer.gguf_vocab import is_gguf

# Positions of the random presets (2**18). NOTE: long enough that real prompts of tens
# of thousands of BPE tokens fit; random weights have no trained length to respect,
# and nothing in the engine is sized by it (rotary angles are computed per forward;
# the KV pool is sized by its budget, see random_context).
RANDOM_CONTEXT = 2**18

BYTES = "bytes"  # the built-in byte tokenizer: one id per UTF-8 byte, plus role tokens
# What --tokenizer accepts besides a path: bytes, or a named model's tokenizer.
TOKENIZER_CHOICES = (BYTES, *MODEL_PRESETS)


def tokenizer_source(value: str) -> Path | None:
    """The file or folder whose tokenizer the random model uses; None for bytes.

    ``value`` is ``bytes``, a named model (``smollm2``: its GGUF's BPE tokenizer), a
    ``.gguf`` file, or a Hugging Face folder holding ``tokenizer.json``. Raises
    ``ValueError`` saying what is wrong (a missing model names how to install it).
    """
    if value == BYTES:
        return None
    if value in MODEL_PRESETS:
        return preset_path(value)
    path = Path(value).expanduser()
    if is_gguf(path):
        if not path.is_file():
            raise ValueError(f"tokenizer {value!r}: {path} is not a file")
        return path
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer {value!r}: {path} has no tokenizer.json")
        return path
    raise ValueError(
        f"tokenizer {value!r} is none of {', '.join(TOKENIZER_CHOICES)}, a .gguf file or a "
        "folder with tokenizer.json"
    )


def random_context(
    max_positions: int, kv_bytes_per_token: int, kv_budget_bytes: int, block_size: int
) -> int:
    """The random model's max_model_len on the CPU: its positions, or fewer when the KV
    budget cannot hold one sequence that long.

    NOTE: the engine sizes its pool to hold at least one max_model_len sequence and
    refuses to start otherwise. At 2**18 positions that rule would turn every small
    ``--kv-budget`` (tests and benchmarks use 16-64 MiB) into a start-up error, or a
    huge pool; a random model has no trained length to honour, so its context shrinks
    to what the budget holds instead (the tiny model's 512 bytes per token: 2**18
    positions need 128 MiB, within the default 256 MiB).
    """
    per_block = kv_bytes_per_token * block_size
    held = (kv_budget_bytes // per_block) * block_size
    return max(block_size, min(max_positions, held))


@cache
def load_random_tokenizer(source: Path | None) -> Tokenizer:
    """The tokenizer ``tokenizer_source`` named (bytes for None), loaded once per process.

    NOTE: cached because the CLI loads it to check it before the app builds its engine:
    SmolLM2's GGUF vocabulary takes about 2 s to read.
    """
    return load_tokenizer(source)
