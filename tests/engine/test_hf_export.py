"""The HF folders the vLLM replica loads: the torch engine's own weights, written so
that transformers (the outside reference) computes the same logits from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from cachepoint.engine import Engine, EngineConfig, ModelConfig
from cachepoint.engine.hf_export import exported_checkpoint
from cachepoint.engine.weights import RandomWeights

from .test_reference_hf import engine_logits, hf_logits

IDS = [5, 17, 200, 33, 9, 81, 120, 7, 64, 3, 99, 250, 11, 2, 8, 40, 1, 77]


def test_an_exported_random_model_is_the_same_model_to_transformers(tmp_path: Path) -> None:
    config = ModelConfig.tiny(
        vocab_size=264,
        num_layers=2,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
    )
    folder = exported_checkpoint(tmp_path, "random:7", config, RandomWeights(config, 7))
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "float32"
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ours = Engine(config, EngineConfig(kv_cache_bytes=8 * 2**20, max_model_len=256), seed=7)
    diff = (engine_logits(ours, IDS) - hf_logits(ref, IDS)).abs().max()
    assert float(diff) < 1e-4


def test_an_export_is_written_once_and_whole(tmp_path: Path) -> None:
    config = ModelConfig.tiny()
    first = exported_checkpoint(tmp_path, "random:1", config, RandomWeights(config, 1))
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = exported_checkpoint(tmp_path, "random:1", config, RandomWeights(config, 1))
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp
    other = exported_checkpoint(tmp_path, "random:2", config, RandomWeights(config, 2))
    assert other != first
    # Nothing half-written is left beside them.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])


def test_a_source_missing_a_weight_fails_and_leaves_nothing(tmp_path: Path) -> None:
    class Partial:
        def get(self, name: str, rank: int, world: int) -> torch.Tensor | None:
            return None if name == "model.norm.weight" else torch.zeros(1)

    with pytest.raises(ValueError, match=r"no model\.norm\.weight"):
        exported_checkpoint(tmp_path, "partial", ModelConfig.tiny(), Partial())
    assert list(tmp_path.iterdir()) == []
