"""One settings object for a replica, from flags, environment (CACHEPOINT_REPLICA_*) or defaults."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cachepoint.events.subjects import check_replica_name
from cachepoint.kvcore import DEFAULT_EVICTION, EVICTION_POLICIES
from cachepoint.replica.model_source import (
    MODEL_PRESETS,
    RANDOM_MODEL_NAME,
    checkpoint_model_name,
    checkpoint_problem,
    preset_path,
)
from cachepoint.replica.random_model import TOKENIZER_CHOICES, tokenizer_source
from cachepoint.runtime.serve import shared_env

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20}
_UNITS |= {"mib": 2**20, "g": 2**30, "gb": 2**30, "gib": 2**30}
_UNITS |= {"t": 2**40, "tb": 2**40, "tib": 2**40}
# NOTE: Kubernetes' binary suffixes too (8Gi, 512Mi), as a CacheReplica's kv sizes are
# written next to the pod's memory quantities; "G" stays binary here, like "GB".
_UNITS |= {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(value: str | int) -> int:
    """'256MiB', '8Gi', '1g', '1048576' -> bytes. Binary units: a KV budget is sized in pages."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (try 256MiB or 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _check_disk_dir(path: Path) -> None:
    """A bad disk-tier directory fails at start-up, not at the first demotion. A missing
    one is fine if it can be made (the engine makes it): its nearest existing parent must
    then be a writable directory."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"kv_disk_path {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"kv_disk_path {path}: {existing} is not writable by this process")


class ReplicaSettings(BaseSettings):
    """Everything a replica process needs to start."""

    model_config = SettingsConfigDict(
        env_prefix="CACHEPOINT_REPLICA_", extra="forbid", populate_by_name=True
    )

    name: str = Field("replica-0", description="replica name, unique in the fleet")
    engine: Literal["torch", "vllm"] = Field(
        "torch",
        description="what computes the KV: torch (Cachepoint's engine, kvcore's own pool "
        "with TTL retention) or vllm (vLLM's engine in this process's venv; a kvcore mirror "
        "of its pool keeps entries, billing and events; retention is best effort)",
    )
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8100, ge=0, le=65535, description="HTTP port (0 = any free port)")
    model_dir: Path | None = Field(
        None, description="HF Llama checkpoint folder or .gguf file; None = random weights"
    )
    model: str | None = Field(
        None,
        description=f"an installed named model instead of model_dir: {' | '.join(MODEL_PRESETS)}",
    )
    model_name: str = Field(
        "",
        description="model id reported to the gateway; default: the checkpoint's own name "
        f"(GGUF general.name, HF folder name), {RANDOM_MODEL_NAME} for random weights",
    )
    model_preset: str = Field(
        "tiny",
        pattern="^(tiny|small)$",
        description="random-weight model size without model_dir: tiny (2x64) or small (4x256)",
    )
    tokenizer: str = Field(
        "bytes",
        description="the random model's tokenizer: "
        f"{' | '.join(TOKENIZER_CHOICES)} | a .gguf file | a HF folder with tokenizer.json; "
        "its vocabulary and BOS/EOS become the model's (a checkpoint brings its own)",
    )
    seed: int = Field(0, description="seed for random weights when no model_dir is given")
    random_turn_tokens: int = Field(
        0,
        ge=0,
        description="the random model only: its token number N is EOS, ending the turn "
        "(random weights never end one); 0 = run to EOS by chance or max_tokens",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="ranks that split heads")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    dtype: str = Field("auto", description="auto | float32 | bfloat16 | float16")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    kv_cache_bytes: int = Field(256 * 2**20, gt=0, description="KV budget per rank on the CPU")
    kv_host_bytes: int = Field(
        0,
        ge=0,
        description="host-memory KV tier behind the device pool, for the whole replica (all "
        "TP ranks together): blocks evicted from the device are demoted here and promoted "
        "back on a hit; 0 = no host tier",
    )
    kv_disk_path: Path | None = Field(
        None,
        description="directory for the disk KV tier's memory-mapped files (node-local "
        "NVMe); None = no disk tier; needs kv_disk_bytes",
    )
    kv_disk_bytes: int = Field(
        0,
        ge=0,
        description="disk KV tier behind the host tier, for the whole replica: blocks "
        "evicted from the host tier go here; 0 = no disk tier; needs kv_disk_path and "
        "kv_host_bytes",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="share of free GPU memory")
    retained_share: float = Field(0.5, ge=0, le=1, description="max share of blocks under TTL")
    org_retained_share: float = Field(
        0.5, ge=0, le=1, description="default share of the retained blocks one org may hold"
    )
    eviction: str = Field(
        DEFAULT_EVICTION,
        description=f"which cached free block goes first: {' | '.join(EVICTION_POLICIES)}",
    )
    max_model_len: int | None = Field(None, ge=16, description="longest sequence; None = model's")
    max_num_seqs: int = Field(32, ge=1, description="sequences running at once")
    max_num_batched_tokens: int = Field(2048, ge=16, description="tokens in one forward")
    decode_steps: int = Field(
        4,
        ge=1,
        le=64,
        description="decode steps run back to back on the engine thread while the batch "
        "is decode-only and nothing waits (torch engine): the hop to the event loop and "
        "the loop's own work are paid once per this many tokens; a stop string or end of "
        "turn found meanwhile discards that sequence's extra tokens, a new request waits "
        "at most this many steps",
    )
    decode_reserve_blocks: int = Field(
        1,
        ge=0,
        description="KV blocks reserved past the prompt at admission for the first "
        "decodes; later ones grow on demand (when full, preempting the lowest-priority "
        "sequence, the newest among equals)",
    )
    readmit_headroom_tokens: int = Field(
        512,
        ge=0,
        description="a preempted sequence is readmitted while others run only if the pool "
        "then still has this many tokens of free blocks per running sequence (itself "
        "included): a recompute is paid for with that much decoding before the pool can "
        "fill again, instead of ping-ponging every block",
    )
    max_admission_bypass: int = Field(
        32,
        ge=0,
        description="how many later requests may be admitted past a waiting request whose "
        "KV does not fit yet (no head-of-line blocking); after that nothing more is "
        "admitted past it until it fits, so it cannot starve; 0 = strict queue order",
    )
    coalesce_prefills: bool = Field(
        True,
        description="a request whose prefix another request is prefilling waits for it "
        "and hits its blocks instead of computing the same prefix again (agents that "
        "start together); off = each computes its own",
    )
    # NOTE: at least 1: every request waits (at least until the next step) before it
    # runs, so with 0 a replica answered 429 to everything.
    max_waiting: int = Field(256, ge=1, description="queued requests before 429")
    nats_url: str | None = Field(
        None,
        validation_alias=shared_env("nats_url", "REPLICA"),
        description="NATS for kv events and heartbeats; None = no event plane",
    )
    nats_user: str | None = Field(
        None,
        validation_alias=shared_env("nats_user", "REPLICA"),
        description="NATS user (the replica's name in generated configs); None = no auth",
    )
    nats_password: SecretStr | None = Field(
        None,
        validation_alias=shared_env("nats_password", "REPLICA"),
        description="NATS password for nats_user",
    )
    advertise_url: str | None = Field(
        None, description="URL the gateway should call; default http://HOST:PORT"
    )
    heartbeat_interval_s: float = Field(1.0, gt=0, description="seconds between heartbeats")
    drain_grace_s: float = Field(
        25.0,
        ge=0,
        description="on SIGTERM, how long the replica drains before it exits: it takes no "
        "new requests, heartbeats draining (the gateway routes elsewhere) and lets the "
        "requests it runs finish for up to this long; keep it under the pod's "
        "terminationGracePeriodSeconds (default 30)",
    )
    internal_token: SecretStr | None = Field(
        None,
        validation_alias=shared_env("internal_token", "REPLICA"),
        description="bearer token /v1/generate, /v1/stats and /v1/drain require; None = open "
        "(dev only)",
    )
    api_docs: bool = Field(
        False, description="serve /docs, /redoc and /openapi.json; off = they are 404s"
    )

    vllm_export_dir: Path | None = Field(
        None,
        description="where the vllm engine keeps HF folders exported from random weights "
        "or a GGUF file (reused across starts); default $XDG_CACHE_HOME/cachepoint/hf-export",
    )
    vllm_enforce_eager: bool | None = Field(
        None,
        description="run vLLM without torch.compile and CUDA graphs; default: on for the "
        "CPU (a compile costs minutes there), off on CUDA (graphs are much of its speed)",
    )
    vllm_retention: bool = Field(
        True,
        description="keep managed entries' blocks for their TTL through Cachepoint's "
        "retention connector (vLLM's KV-connector API; docs/vllm.md, Retention); off = "
        "vLLM's LRU decides and every answer says retention best_effort",
    )
    ttl_scale: float = Field(
        1.0,
        gt=0,
        le=1,
        description="vllm engine, tests only: every TTL times this (an entry and its pin "
        "live 300 s x scale); 1 = the contract's 5m and 1h. vLLM's pins run on its own "
        "process's clock, which a test cannot move",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_replica_name(v)

    @field_validator("eviction")
    @classmethod
    def _eviction(cls, v: str) -> str:
        if v not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction strategy {v!r}; choose from {', '.join(EVICTION_POLICIES)}"
            )
        return v

    @field_validator("kv_cache_bytes", "kv_host_bytes", "kv_disk_bytes", mode="before")
    @classmethod
    def _size(cls, v: object) -> object:
        return parse_bytes(v) if isinstance(v, str) else v

    @field_validator("kv_disk_path", mode="before")
    @classmethod
    def _disk_path(cls, v: object) -> object:
        # NOTE: an empty value (CACHEPOINT_REPLICA_KV_DISK_PATH="", a chart default) means
        # off; Path("") would silently be the working directory.
        return None if isinstance(v, str) and not v.strip() else v

    @model_validator(mode="after")
    def _tiers(self) -> ReplicaSettings:
        path, disk, host = self.kv_disk_path, self.kv_disk_bytes, self.kv_host_bytes
        if disk and path is None:
            raise ValueError("kv_disk_bytes needs kv_disk_path: the directory for the disk tier")
        if path is not None and not disk:
            raise ValueError(
                "kv_disk_path needs kv_disk_bytes > 0: the disk tier's size (set both or neither)"
            )
        if disk and not host:
            # NOTE: the tiers are a chain (device -> host -> disk): blocks reach the disk
            # only as they leave the host tier, and come back to the device through it.
            raise ValueError(
                "kv_disk_bytes needs kv_host_bytes > 0: the disk tier sits behind the host tier"
            )
        if path is not None:
            _check_disk_dir(path)
        return self

    @model_validator(mode="after")
    def _checkpoint(self) -> ReplicaSettings:
        # NOTE: a real checkpoint never reports the random model's id: a gateway that
        # routes by model would otherwise send cachepoint-tiny traffic to it.
        if self.model is not None:
            if self.model_dir is not None:
                raise ValueError("give model or model_dir, not both")
            self.model_dir = preset_path(self.model)
            preset = MODEL_PRESETS[self.model]
            self.model_name = self.model_name or preset.model_name
            if "kv_cache_bytes" not in self.model_fields_set:
                self.kv_cache_bytes = preset.kv_cache_bytes
        if self.model_dir is not None:
            problem = checkpoint_problem(self.model_dir)
            if problem is not None:
                raise ValueError(problem)
            self.model_name = self.model_name or checkpoint_model_name(self.model_dir)
        self.model_name = self.model_name or RANDOM_MODEL_NAME
        return self

    @model_validator(mode="after")
    def _tokenizer(self) -> ReplicaSettings:
        if self.model_dir is not None and self.tokenizer != "bytes":
            raise ValueError(
                "tokenizer applies to the random model only: a checkpoint (model, "
                "model_dir) brings its own"
            )
        tokenizer_source(self.tokenizer)  # a bad value fails here, not at start-up
        if self.model_dir is not None and self.random_turn_tokens:
            raise ValueError("random_turn_tokens applies to the random model only")
        return self

    @property
    def tokenizer_path(self) -> Path | None:
        """The file or folder the random model's tokenizer comes from; None = bytes."""
        return tokenizer_source(self.tokenizer)

    @model_validator(mode="after")
    def _vllm(self) -> ReplicaSettings:
        if self.engine != "vllm":
            return self
        # NOTE: each is a feature of kvcore's own pool, which vLLM does not have: refused
        # by name rather than silently ignored (docs/vllm.md says what stands in).
        # NOTE: kv_host_bytes is vLLM's own host tier there (its OffloadingConnector, on
        # GPUs; the engine refuses it on the CPU build by name).
        if self.kv_disk_bytes:
            raise ValueError(
                "kv_disk_bytes is kvcore's disk tier, which the vllm engine does not have "
                "(its host tier is vLLM's OffloadingConnector: kv_host_bytes; docs/vllm.md)"
            )
        if self.eviction != DEFAULT_EVICTION:
            raise ValueError(
                f"eviction {self.eviction!r} is a kvcore policy; the vllm engine evicts by "
                "vLLM's own LRU"
            )
        return self

    @model_validator(mode="after")
    def _ttl_scale(self) -> ReplicaSettings:
        # NOTE: the torch engine's tests move an injected clock instead; a scale there
        # would only be a way to break the contract.
        if self.ttl_scale != 1.0 and self.engine != "vllm":
            raise ValueError("ttl_scale applies to the vllm engine only (a test knob)")
        return self

    @property
    def export_dir(self) -> Path:
        """Where exported HF folders for the vllm engine live."""
        if self.vllm_export_dir is not None:
            return self.vllm_export_dir
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "cachepoint" / "hf-export"

    @model_validator(mode="after")
    def _nats_auth(self) -> ReplicaSettings:
        if (self.nats_user is None) != (self.nats_password is None):
            raise ValueError("nats_user and nats_password go together: set both or neither")
        return self
