"""The model against an independent reference, and loading a HF checkpoint folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cachepoint.engine import (
    BlockAllocator,
    Engine,
    EngineConfig,
    HFTokenizer,
    ModelConfig,
    PrefillRequest,
)
from cachepoint.engine.model import build_model
from cachepoint.engine.rotary import inverse_frequencies
from cachepoint.engine.weights import RandomWeights

from .helpers import max_rel_err

CPU = EngineConfig(device="cpu", kv_cache_bytes=8 << 20)


def reference_logits(c: ModelConfig, w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Dense, cache-free Llama forward written straight from the HF modelling code."""

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    t, d = len(ids), c.head_dim
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(t).float(), inv_freq)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    causal = torch.full((t, t), float("-inf")).triu(1)
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(t, c.num_heads, d).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(t, c.num_kv_heads, d).transpose(0, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, c.num_kv_heads, d).transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        groups = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d) + causal, -1) @ v
        x = x + att.transpose(0, 1).reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"]
    return x @ head.T


@pytest.mark.parametrize("tied", [False, True])
def test_model_matches_dense_reference(tied: bool) -> None:
    c = ModelConfig.tiny(tie_word_embeddings=tied)
    engine = Engine(c, CPU, seed=5)
    ids = list(range(0, 250, 7))
    table = BlockAllocator(engine.num_blocks)(3)
    out = engine.prefill([PrefillRequest(ids, table, 0)], all_logits=True)
    assert out.prefill_all_logits is not None
    ref = reference_logits(c, RandomWeights(c, seed=5).state_dict(), ids)
    assert max_rel_err(out.prefill_all_logits[0], ref) <= 1e-4


def test_model_random_weights_depend_on_the_seed() -> None:
    c = ModelConfig.tiny()
    ids = [1, 2, 3, 4, 5]
    logits = [
        Engine(c, CPU, seed=s).prefill([PrefillRequest(ids, [0], 0)]).prefill_logits
        for s in (1, 1, 2)
    ]
    assert torch.equal(logits[0], logits[1])
    assert not torch.allclose(logits[0], logits[2])


def test_rotary_llama3_scaling_keeps_high_and_divides_low_frequencies() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    plain = inverse_frequencies(128, 500000.0, None)
    scaled = inverse_frequencies(128, 500000.0, scaling)
    assert torch.equal(scaled[:10], plain[:10])  # short wavelengths untouched
    assert torch.allclose(scaled[-5:], plain[-5:] / 8.0)  # long ones stretched 8x
    with pytest.raises(ValueError, match="unsupported rope_scaling"):
        inverse_frequencies(128, 500000.0, {"rope_type": "yarn", "factor": 2.0})


def write_checkpoint(folder: Path, c: ModelConfig, seed: int, shards: int = 1) -> None:
    """A HF-style folder: config.json, *.safetensors, tokenizer.json (+ its config)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(c.to_hf_config()))
    weights = RandomWeights(c, seed).state_dict()
    names = sorted(weights)
    for i in range(shards):
        part = {n: weights[n].contiguous() for n in names[i::shards]}
        save_file(part, str(folder / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the cache keeps the prefix", "prefill reads cached blocks", "hello world"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )


@pytest.mark.parametrize(("shards", "tied"), [(1, False), (3, True)])
def test_model_loads_hf_checkpoint_folder_with_same_logits(
    tmp_path: Path, shards: int, tied: bool
) -> None:
    c = ModelConfig.tiny(vocab_size=320, tie_word_embeddings=tied)
    write_checkpoint(tmp_path / "ckpt", c, seed=9, shards=shards)
    loaded = Engine(config=CPU, model_dir=tmp_path / "ckpt")
    in_memory = Engine(c, CPU, seed=9)
    assert loaded.model_config == c

    assert isinstance(loaded.tokenizer, HFTokenizer)
    text = "the cache keeps the prefill"
    ids = loaded.tokenizer.encode(text)
    assert loaded.tokenizer.decode(ids) == text
    assert len(ids) < len(text)  # merges were learned and used
    assert loaded.eos_id == loaded.tokenizer.special_id("</s>") == 2
    assert loaded.tokenizer.bos_id == 1

    table = BlockAllocator(loaded.num_blocks)(2)
    got = loaded.prefill([PrefillRequest(ids, table, 0)]).prefill_logits
    want = in_memory.prefill([PrefillRequest(ids, table, 0)]).prefill_logits
    assert torch.equal(got, want)


def test_model_checkpoint_with_a_missing_weight_is_refused(tmp_path: Path) -> None:
    c = ModelConfig.tiny(vocab_size=320)
    write_checkpoint(tmp_path, c, seed=1)
    weights = RandomWeights(c, 1).state_dict()
    del weights["model.layers.1.mlp.up_proj.weight"]
    for old in tmp_path.glob("*.safetensors"):
        old.unlink()
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=r"layers\.1\.mlp\.up_proj"):
        Engine(config=CPU, model_dir=tmp_path)


def test_model_build_model_from_a_seed_equals_the_engines_weights() -> None:
    c = ModelConfig.tiny()
    model = build_model(c, 5)
    engine = Engine(c, CPU, seed=5)
    theirs = dict(engine.runner.model.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, theirs[name]), name


def test_engine_stops_on_generation_config_eos_ids_too(tmp_path: Path) -> None:
    c = ModelConfig.tiny(vocab_size=320, eos_token_ids=(2, 5))
    write_checkpoint(tmp_path / "ckpt", c, seed=9)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["eos_token_id"] == [2, 5]
    assert Engine(config=CPU, model_dir=tmp_path / "ckpt").eos_ids == {2, 5}
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert Engine(config=CPU, model_dir=tmp_path / "ckpt").eos_ids == {2, 5, 7}
