"""The benchmarks: run from the repository as ``python benchmarks/NAME.py``; not installed."""
