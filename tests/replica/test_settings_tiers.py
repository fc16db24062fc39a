"""The replica's KV tier settings: sizes, the host -> disk chain, the disk directory, flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from cachepoint.replica.cli import build_parser
from cachepoint.replica.settings import ReplicaSettings, parse_bytes
from cachepoint.runtime.serve import settings_from_flags

CMD = [sys.executable, "-m", "cachepoint.replica.cli"]
GI = 2**30


def test_tiers_are_off_by_default():
    s = ReplicaSettings()
    assert (s.kv_host_bytes, s.kv_disk_path, s.kv_disk_bytes) == (0, None, 0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8Gi", 8 * GI),
        ("8GiB", 8 * GI),
        ("8g", 8 * GI),
        ("512Mi", 512 * 2**20),
        ("64Ki", 64 * 2**10),
        ("2Ti", 2 * 2**40),
        ("1.5Gi", 3 * GI // 2),
        ("1048576", 2**20),
    ],
)
def test_sizes_take_binary_units_kubernetes_style_too(text: str, expected: int):
    assert parse_bytes(text) == expected
    assert ReplicaSettings(kv_host_bytes=text).kv_host_bytes == expected


def test_tiers_come_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("CACHEPOINT_REPLICA_KV_HOST_BYTES", "32Gi")
    monkeypatch.setenv("CACHEPOINT_REPLICA_KV_DISK_PATH", str(tmp_path / "kv"))
    monkeypatch.setenv("CACHEPOINT_REPLICA_KV_DISK_BYTES", "500Gi")
    s = ReplicaSettings()
    assert s.kv_host_bytes == 32 * GI
    assert s.kv_disk_path == tmp_path / "kv"
    assert s.kv_disk_bytes == 500 * GI


def test_an_empty_disk_path_means_off(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CACHEPOINT_REPLICA_KV_DISK_PATH", "")
    assert ReplicaSettings().kv_disk_path is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_host_bytes": "lots"}, "not a size: 'lots'"),
        ({"kv_host_bytes": "8Pi"}, "not a size: '8Pi'"),
        ({"kv_host_bytes": -1}, "greater than or equal to 0"),
        ({"kv_disk_bytes": -1}, "greater than or equal to 0"),
        ({"kv_host_bytes": GI, "kv_disk_bytes": GI}, "kv_disk_bytes needs kv_disk_path"),
        ({"kv_host_bytes": GI, "kv_disk_path": "/tmp"}, "kv_disk_path needs kv_disk_bytes > 0"),
        (
            {"kv_disk_path": "/tmp", "kv_disk_bytes": GI},
            "kv_disk_bytes needs kv_host_bytes > 0: the disk tier sits behind the host tier",
        ),
    ],
)
def test_bad_tiers_are_clear_errors(kwargs: dict[str, object], message: str):
    with pytest.raises(ValidationError, match=message):
        ReplicaSettings(**kwargs)


def test_the_disk_directory_is_checked_at_start_up(tmp_path: Path):
    tiers = {"kv_host_bytes": GI, "kv_disk_bytes": 4 * GI}
    # A missing directory is fine while its parent can hold it (the engine makes it).
    assert ReplicaSettings(**tiers, kv_disk_path=tmp_path / "a" / "b").kv_disk_path is not None
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(ValidationError, match="is not a directory"):
        ReplicaSettings(**tiers, kv_disk_path=afile)
    with pytest.raises(ValidationError, match="is not a directory"):
        ReplicaSettings(**tiers, kv_disk_path=afile / "below")


def test_an_unwritable_disk_directory_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # NOTE: faked through os.access, as a root test runner could write a 0500 directory.
    from cachepoint.replica import settings as module

    checked: list[str] = []

    def deny(path: object, mode: int) -> bool:
        checked.append(str(path))
        return False

    monkeypatch.setattr(module.os, "access", deny)
    with pytest.raises(ValidationError, match="is not writable by this process"):
        ReplicaSettings(kv_host_bytes=GI, kv_disk_bytes=GI, kv_disk_path=tmp_path / "kv")
    assert checked == [str(tmp_path)]  # the nearest existing parent of the missing directory


def test_flags_set_the_tiers(tmp_path: Path):
    parser = build_parser()
    args = parser.parse_args(
        ["--kv-host-bytes", "8Gi", "--kv-disk-path", str(tmp_path), "--kv-disk-bytes", "100GiB"]
    )
    s = settings_from_flags(parser, args, ReplicaSettings)
    assert (s.kv_host_bytes, s.kv_disk_path, s.kv_disk_bytes) == (8 * GI, tmp_path, 100 * GI)


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CACHEPOINT_REPLICA_KV_HOST_BYTES", "1Gi")
    parser = build_parser()
    s = settings_from_flags(parser, parser.parse_args(["--kv-host-bytes", "2Gi"]), ReplicaSettings)
    assert s.kv_host_bytes == 2 * GI


def test_help_explains_the_tiers():
    out = subprocess.run([*CMD, "--help"], capture_output=True, text=True, check=True).stdout
    assert "KV tiers" in out
    for flag in ("--kv-host-bytes", "--kv-disk-path", "--kv-disk-bytes"):
        assert flag in out
    assert "behind the host tier" in " ".join(out.split())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-host-bytes", "lots"], "not a size: 'lots'"),
        (["--kv-disk-bytes", "1Gi"], "kv_disk_bytes needs kv_disk_path"),
        (
            ["--kv-disk-bytes", "1Gi", "--kv-disk-path", "/tmp"],
            "kv_disk_bytes needs kv_host_bytes > 0",
        ),
    ],
)
def test_bad_tier_flags_are_usage_errors(argv: list[str], message: str):
    r = subprocess.run([*CMD, *argv], capture_output=True, text=True)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr
