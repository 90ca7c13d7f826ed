"""The benchmarks: run each as `python3 -m tools.bench.<name>` from the repository root (docs/BENCHMARKS.md)."""
