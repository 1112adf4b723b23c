"""Repeated, order-alternating runs of two systems, summarised as a median with its range.

On a shared machine one run of each system says little: load from other processes and the
order (caches, allocator, thermal state) move timings by more than the effect. Each case is run
`repeats` times; repeat i runs system A first when i is even and system B first when it is odd,
and a ratio is formed within each repeat, so both sides of a ratio saw the same conditions.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TypeVar

R = TypeVar("R")


def alternate(a: Callable[[], R], b: Callable[[], R], repeats: int) -> list[tuple[R, R, str]]:
    """`repeats` x (result of a, result of b, "a" or "b": which ran first)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    out = []
    for i in range(repeats):
        if i % 2 == 0:
            ra = a()
            rb = b()
        else:
            rb = b()
            ra = a()
        out.append((ra, rb, "a" if i % 2 == 0 else "b"))
    return out


def spread(values: list[float]) -> dict:
    """Median, min, max and every value, in the order measured."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": list(values)}


def fmt(s: dict, digits: int = 2) -> str:
    """'1.04 (0.98-1.10)': a median with its min-max range."""
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
