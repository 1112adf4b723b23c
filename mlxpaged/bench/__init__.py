"""Benchmarks that put mlxpaged beside its peers in one run (used by `scripts/` and `mlxpaged bench`).
May import: `engine`, `worker`, `attention`, `loading`, `data`, `metal_emu`, `testing`."""
