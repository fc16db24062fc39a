"""An emulated Kubernetes API server and cluster for the operator (tests and benches)."""
