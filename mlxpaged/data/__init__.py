"""Package data: the (prompt, answer) token-length traces the benchmarks and the waste table read.

`sharegpt_lengths.json` and `alpaca_lengths.json` are written by `scripts/lengths.py` from the
raw data sets with the Qwen2.5 tokenizer; they ship inside the wheel, so `mlxpaged bench` needs
no checkout.
May import: `bench.waste` (the trace reader).
"""

from __future__ import annotations

from pathlib import Path

TRACE_DIR = Path(__file__).resolve().parent
TRACES = ("sharegpt", "alpaca")


def trace_path(name: str) -> Path:
    """The file of trace `name` (one of `TRACES`)."""
    if name not in TRACES:
        raise ValueError(f"unknown trace '{name}': choose one of {', '.join(TRACES)}")
    return TRACE_DIR / f"{name}_lengths.json"


def load_trace(name: str) -> list[tuple[int, int]]:
    """(prompt, answer) token counts of trace `name`, in the file's order."""
    from ..bench.waste import load_pairs

    return load_pairs(trace_path(name))
