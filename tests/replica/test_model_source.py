"""Which checkpoint a replica serves and which model id it reports for it."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from pydantic import ValidationError

from cachepoint.replica.settings import ReplicaSettings


def write_named_gguf(path: Path, name: str) -> Path:
    """A GGUF holding only its metadata name (enough for the settings, which read no weights)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_random_weights_keep_the_tiny_id() -> None:
    assert ReplicaSettings().model_name == "cachepoint-tiny"


def test_gguf_reports_its_own_name_never_the_tiny_default(tmp_path: Path) -> None:
    path = write_named_gguf(tmp_path / "t.gguf", "Tiny Test Llama 2x64")
    assert ReplicaSettings(model_dir=path).model_name == "tiny-test-llama-2x64"
    assert ReplicaSettings(model_dir=path, model_name="mine").model_name == "mine"


def test_hf_folder_reports_its_name(tmp_path: Path) -> None:
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert ReplicaSettings(model_dir=folder).model_name == "smollm2-135m-instruct"
    (folder / "config.json").write_text(json.dumps({"_name_or_path": "org/Other Model"}))
    assert ReplicaSettings(model_dir=folder).model_name == "other-model"


def test_bad_checkpoints_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"no config\.json"):
        ReplicaSettings(model_dir=tmp_path)
    with pytest.raises(ValidationError, match=r"is not a file"):
        ReplicaSettings(model_dir=tmp_path / "missing.gguf")
    with pytest.raises(ValidationError, match=r"not both"):
        ReplicaSettings(model="smollm2", model_dir=tmp_path)


def test_smollm2_preset_finds_the_installed_file() -> None:
    s = ReplicaSettings(model="smollm2")
    assert s.model_dir is not None and s.model_dir.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert s.model_dir.is_file()
    assert s.model_name == "smollm2-135m-instruct"
