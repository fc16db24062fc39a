"""Tests and benches share code by import: bench/ is the package ``cachepoint.bench``,
no bench script edits ``sys.path`` to reach a sibling or the tests, and no test loads
a bench script from its file path."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear"}  # list methods


def _sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def _sys_path_edits(tree: ast.AST) -> list[int]:
    """Lines that change sys.path: a call of a list method that mutates it, or an
    assignment to it."""
    lines = []
    for node in ast.walk(tree):
        target = None
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
        ):
            target = node.func.value
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t for t in targets if isinstance(t, ast.Attribute)), None)
        if (
            isinstance(target, ast.Attribute)
            and target.attr == "path"
            and isinstance(target.value, ast.Name)
            and target.value.id == "sys"
        ):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_bench_script_or_test_edits_sys_path() -> None:
    found = {}
    for path in _sources("bench", "tests"):
        rel = path.relative_to(ROOT).as_posix()
        lines = _sys_path_edits(ast.parse(path.read_text(encoding="utf-8"), filename=rel))
        if lines:
            found[rel] = lines
    assert found == {}


def test_the_detector_sees_a_sys_path_edit() -> None:
    # The check above is only as good as this detector: it must see the forms used before.
    code = "import sys\nsys.path.insert(0, 'bench')\nsys.path.append('x')\nsys.path = []\n"
    assert _sys_path_edits(ast.parse(code)) == [2, 3, 4]
    assert _sys_path_edits(ast.parse("import sys\nprint(sys.path[0], sys.path.index('x'))\n")) == []


def test_no_test_loads_a_bench_script_by_path() -> None:
    found = []
    for path in _sources("tests"):
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute | ast.Name)
                and getattr(node.func, "attr", getattr(node.func, "id", ""))
                in {"spec_from_file_location", "run_path"}
                and "bench" in (ast.get_source_segment(text, node) or "")
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_bench_helpers_import_by_name_in_a_fresh_interpreter() -> None:
    # NOTE: what a bench script itself gets (PYTHONSAFEPATH keeps bench/ off sys.path):
    # the shared helpers, from this checkout's bench/ folder.
    code = (
        "import cachepoint.bench, cachepoint.bench.clients, cachepoint.bench.usage_ledger; "
        "print(cachepoint.bench.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        timeout=120,
    )
    assert Path(out.stdout.strip()) == ROOT / "bench" / "__init__.py"
