"""Write a model as a Hugging Face checkpoint folder (``config.json`` + safetensors).

Other engines load HF folders: the vLLM replica hands vLLM the same weights the torch
engine serves, whether they came from the seeded random source or a GGUF file (vLLM's
CPU build cannot run GGUF's quantized kernels, so GGUF is dequantized to float32
here, exactly as the torch engine does).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from cachepoint.engine.config import ModelConfig
from cachepoint.engine.weights import WeightSource, hf_weight_shapes

EXPORT_VERSION = "1"  # bump when what is written changes: old exports are rewritten


def write_hf_checkpoint(folder: Path, config: ModelConfig, weights: WeightSource) -> None:
    """Write ``config`` and every weight it names (in float32) into ``folder``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name in hf_weight_shapes(config):
        t = weights.get(name, 0, 1)
        if t is None:
            raise ValueError(f"the weight source has no {name}")
        tensors[name] = t.to(torch.float32).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_hf_config()
    hf["torch_dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(hf, indent=1) + "\n")
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")


def exported_checkpoint(
    cache_dir: Path, source_id: str, config: ModelConfig, weights: WeightSource
) -> Path:
    """The HF folder for ``source_id`` under ``cache_dir``, written once and reused.

    ``source_id`` names the weights (a file's path, size and mtime; a preset and seed).
    The folder appears whole or not at all (written aside, then renamed), so a replica
    killed mid-export never leaves a half checkpoint behind for the next start.
    """
    digest = hashlib.sha256(f"{EXPORT_VERSION}\0{source_id}".encode()).hexdigest()[:20]
    final = cache_dir / digest
    if (final / "config.json").is_file() and (final / "model.safetensors").is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=cache_dir))
    try:
        write_hf_checkpoint(tmp, config, weights)
        (tmp / "SOURCE").write_text(source_id + "\n")
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent writer's win
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
