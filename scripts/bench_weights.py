"""Quantized vs float weights: weight memory and decode tokens/s, same model, same prompt.

"quantized" keeps the GGUF's block weights as MLX quantized layers (mlxpaged.loading.gguf.mlx_quant);
"float" is today's dequantized checkpoint.  Both load in one process with the same `--dtype`
(float32 on the CPU by default).  Each repeat decodes `--max-tokens` greedy tokens of one
prompt (batch 1) with each mode, alternating which goes first; the clock covers the decode
steps only (from the first sampled token to the last), the same span for both.  Prints each
mode's median tokens/s with its min-max range and the median ratio quantized / float.

Weight memory is the bytes of the loaded parameters.  The Mac estimate assumes decode is
bandwidth-bound and reads every weight once per token: bytes per token = the parameters as
a Mac holds them (float16: floats at 2 bytes, packed codes as they are; an untied embedding
table is gathered, not read, so it is left out), tokens/s <= bandwidth / bytes per token.

    python scripts/bench_weights.py                        # the offline Qwen2.5-Coder-0.5B GGUF
    python scripts/bench_weights.py --model m.gguf --max-tokens 64 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlxpaged  # noqa: F401  (first: OpenBLAS must load before MLX, mlxpaged/_blas.py)

# isort: split
import mlx.core as mx

# Unified-memory bandwidths (Apple's published figures) used for the Mac estimate.
MACS = {"M2 (100 GB/s)": 100e9, "M3 Pro (150 GB/s)": 150e9, "M2 Max (400 GB/s)": 400e9}
PROMPT = "Write a Python function that merges two sorted lists into one sorted list."


def weight_bytes(model, as_dtype=None) -> int:
    """Bytes of the parameters; with `as_dtype`, floating arrays counted at that dtype's size."""
    from mlx.utils import tree_flatten

    total = 0
    for _, v in tree_flatten(model.parameters()):
        floating = mx.issubdtype(v.dtype, mx.floating)
        total += v.size * as_dtype.size if (as_dtype is not None and floating) else v.nbytes
    return total


def bytes_per_token(model, as_dtype) -> int:
    """Weights read by one decode step: all of them, less an untied embedding table (gathered)."""
    from mlx.utils import tree_flatten

    total = weight_bytes(model, as_dtype)
    if not model.args.tie_word_embeddings:
        emb = model.model.embed_tokens
        total -= sum(
            v.size * as_dtype.size if mx.issubdtype(v.dtype, mx.floating) else v.nbytes
            for _, v in tree_flatten(emb.parameters())
        )
    return total


def decode_tps(loaded, prompt_ids: list[int], max_tokens: int) -> float:
    """Greedy tokens/s of one request, timing the decode steps only."""
    from mlxpaged import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(loaded, EngineConfig.of(num_blocks=(len(prompt_ids) + max_tokens) // 16 + 4))
    engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    engine.step()  # prefill and the first token: not timed
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: the offline Qwen2.5-Coder-0.5B)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each mode, alternating which goes first")
    args = ap.parse_args()
    if args.repeats < 1 or args.max_tokens < 2:
        sys.exit("error: --repeats must be >= 1 and --max-tokens >= 2")

    from mlxpaged.errors import MlxPagedError
    from mlxpaged.loading.gguf import GGUFError
    from mlxpaged.loading.loader import load

    try:
        models = {w: load(args.model, args.dtype, weights=w) for w in ("quantized", "float")}
    except (MlxPagedError, GGUFError, ValueError) as e:
        sys.exit(f"error: {e}")
    tok = models["float"].tokenizer
    ids = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    dtype = models["float"].dtype
    print(
        f"device {mx.default_device()}, mlx {mx.__version__}, dtype {dtype}, prompt {len(ids)} tokens, "
        f"{args.max_tokens} tokens decoded per run, {args.repeats} repeats"
    )
    for w in models:
        decode_tps(models[w], ids, 4)  # warm-up: first-call allocations and kernels
    runs: dict[str, list[float]] = {w: [] for w in models}
    for r in range(args.repeats):
        order = ("quantized", "float") if r % 2 == 0 else ("float", "quantized")
        for w in order:
            runs[w].append(decode_tps(models[w], ids, args.max_tokens))
        print(
            f"  repeat {r + 1} ({order[0]} first): " + ", ".join(f"{w} {runs[w][-1]:.2f} tok/s" for w in models),
            flush=True,
        )

    print(
        f"\n| weights | loaded bytes ({dtype}) | decode tok/s, median [min-max] | Mac bytes/token (float16) | "
        + " | ".join(f"{m} bound tok/s" for m in MACS)
        + " |"
    )
    print("| --- " * (4 + len(MACS)) + "|")
    for w, loaded in models.items():
        mac = bytes_per_token(loaded.model, mx.float16)
        print(
            f"| {w} | {weight_bytes(loaded.model) / 1e9:.3f} GB | {statistics.median(runs[w]):.2f} "
            f"[{min(runs[w]):.2f}-{max(runs[w]):.2f}] | {mac / 1e9:.3f} GB | "
            + " | ".join(f"{bw / mac:.0f}" for bw in MACS.values())
            + " |"
        )
    ratios = [q / f for q, f in zip(runs["quantized"], runs["float"])]
    mem = weight_bytes(models["float"].model) / weight_bytes(models["quantized"].model)
    mac_ratio = bytes_per_token(models["float"].model, mx.float16) / bytes_per_token(
        models["quantized"].model, mx.float16
    )
    print(
        f"\nquantized / float decode tok/s here: median {statistics.median(ratios):.2f} "
        f"[{min(ratios):.2f}-{max(ratios):.2f}]; weight memory {mem:.2f}x smaller; "
        f"Mac bytes per token {mac_ratio:.2f}x fewer (bandwidth-bound estimate: {mac_ratio:.2f}x the tokens/s)"
    )


if __name__ == "__main__":
    main()
