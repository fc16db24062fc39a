"""GGUF checkpoints without the 98 MB model: a tiny random Llama written as llama.cpp would.

The file is written with the ``gguf`` package's writer, Q/K rows permuted exactly as
llama.cpp's ``convert_hf_to_gguf.py`` does, so an engine loaded from it must equal the
engine built from the same random weights directly.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from cachepoint.engine import BlockAllocator, Engine, EngineConfig, ModelConfig, PrefillRequest
from cachepoint.engine.gguf_loader import (
    GGUFWeights,
    gguf_tensor_name,
    read_gguf_config,
    unpermute_rotary_rows,
)
from cachepoint.engine.weights import RandomWeights, hf_weight_shapes
from cachepoint.replica.model_source import preset_path
from cachepoint.tokenizer import load_tokenizer
from cachepoint.tokenizer.gguf_vocab import gguf_model_name

CPU = EngineConfig(device="cpu", dtype="float32", kv_cache_bytes=8 << 20)
SEED = 77
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` (HF halves -> interleaved)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def byte_alphabet() -> list[str]:
    from cachepoint.tokenizer.gguf_vocab import _bytes_to_unicode

    return list(_bytes_to_unicode().values())


def tiny_config() -> ModelConfig:
    vocab = len(SPECIALS) + 256 + len(MERGES)
    return ModelConfig.tiny(
        vocab_size=vocab, tie_word_embeddings=True, rope_theta=50000.0, rms_norm_eps=1e-6
    )


def write_tiny_gguf(
    path: Path, config: ModelConfig, *, permute: bool = True, eot_eom: tuple[int, int] | None = None
) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("Tiny Test Llama 2x64")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    tokens = SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if eot_eom is not None:
        writer.add_eot_token_id(eot_eom[0])
        writer.add_eom_token_id(eot_eom[1])
    source = RandomWeights(config, SEED)
    for name in hf_weight_shapes(config):
        w = source.full(name).numpy()
        if permute and name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, config.num_heads)
        if permute and name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, config.num_kv_heads)
        gname = gguf_tensor_name(name)
        assert gname is not None
        writer.add_tensor(gname, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_config())


def test_unpermute_is_the_exact_inverse_of_llama_cpp() -> None:
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for n_head in (1, 2, 3):
        permuted = llama_cpp_permute(w, n_head)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(unpermute_rotary_rows(permuted, n_head), w)


def test_config_from_metadata(tiny_gguf: Path) -> None:
    got = read_gguf_config(tiny_gguf)
    # NOTE: GGUF stores the epsilon as float32, so it comes back float32-rounded.
    assert got.rms_norm_eps == pytest.approx(1e-6, rel=1e-6)
    want = replace(tiny_config(), rms_norm_eps=got.rms_norm_eps, bos_token_id=1, eos_token_id=2)
    assert got == want
    assert gguf_model_name(tiny_gguf) == "tiny-test-llama-2x64"


def test_config_takes_every_eos_id_of_the_file(tiny_gguf: Path, tmp_path: Path) -> None:
    assert read_gguf_config(tiny_gguf).eos_token_ids == (2,)
    both = write_tiny_gguf(tmp_path / "eot.gguf", tiny_config(), eot_eom=(5, 6))
    got = read_gguf_config(both)
    assert (got.eos_token_id, got.eos_token_ids) == (2, (2, 5, 6))
    assert Engine(config=EngineConfig(device="cpu"), model_dir=both).eos_ids == {2, 5, 6}
    smollm2 = read_gguf_config(preset_path("smollm2"))
    assert (smollm2.eos_token_id, smollm2.eos_token_ids) == (2, (2,))


def test_weights_by_hf_name_and_tp_shards(tiny_gguf: Path) -> None:
    config = tiny_config()
    ours, ref = GGUFWeights(tiny_gguf, config), RandomWeights(config, SEED)
    for name in hf_weight_shapes(config):
        for rank, world in ((0, 1), (0, 2), (1, 2)):
            got, want = ours.get(name, rank, world), ref.get(name, rank, world)
            assert got is not None and want is not None
            assert torch.equal(got, want), (name, rank, world)
    assert ours.get("lm_head.weight", 0, 1) is None  # tied: the file has no output.weight
    assert ours.get("model.layers.0.self_attn.q_proj.bias", 0, 1) is None


def _last_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    table = BlockAllocator(engine.num_blocks)(-(-len(ids) // engine.block_size))
    return engine.prefill([PrefillRequest(ids, table, 0)]).prefill_logits[0]


def test_engine_from_gguf_equals_engine_from_the_same_weights(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    ids = [5, 77, 190, 3, 250, 12, 9, 100, 42, 7, 8, 200, 1, 33, 44, 55, 66, 77]
    with (
        Engine(tiny_config(), CPU, seed=SEED) as direct,
        Engine(config=CPU, model_dir=tiny_gguf) as loaded,
    ):
        assert loaded.model_config.num_layers == direct.model_config.num_layers
        want = _last_logits(direct, ids)
        assert torch.allclose(_last_logits(loaded, ids), want, atol=1e-6, rtol=0)
    # Regression guard: a loader that skipped the un-permutation would be this wrong.
    raw = write_tiny_gguf(tmp_path / "unpermuted.gguf", tiny_config(), permute=False)
    with Engine(config=CPU, model_dir=raw) as wrong:
        assert float((_last_logits(wrong, ids) - want).abs().max()) > 1e-3


def test_tokenizer_from_gguf_metadata(tiny_gguf: Path) -> None:
    tok = load_tokenizer(tiny_gguf)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, tiny_config().vocab_size)
    text = "<|im_start|>the cat in the hat 🤖<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-1] == 2
    assert len(SPECIALS) + 256 + 2 in ids  # the merged " the"
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "the cat in the hat 🤖"


def test_unsupported_gguf_is_refused(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported"):
        read_gguf_config(tmp_path / "m.gguf")


def test_tp2_engine_from_gguf_equals_tp1(tiny_gguf: Path) -> None:
    # NOTE: each TP rank reopens the file in its own process and keeps only its shard.
    tp2 = EngineConfig(
        device="cpu",
        dtype="float32",
        kv_cache_bytes=4 << 20,
        tensor_parallel_size=2,
        dist_timeout_s=60,
    )
    ids = list(range(3, 40))
    with Engine(tiny_config(), CPU, seed=SEED) as direct:
        want = _last_logits(direct, ids)
    with Engine(config=tp2, model_dir=tiny_gguf) as sharded:
        assert torch.allclose(_last_logits(sharded, ids), want, atol=1e-5, rtol=0)
