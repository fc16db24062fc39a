"""Lay the ``cachepoint`` package out as one folder, for import-linter (``make lint``).

setup.py maps one namespace onto several folders (services/kvcore is
``cachepoint.kvcore``, gateway/ is ``cachepoint.gateway``, ...). import-linter (grimp)
finds a package's modules by walking the folder its ``__path__`` names, and the
editable install's ``cachepoint`` names services/cachepoint alone: the other
subpackages would be missing from the graph. This builds a tree of symbolic links
in which ``cachepoint/`` holds every subpackage, from setup.py's ``PACKAGE_DIRS``
(read, never run), so the contracts in pyproject.toml see the package as installed.

    python tools/import_graph.py build/import-graph
    PYTHONPATH=build/import-graph lint-imports
"""

from __future__ import annotations

import argparse
import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOT_PACKAGE = "cachepoint"


def package_dirs(setup_py: Path) -> dict[str, str]:
    """setup.py's ``PACKAGE_DIRS`` literal: package name -> folder, relative to it."""
    tree = ast.parse(setup_py.read_text(encoding="utf-8"), filename=str(setup_py))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "PACKAGE_DIRS" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            if isinstance(value, dict):
                return {str(k): str(v) for k, v in value.items()}
    raise SystemExit(f"{setup_py}: no PACKAGE_DIRS dict literal")


def build(dest: Path, root: Path = ROOT) -> Path:
    """(Re)create ``dest/cachepoint`` as links into ``root``; returns that folder."""
    dirs = package_dirs(root / "setup.py")
    top = dest / ROOT_PACKAGE
    if dest.exists():
        shutil.rmtree(dest)
    top.mkdir(parents=True)
    # NOTE: the root package's own files are linked one by one (not its folder), so
    # the subpackages can sit beside them without writing into the source tree.
    for entry in sorted((root / dirs[ROOT_PACKAGE]).iterdir()):
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for name, folder in sorted(dirs.items()):
        if name == ROOT_PACKAGE:
            continue
        parent, _, child = name.rpartition(".")
        if parent != ROOT_PACKAGE:
            # A deeper mapping would have to be linked inside another link, that is
            # inside the source tree; setup.py has none, so say so rather than guess.
            raise SystemExit(f"{name}: only direct subpackages of {ROOT_PACKAGE} are laid out")
        source = root / folder
        if source.is_dir():  # setup.py skips missing folders too (a slim image's copy)
            (top / child).symlink_to(source, target_is_directory=True)
    return top


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dest", type=Path, help="folder to (re)create; put it on PYTHONPATH")
    args = p.parse_args(argv)
    build(args.dest.resolve())


if __name__ == "__main__":
    main()
