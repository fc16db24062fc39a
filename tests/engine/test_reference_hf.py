"""The engine against transformers' own models (the outside reference, test-only).

Each case builds a tiny random model in transformers, saves it with ``save_pretrained``
(config.json as transformers 5 writes it, safetensors), loads that folder the way a
replica's ``--model-dir`` does, and compares the logits with transformers' forward.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from cachepoint.engine import BlockAllocator, Engine, EngineConfig, PrefillRequest
from cachepoint.replica import cli

from .helpers import random_prompt

ABS_TOL = 1e-4  # max absolute logit difference, float32
CPU = EngineConfig(device="cpu", kv_cache_bytes=8 << 20)
SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 320,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Rope variants by name, as transformers 5 takes them (rope_parameters). Each has a
# non-default base; llama3's original length (64) is inside the prompts, so its
# smoothed and its stretched frequencies both act.
ROPES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 100000.0},
    "linear": {"rope_type": "linear", "rope_theta": 50000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere, biases and norms included.

    NOTE: transformers initialises biases to zero and norms to one; a loader that
    dropped either would still match. Large enough weights that attention is sharp,
    so a wrong rope base moves the logits far past the tolerance.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.08 * noise)


def save_reference(folder: Path, model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Randomise ``model``, save it as a HF folder (with a tokenizer.json), return it."""
    randomize(model, seed)
    model.eval()
    model.save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.save(str(folder / "tokenizer.json"))
    return model


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(torch.tensor([ids])).logits[0].float()
    return out


def engine_logits(engine: Engine, ids: list[int], cached: int = 0) -> torch.Tensor:
    """Logits of positions ``cached..`` (the first ``cached`` are prefilled before)."""
    table = BlockAllocator(engine.num_blocks)(-(-len(ids) // engine.block_size))
    if cached:
        engine.prefill([PrefillRequest(ids[:cached], table, 0)])
    out = engine.prefill([PrefillRequest(ids, table, cached)], all_logits=True)
    assert out.prefill_all_logits is not None
    return out.prefill_all_logits[0]


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def to_v4_layout(hf: dict[str, Any]) -> dict[str, Any]:
    """A transformers 5 config rewritten as transformers 4 wrote it."""
    out = {k: v for k, v in hf.items() if k != "rope_parameters"}
    params = dict(hf["rope_parameters"])
    out["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    # NOTE: early v4 checkpoints spelled the key "type"; both must load.
    out["rope_scaling"] = None if kind == "default" else {"type": kind, **params}
    return out


@pytest.mark.parametrize("layout", ["v5", "v4"])
@pytest.mark.parametrize("rope", list(ROPES))
def test_llama_matches_transformers_in_both_config_layouts(
    tmp_path: Path, rope: str, layout: str
) -> None:
    config = LlamaConfig(**SHAPE, rope_parameters=dict(ROPES[rope]))
    ref = save_reference(tmp_path, LlamaForCausalLM(config), seed=11)
    written = json.loads((tmp_path / "config.json").read_text())
    # The trap: transformers 5 has no top-level rope_theta.
    assert "rope_theta" not in written
    assert written["rope_parameters"]["rope_theta"] == ROPES[rope]["rope_theta"]
    if layout == "v4":
        (tmp_path / "config.json").write_text(json.dumps(to_v4_layout(written)))

    engine = Engine(config=CPU, model_dir=tmp_path)
    assert engine.model_config.rope_theta == ROPES[rope]["rope_theta"]
    ids = random_prompt(5, 150, SHAPE["vocab_size"])
    want = hf_logits(ref, ids)
    assert max_abs(engine_logits(engine, ids), want) <= ABS_TOL
    # The check has teeth: the same weights under plain RoPE at base 10,000 (what the
    # engine served before it read rope_parameters) are far off.
    wrong = LlamaForCausalLM(LlamaConfig(**SHAPE))
    wrong.load_state_dict(ref.state_dict())
    assert max_abs(hf_logits(wrong.eval(), ids), want) > 100 * ABS_TOL


@pytest.mark.parametrize(
    ("rope_parameters", "kind"),
    [
        ({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, "yarn"),
        ({"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}, "dynamic"),
        ({"rope_type": "mystery", "rope_theta": 1e6}, "mystery"),
    ],
)
def test_unsupported_rope_type_is_refused_by_name(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    rope_parameters: dict[str, Any],
    kind: str,
) -> None:
    hf = {
        **LlamaConfig(**SHAPE).to_dict(),
        "architectures": ["LlamaForCausalLM"],
        "rope_parameters": rope_parameters,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    message = rf"unsupported rope_type '{kind}' \(supported: default, linear, llama3\)"
    with pytest.raises(ValueError, match=message):
        Engine(config=CPU, model_dir=tmp_path)
    # A replica pointed at the folder exits with that message, not a traceback.
    with pytest.raises(SystemExit) as exited:
        cli.main(["--model-dir", str(tmp_path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"unsupported rope_type '{kind}'" in err
    assert "Traceback" not in err


def qwen2_reference(folder: Path, tied: bool) -> torch.nn.Module:
    config = Qwen2Config(
        **SHAPE,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    return save_reference(folder, Qwen2ForCausalLM(config), seed=23)


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_matches_transformers_with_and_without_a_cached_prefix(
    tmp_path: Path, tied: bool
) -> None:
    ref = qwen2_reference(tmp_path, tied)
    engine = Engine(config=CPU, model_dir=tmp_path)
    c = engine.model_config
    assert (c.model_type, c.qkv_bias, c.tie_word_embeddings) == ("qwen2", True, tied)
    ids = random_prompt(7, 120, SHAPE["vocab_size"])
    want = hf_logits(ref, ids)
    full = engine_logits(engine, ids)
    assert max_abs(full, want) <= ABS_TOL
    # Reuse equals recompute: positions 48.. with 48 tokens (3 blocks) from the pool.
    reused = engine_logits(engine, ids, cached=48)
    assert max_abs(reused, want[48:]) <= ABS_TOL
    assert max_abs(reused, full[48:]) <= ABS_TOL
    # The biases matter: without them the logits are far off.
    unbiased = Qwen2ForCausalLM(ref.config)
    unbiased.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for name, p in unbiased.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
    assert max_abs(hf_logits(unbiased.eval(), ids), want) > 100 * ABS_TOL


def test_qwen2_tensor_parallel_shards_the_biases(tmp_path: Path) -> None:
    ref = qwen2_reference(tmp_path, tied=True)
    ids = random_prompt(8, 70, SHAPE["vocab_size"])
    tp2 = EngineConfig(
        device="cpu", kv_cache_bytes=8 << 20, tensor_parallel_size=2, dist_timeout_s=60
    )
    with Engine(config=tp2, model_dir=tmp_path) as engine:
        assert engine.runner.model.model.layers[0].self_attn.q_proj.bias.shape == (32,)
        got = engine_logits(engine, ids)
        reused = engine_logits(engine, ids, cached=32)
    want = hf_logits(ref, ids)
    assert max_abs(got, want) <= ABS_TOL
    assert max_abs(reused, want[32:]) <= ABS_TOL
