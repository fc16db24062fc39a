"""The benchmarks (bench/RESULTS.md), importable as ``cachepoint.bench``.

Each is run as a script (``.venv/bin/python bench/X.py``); the package exists so the
tests and the other benches import a bench's harness and the helpers they share by
name, never by file path or a ``sys.path`` edit.
"""
