"""The parts of a real API server that the emulator (bench/kube/emulator.py) adds to kmock.

Each module is one concern and knows nothing of kmock's request plumbing: RBAC
(rbac.py), CRD schemas and CEL (schema.py, cel.py), deletion and garbage collection
(lifecycle.py), injected failures (faults.py), Status bodies (status.py) and the chart
they are loaded from (chart.py).
"""
