"""Benchmark prompts: Alpaca instructions when the data set is at hand, else a built-in list."""

from __future__ import annotations

import json
import os
from pathlib import Path

BUILTIN = [
    "Write a Python function that reverses a string.",
    "Explain what a KV cache is in two sentences.",
    "List three uses of a hash table.",
    "Summarize the idea of virtual memory.",
    "Write a haiku about the ocean.",
    "What is the difference between a list and a tuple in Python?",
    "Give an example of a recursive function.",
    "Translate 'good morning' into French and Spanish.",
]


def alpaca_path() -> Path | None:
    here = Path(__file__).resolve().parents[2]
    for p in [os.environ.get("MLXPAGED_DATA", ""), here.parent / "shared" / "data", here / "shared" / "data"]:
        f = Path(p) / "alpaca" / "alpaca_5000.json" if p else None
        if f and f.is_file():
            return f
    return None


def load_prompts(count: int) -> list[str]:
    """`count` prompt texts (instruction, plus the input on a new line when present)."""
    f = alpaca_path()
    if f is None:
        texts = BUILTIN
    else:
        recs = json.loads(f.read_text())
        texts = [r["instruction"] + ("\n" + r["input"] if r.get("input") else "") for r in recs]
    return [texts[i % len(texts)] for i in range(count)]


def encode_chat(tokenizer, texts: list[str]) -> list[list[int]]:
    out = []
    for t in texts:
        if getattr(tokenizer, "chat_template", None):
            s = tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
            out.append(tokenizer.encode(s, add_special_tokens=False))
        else:
            out.append(tokenizer.encode(t))
    return out
