"""`--engine vllm` settings: what vLLM lacks is refused by name, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from cachepoint.replica.settings import ReplicaSettings
from cachepoint.replica.vllm_engine.engine import (
    RETENTION_MODULE,
    VllmConfigError,
    check_geometry,
    connector_config,
    engine_kwargs,
)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kv_disk_bytes": "1GiB", "kv_disk_path": "/tmp", "kv_host_bytes": "1GiB"}, "disk"),
        ({"eviction": "slru"}, "vLLM's own LRU"),
    ],
)
def test_kvcore_only_settings_are_refused_on_vllm(extra: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ReplicaSettings(engine="vllm", **extra)
    ReplicaSettings(engine="torch", **extra)  # fine on kvcore's own pool


def test_cpu_block_and_head_sizes_are_checked_before_vllm_starts() -> None:
    with pytest.raises(VllmConfigError, match="multiples of 32"):
        check_geometry(ReplicaSettings(engine="vllm"), "cpu", 64)
    with pytest.raises(VllmConfigError, match="--model-preset small"):
        check_geometry(ReplicaSettings(engine="vllm", block_size=32), "cpu", 16)
    check_geometry(ReplicaSettings(engine="vllm", block_size=32), "cpu", 32)
    check_geometry(ReplicaSettings(engine="vllm"), "cuda", 16)  # CUDA kernels take both


def test_the_main_venv_says_how_to_get_vllm() -> None:
    # This interpreter (.venv) has no vLLM: a usage error naming `make vllm`, not a
    # traceback from an import.
    result = subprocess.run(
        [sys.executable, "-m", "cachepoint.replica.cli", "--engine", "vllm"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2
    assert "make vllm" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_explains_the_engine_choice() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cachepoint.replica.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0
    assert "--engine {torch,vllm}" in result.stdout
    assert "--vllm-export-dir" in result.stdout


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_engine_args_keep_prefix_caching_on_with_a_collision_resistant_hash(
    tmp_path: Path, device: str
) -> None:
    """What isolation and billing stand on is not left to vLLM's defaults: prefix
    caching always on (the engine hit is what gets billed), and sha256 block hashes (a
    tenant's cache_salt only separates tenants while no one can forge a hash)."""
    settings = ReplicaSettings(engine="vllm", block_size=32, seed=7, max_num_seqs=5)
    kwargs = engine_kwargs(settings, tmp_path, device)
    assert kwargs["enable_prefix_caching"] is True
    assert kwargs["prefix_caching_hash_algo"] == "sha256"
    assert kwargs["scheduling_policy"] == "priority"  # the request's priority holds
    assert kwargs["skip_tokenizer_init"] is True
    assert (kwargs["model"], kwargs["block_size"], kwargs["seed"]) == (str(tmp_path), 32, 7)
    assert kwargs["max_num_seqs"] == 5
    # The KV budget is ours on the CPU; on a GPU vLLM profiles what is left.
    assert (kwargs["kv_cache_memory_bytes"] is None) == (device == "cuda")
    assert kwargs["enforce_eager"] is (device == "cpu")
    if device == "cpu":
        assert kwargs["dtype"] == "float32"


def test_the_connector_config_pins_and_adds_vllms_host_tier_on_gpus() -> None:
    plain = connector_config(ReplicaSettings(engine="vllm"), "cpu")
    assert plain == {
        "kv_connector": "RetentionConnector",
        "kv_connector_module_path": RETENTION_MODULE,
        "kv_role": "kv_both",
    }
    assert connector_config(ReplicaSettings(engine="vllm", vllm_retention=False), "cpu") is None
    both = connector_config(ReplicaSettings(engine="vllm", kv_host_bytes="8GiB"), "cuda")
    assert both is not None and both["kv_connector"] == "MultiConnector"
    retention, offload = both["kv_connector_extra_config"]["connectors"]
    assert retention == plain  # asked first, as MultiConnector asks in order
    assert offload == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 8 * 2**30},
    }
    alone = connector_config(
        ReplicaSettings(engine="vllm", kv_host_bytes="1GiB", vllm_retention=False), "cuda"
    )
    assert alone is not None and alone["kv_connector"] == "OffloadingConnector"


def test_a_host_tier_on_vllms_cpu_build_is_refused_by_name() -> None:
    with pytest.raises(VllmConfigError, match="GPUs only"):
        connector_config(ReplicaSettings(engine="vllm", kv_host_bytes="1GiB"), "cpu")


def test_the_ttl_scale_is_a_vllm_test_knob_only() -> None:
    with pytest.raises(ValidationError, match="vllm engine only"):
        ReplicaSettings(engine="torch", ttl_scale=0.5)
    with pytest.raises(ValidationError):
        ReplicaSettings(engine="vllm", ttl_scale=2.0)
    assert ReplicaSettings(engine="vllm", ttl_scale=0.01).ttl_scale == 0.01
