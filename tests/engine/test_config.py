"""Model config parsing, device and dtype choice."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cachepoint.engine import ModelConfig
from cachepoint.engine.config import generation_eos_ids
from cachepoint.engine.device import resolve_device, resolve_dtype

LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}


def test_config_from_hf_llama_config() -> None:
    c = ModelConfig.from_hf_config(LLAMA_3_2_1B)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (16, 2048, 32, 8)
    assert c.head_dim == 64
    assert c.dtype == "bfloat16"
    assert c.tie_word_embeddings
    assert c.eos_token_id == 128001
    assert c.kv_bytes_per_token() == 2 * 16 * 8 * 64 * 2
    assert c.kv_bytes_per_token("float32", tp_size=2) == 2 * 16 * 4 * 64 * 4
    again = ModelConfig.from_hf_config(c.to_hf_config())
    assert again == c


def test_config_derives_head_dim_and_validates_shapes() -> None:
    assert ModelConfig.tiny().head_dim == 16
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.tiny(num_kv_heads=3)
    with pytest.raises(ValueError, match="unsupported dtype"):
        ModelConfig.tiny(dtype="int8")


def test_config_rejects_other_families_and_biased_llamas() -> None:
    supported = r"\(supported: LlamaForCausalLM, Qwen2ForCausalLM\)"
    with pytest.raises(ValueError, match=rf"model_type 'gpt2', architectures \[\] {supported}"):
        ModelConfig.from_hf_config({**LLAMA_3_2_1B, "model_type": "gpt2", "architectures": []})
    mistral = {**LLAMA_3_2_1B, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    with pytest.raises(ValueError, match="unsupported architecture: model_type 'mistral'"):
        ModelConfig.from_hf_config(mistral)
    with pytest.raises(ValueError, match="biases"):
        ModelConfig.from_hf_config({**LLAMA_3_2_1B, "attention_bias": True})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf_config({**LLAMA_3_2_1B, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="lacks 'hidden_size'"):
        ModelConfig.from_hf_config({k: v for k, v in LLAMA_3_2_1B.items() if k != "hidden_size"})


# Qwen2.5-0.5B-Instruct's config.json as published (transformers 4 layout).
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_config_reads_qwen2_and_refuses_its_sliding_window() -> None:
    c = ModelConfig.from_hf_config(QWEN2_5_0_5B)
    assert (c.model_type, c.qkv_bias, c.head_dim, c.rope_theta) == ("qwen2", True, 64, 1e6)
    assert c.tie_word_embeddings
    # Qwen2.5-0.5B has 494,032,768 parameters (tied embeddings, q/k/v biases).
    assert c.num_parameters() == 494_032_768
    assert ModelConfig.from_hf_config(c.to_hf_config()) == c
    sliding = {**QWEN2_5_0_5B, "use_sliding_window": True}
    with pytest.raises(ValueError, match="sliding-window attention"):
        ModelConfig.from_hf_config(sliding)
    # Sliding layers start at max_window_layers: none when it covers every layer.
    assert ModelConfig.from_hf_config({**sliding, "max_window_layers": 24}).qkv_bias
    v5_types = {**QWEN2_5_0_5B, "layer_types": ["full_attention"] * 23 + ["sliding_attention"]}
    with pytest.raises(ValueError, match="sliding-window attention"):
        ModelConfig.from_hf_config(v5_types)


def test_config_reads_the_rope_base_and_scaling_of_both_layouts() -> None:
    v4 = ModelConfig.from_hf_config(LLAMA_3_2_1B)
    v5_layout = {k: v for k, v in LLAMA_3_2_1B.items() if k not in ("rope_theta", "rope_scaling")}
    rope_parameters = {"rope_theta": 500000.0, **LLAMA_3_2_1B["rope_scaling"]}  # type: ignore[dict-item]
    v5 = ModelConfig.from_hf_config({**v5_layout, "rope_parameters": rope_parameters})
    assert v4 == v5
    assert (v5.rope_theta, v5.rope_scaling) == (500000.0, LLAMA_3_2_1B["rope_scaling"])
    # Plain RoPE in the v5 layout: only the base, no scaling.
    plain = ModelConfig.from_hf_config(
        {**v5_layout, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
    )
    assert (plain.rope_theta, plain.rope_scaling) == (100000.0, None)
    # v4's older spelling "type"; llama3's original length falls back like transformers'.
    legacy = ModelConfig.from_hf_config(
        {**LLAMA_3_2_1B, "rope_scaling": {"type": "linear", "factor": 2}}
    )
    assert legacy.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    no_len = {k: v for k, v in rope_parameters.items() if k != "original_max_position_embeddings"}
    fallback = ModelConfig.from_hf_config({**v5_layout, "rope_parameters": no_len})
    assert fallback.rope_scaling is not None
    assert fallback.rope_scaling["original_max_position_embeddings"] == 131072


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
            r"unsupported rope_type 'yarn' \(supported: default, linear, llama3\)",
        ),
        (
            {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
            r"unsupported rope_type 'dynamic' \(supported: default, linear, llama3\)",
        ),
        ({"rope_parameters": {"rope_type": "linear"}}, "rope_type 'linear' needs 'factor'"),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "default"}}},
            "per-layer-type rope_parameters",
        ),
    ],
)
def test_config_refuses_rope_it_cannot_compute(rope: dict[str, object], message: str) -> None:
    base = {k: v for k, v in LLAMA_3_2_1B.items() if k != "rope_scaling"}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**base, **rope})
    # A config built in code is checked the same way.
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        ModelConfig.tiny(rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_config_parameter_count_matches_a_known_model() -> None:
    # Llama 3.2 1B has 1.236B parameters (tied embeddings).
    assert ModelConfig.from_hf_config(LLAMA_3_2_1B).num_parameters() == 1_235_814_400


def test_device_and_dtype_resolution_on_cpu() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(RuntimeError, match="is_available"):
            resolve_device("cuda")


def test_config_keeps_every_eos_id_of_config_and_generation_config() -> None:
    c = ModelConfig.from_hf_config(LLAMA_3_2_1B)
    assert c.eos_token_id == 128001
    assert c.eos_token_ids == (128001, 128008, 128009)
    # generation_config.json's ids join (once each), after config.json's.
    gen = {"eos_token_id": [128009, 128256 - 1]}
    both = ModelConfig.from_hf_config(LLAMA_3_2_1B, gen)
    assert both.eos_token_ids == (128001, 128008, 128009, 128255)
    only_gen = ModelConfig.from_hf_config(
        {**LLAMA_3_2_1B, "eos_token_id": None}, {"eos_token_id": 7}
    )
    assert (only_gen.eos_token_id, only_gen.eos_token_ids) == (7, (7,))
    single = ModelConfig.from_hf_config({**LLAMA_3_2_1B, "eos_token_id": 5})
    assert (single.eos_token_id, single.eos_token_ids) == (5, (5,))
    # Written back as the list, read back the same.
    assert c.to_hf_config()["eos_token_id"] == [128001, 128008, 128009]
    assert ModelConfig.from_hf_config(c.to_hf_config()) == c
    with pytest.raises(ValueError, match="eos_token_id"):
        ModelConfig.from_hf_config({**LLAMA_3_2_1B, "eos_token_id": ["</s>"]})


def test_config_eos_token_id_stays_first_of_the_ids() -> None:
    c = ModelConfig.tiny(eos_token_ids=(9, 4, 9))
    assert (c.eos_token_id, c.eos_token_ids) == (9, (9, 4))
    moved = replace(c, eos_token_id=4)
    assert moved.eos_token_ids == (4, 9)
    assert ModelConfig.tiny().eos_token_ids == ()


def test_generation_config_eos_ids(tmp_path: Path) -> None:
    assert generation_eos_ids(tmp_path) == ()
    assert generation_eos_ids(None) == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    assert generation_eos_ids(tmp_path) == (2, 3)
