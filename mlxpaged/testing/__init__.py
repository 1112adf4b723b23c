"""Helpers for tests and quick benchmarks: tiny random-weight checkpoints; nothing of the engine.
May import: `models`."""
