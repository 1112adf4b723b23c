"""Benchmark prompts: distinct texts, never repeated, so no row gains from a repeated prompt.

Alpaca instructions when the data set is at hand (`$MLXPAGED_DATA/alpaca/alpaca_5000.json`, or
`shared/data` beside the checkout); otherwise texts built from a topic x task grid, every one
different from its first words on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TOPICS = [
    "a hash table",
    "virtual memory",
    "the KV cache",
    "a binary search tree",
    "garbage collection",
    "TCP congestion control",
    "a bloom filter",
    "copy-on-write",
    "the page cache",
    "a mutex",
    "consistent hashing",
    "the Fourier transform",
    "gradient descent",
    "a linked list",
    "public-key cryptography",
    "a B-tree",
    "DNS resolution",
    "a ring buffer",
    "dynamic programming",
    "the CAP theorem",
    "attention in transformers",
    "a trie",
    "reference counting",
    "SQL joins",
    "memory paging",
    "a priority queue",
    "the rope embedding",
    "lock-free queues",
    "a skip list",
    "quicksort",
    "Unicode normalization",
    "branch prediction",
]
TASKS = [
    "Explain {} to a new programmer in one paragraph.",
    "Write a short Python example that uses {}.",
    "List three common mistakes people make with {}.",
    "Compare {} with its closest alternative.",
    "Describe when {} is the wrong choice.",
    "Summarize the history of {} in three sentences.",
    "Write a haiku about {}.",
    "Give an interview question about {} and answer it.",
]


def alpaca_path() -> Path | None:
    here = Path(__file__).resolve().parents[2]
    for p in [os.environ.get("MLXPAGED_DATA", ""), here.parent / "shared" / "data", here / "shared" / "data"]:
        f = Path(p) / "alpaca" / "alpaca_5000.json" if p else None
        if f and f.is_file():
            return f
    return None


def builtin_texts() -> list[str]:
    """len(TASKS) x len(TOPICS) distinct texts, task-major so consecutive prompts differ in their first words."""
    return [task.format(topic) for task in TASKS for topic in TOPICS]


def load_prompts(count: int) -> list[str]:
    """`count` distinct prompt texts (Alpaca: instruction, plus the input on a new line when present)."""
    f = alpaca_path()
    if f is None:
        texts = builtin_texts()
    else:
        recs = json.loads(f.read_text())
        texts = [r["instruction"] + ("\n" + r["input"] if r.get("input") else "") for r in recs]
    texts = list(dict.fromkeys(texts))  # drop duplicates, keep the order
    if count > len(texts):
        raise ValueError(f"{count} prompts asked for, but only {len(texts)} distinct ones are available")
    return texts[:count]


def encode_chat(tokenizer, texts: list[str]) -> list[list[int]]:
    from ..engine.chat import chat_ids

    if not getattr(tokenizer, "chat_template", None):
        return [tokenizer.encode(t) for t in texts]
    return [chat_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
