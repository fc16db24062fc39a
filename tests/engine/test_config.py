"""Model config parsing, device and dtype choice."""

from __future__ import annotations

import pytest
import torch

from cachepoint.engine import ModelConfig
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


def test_config_rejects_non_llama_and_biased_checkpoints() -> None:
    with pytest.raises(ValueError, match="not a Llama"):
        ModelConfig.from_hf_config({**LLAMA_3_2_1B, "model_type": "gpt2", "architectures": []})
    with pytest.raises(ValueError, match="biases"):
        ModelConfig.from_hf_config({**LLAMA_3_2_1B, "attention_bias": True})


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
