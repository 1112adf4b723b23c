"""Benchmarks that put mlxpaged beside its peers in one run (used by `scripts/` and `mlxpaged bench`)."""
