"""Time to first token of a request sharing a long prefix with an earlier one, on a hybrid model,
with and without recurrent-state checkpoints (worker/state_cache.py).

Without checkpoints the KV blocks of the prefix are cached, but the recurrent layers have no state
to resume from, so no hit is taken and the whole prompt is prefilled again: that is what a paged
cache without per-block state does. With them the request resumes at the last shared full block.

    python scripts/bench_hybrid_prefix.py --family qwen3_next --prefix 1000 --repeats 3
    python scripts/bench_hybrid_prefix.py --sizes   # state bytes per sequence, KV bytes per token

Each repeat runs both modes (alternating which goes first) on fresh engines over one loaded model:
a warm request of the prefix plus one token, then the timed request (the prefix plus 24 new
tokens, one output token), timed from `add_request` to its first token. Prints median and range
and the ratio within each repeat; `--json` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import mlxpaged  # noqa: F401  (first: the system OpenBLAS)
from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.loading.loader import load
from mlxpaged.testing.tiny_model import write_tiny_family


def ttft(loaded, prefix: list[int], tail: list[int], checkpoints: bool, block_size: int) -> tuple[float, int]:
    engine = LLMEngine(loaded, EngineConfig.of(block_size=block_size, num_blocks=512))
    if not checkpoints:
        engine.runner.checkpoints.cap_bytes = 0
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request(prefix + tail[:1], one)
    while engine.has_unfinished_requests():
        engine.step()
    t0 = time.perf_counter()
    rid = engine.add_request(prefix + tail, one)
    while True:
        outs = [o for o in engine.step() if o.request_id == rid and o.outputs[0].token_ids]
        if outs:
            return time.perf_counter() - t0, outs[0].num_cached_tokens


def sizes() -> None:
    """Per tiny hybrid checkpoint: one sequence's recurrent state (the engine's measure) and the
    paged KV of one token (the attention layers only), in the checkpoint's float32."""
    from mlxpaged.models.paged_adapter import HYBRID

    print("| family | state bytes per sequence | KV bytes per token | state = KV of N tokens |")
    print("|---|---|---|---|")
    for fam in HYBRID:
        loaded = load(str(write_tiny_family(Path(tempfile.mkdtemp()) / fam, fam)), "float32")
        engine = LLMEngine(loaded, EngineConfig.of(block_size=16, num_blocks=8))
        kv = engine.cache_shape.bytes_per_block(1)
        print(f"| {fam} | {engine.state_bytes:,} | {kv:,} | {engine.state_bytes / kv:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="qwen3_next")
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sizes", action="store_true", help="print each hybrid family's state and KV sizes, and exit")
    a = ap.parse_args()
    if a.sizes:
        return sizes()
    path = write_tiny_family(Path(tempfile.mkdtemp()) / a.family, a.family)
    loaded = load(str(path), "float32")
    vocab = loaded.model.args.vocab_size
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, vocab, a.prefix).tolist()
    tail = rng.integers(3, vocab, 24).tolist()
    ttft(loaded, prefix, tail, True, a.block_size)  # warm-up: compiles, allocates
    runs = {True: [], False: []}
    cached = {}
    for r in range(a.repeats):
        for mode in (True, False) if r % 2 == 0 else (False, True):
            t, hit = ttft(loaded, prefix, tail, mode, a.block_size)
            runs[mode].append(t)
            cached[mode] = hit
    ratios = [without / with_ for with_, without in zip(runs[True], runs[False])]

    def fmt(xs):
        return f"{statistics.median(xs) * 1e3:.1f} ms ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"

    print(f"{a.family}, prefix {a.prefix} tokens, block size {a.block_size}, {a.repeats} repeats")
    print(f"  with checkpoints:    TTFT {fmt(runs[True])}, {cached[True]} tokens from cache")
    print(f"  without checkpoints: TTFT {fmt(runs[False])}, {cached[False]} tokens from cache")
    print(f"  speed-up (within a repeat): {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "family": a.family,
                    "prefix": a.prefix,
                    "block_size": a.block_size,
                    "ttft_s": {"checkpoints": runs[True], "none": runs[False]},
                    "cached_tokens": {"checkpoints": cached[True], "none": cached[False]},
                    "ratios": ratios,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
