"""The Hugging Face folder vLLM loads, and what the shim reads from it.

- an HF folder (``--model-dir``): vLLM loads it as it is; whatever vLLM serves works;
- a GGUF file (``--model``, ``--model-dir x.gguf``): vLLM's CPU build has no kernels for
  GGUF's quantized types, so the file is dequantized to float32 once (the torch
  engine's own loader) and exported as an HF folder;
- random weights: the torch engine's seeded weights for the preset, exported once, so
  both engines serve the very same model.

The shim itself never needs the model's architecture: it takes the tokenizer (for
text and stop strings) and the EOS ids from the checkpoint, and the KV geometry from
vLLM once it has started.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cachepoint.engine.config import ModelConfig, generation_eos_ids
from cachepoint.engine.gguf_loader import GGUFWeights, read_gguf_config
from cachepoint.engine.hf_export import exported_checkpoint
from cachepoint.engine.weights import RandomWeights
from cachepoint.replica.random_config import random_model
from cachepoint.replica.random_model import load_random_tokenizer
from cachepoint.replica.settings import ReplicaSettings
from cachepoint.tokenizer import Tokenizer, load_tokenizer
from cachepoint.tokenizer.gguf_vocab import is_gguf


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What the vLLM replica serves."""

    folder: Path  # the HF folder vLLM loads
    tokenizer: Tokenizer  # ours: text for streaming, stop strings
    eos_ids: frozenset[int]  # every id that ends a turn
    eos_id: int | None  # the one the random model "samples" to end its turn
    vocab_size: int  # embeddings (token ids must be below it)
    random: bool  # random weights (their turns end by random_turn_tokens)


def prepare(settings: ReplicaSettings) -> Checkpoint:
    """The checkpoint for ``settings``, exporting it first where vLLM cannot load it."""
    if settings.model_dir is None:
        return _random(settings)
    src = Path(settings.model_dir)
    if is_gguf(src):
        return _gguf(src, settings.export_dir)
    return _folder(src)


def _random(settings: ReplicaSettings) -> Checkpoint:
    tokenizer = load_random_tokenizer(settings.tokenizer_path)
    config = random_model(settings.model_preset, tokenizer)
    # NOTE: the whole config is part of the name: another tokenizer (vocabulary) or
    # preset is another model, never a stale export of the last one.
    source = f"random:{settings.seed}:{json.dumps(config.to_hf_config(), sort_keys=True)}"
    folder = exported_checkpoint(
        settings.export_dir, source, config, RandomWeights(config, settings.seed)
    )
    return _checkpoint(folder, tokenizer, config, random=True)


def _gguf(path: Path, export_dir: Path) -> Checkpoint:
    config = read_gguf_config(path)
    stat = path.stat()
    source = f"gguf:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    folder = exported_checkpoint(export_dir, source, config, GGUFWeights(path, config))
    return _checkpoint(folder, load_tokenizer(path), config, random=False)


def _folder(folder: Path) -> Checkpoint:
    tokenizer = load_tokenizer(folder)
    hf = json.loads((folder / "config.json").read_text())
    # NOTE: read from the raw config, not ModelConfig: vLLM serves families the torch
    # engine does not, and the shim needs only these two facts of the model.
    eos = hf.get("eos_token_id")
    eos_ids = {*(eos if isinstance(eos, list) else [eos]), *generation_eos_ids(folder)}
    eos_ids.add(tokenizer.eos_id)
    vocab = int(hf.get("vocab_size") or hf.get("text_config", {}).get("vocab_size") or 0)
    return Checkpoint(
        folder=folder,
        tokenizer=tokenizer,
        eos_ids=frozenset(i for i in eos_ids if isinstance(i, int)),
        eos_id=tokenizer.eos_id,
        vocab_size=vocab or tokenizer.vocab_size,
        random=False,
    )


def _checkpoint(
    folder: Path, tokenizer: Tokenizer, config: ModelConfig, *, random: bool
) -> Checkpoint:
    ids = {tokenizer.eos_id, *config.eos_token_ids}
    return Checkpoint(
        folder=folder,
        tokenizer=tokenizer,
        eos_ids=frozenset(i for i in ids if i is not None),
        eos_id=tokenizer.eos_id if tokenizer.eos_id is not None else config.eos_token_id,
        vocab_size=config.vocab_size,
        random=random,
    )
