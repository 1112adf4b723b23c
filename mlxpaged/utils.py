"""Small arithmetic shared by the allocator, the model runner and the kernels' wrappers."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` for non-negative integers, without floats."""
    return -(-a // b)
