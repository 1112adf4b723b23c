"""Helpers for tests and quick benchmarks: tiny random-weight checkpoints. Imports nothing of the
engine."""
