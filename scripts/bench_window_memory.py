"""KV memory a long conversation holds on a model with local attention layers (sliding windows,
attention chunks): mlxpaged's pool against mlx-lm's own caches (`make_prompt_cache`: a
RotatingKVCache on each windowed layer, a ChunkedKVCache on each chunked one).

    python scripts/bench_window_memory.py                 # 4,000 tokens, gpt-oss- and Gemma-3-shaped
    python scripts/bench_window_memory.py --tokens 8000 --json docs/data/bench_window_memory.json

Each shape is a tiny random checkpoint written by mlx-lm's own classes with the real model's
layer pattern, window and KV heads x head_dim (gpt-oss-20b: 24 layers alternating window 128 and
full, 8 x 64; Gemma-3-12B: 48 layers, 5 windowed (1,024) to 1 full, 8 x 256; Llama-4-Scout: 48
layers, 3 chunked to 1 full, 8 x 128, its 8,192-token chunk scaled to 1,024 here so that a prompt
of a few thousand tokens crosses chunks on this machine's CPU), in float32 (MLX's
CPU runs MoE's gather_mm only in float32; bf16 halves both sides, the ratios stay). One
prompt of `--tokens` random ids is prefilled by both (mlx-lm in chunks of `--chunk`, its
`prefill_step_size`; mlxpaged with `max_num_batched_tokens` the same) and one token generated;
then mlx-lm's bytes are its caches' `nbytes` (what they have allocated, growth slack included) and
mlxpaged's are the most its two block groups held at once (the full-attention layers' blocks
times their bytes per block, plus the local layers' blocks, which go back to their pool once no
later token reads them, times theirs), and what its pools had allocated at the end with the
default growing pool. "every block" is what the pool would hold without a group for the local
layers (every block on every layer). Bytes are deterministic, so one run is the figure.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import mlxpaged  # noqa: F401  (first: the system OpenBLAS)

# isort: split
import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models.cache import ChunkedKVCache, RotatingKVCache, make_prompt_cache

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.loading.loader import load
from mlxpaged.testing.tiny_model import write_tiny_family

SHAPES = {
    "gpt-oss-20b": (
        "gpt_oss",
        {
            "num_hidden_layers": 24,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
            "sliding_window": 128,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "hidden_size": 128,
            "intermediate_size": 128,
        },
    ),
    "gemma-3-12b": (
        "gemma3_text",
        {
            "num_hidden_layers": 48,
            "sliding_window_pattern": 6,
            "sliding_window": 1024,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "hidden_size": 128,
            "intermediate_size": 128,
        },
    ),
    "llama-4-scout": (
        "llama4",
        {
            "num_hidden_layers": 48,
            "layer_types": (["chunked_attention"] * 3 + ["full_attention"]) * 12,
            "attention_chunk_size": 1024,  # Scout's 8,192 scaled down (the module docstring)
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_size": 128,
            "intermediate_size": 128,
            "intermediate_size_mlp": 128,
        },
    ),
}


def measure(name: str, tokens: int, chunk: int, block_size: int, root: Path) -> dict:
    family, overrides = SHAPES[name]
    path = write_tiny_family(root / name, family, **overrides)
    ids = np.random.default_rng(0).integers(3, 300, size=tokens).tolist()

    ref_model, _ = mlx_lm.load(str(path))
    caches = make_prompt_cache(ref_model)
    for i in range(0, tokens, chunk):
        mx.eval(ref_model(mx.array([ids[i : i + chunk]]), cache=caches))
    theirs = sum(c.nbytes for c in caches)
    windows = [
        c.max_size if isinstance(c, RotatingKVCache) else c.chunk_size if isinstance(c, ChunkedKVCache) else None
        for c in caches
    ]

    loaded = load(str(path), "float32")
    # The default pool (it grows as blocks are needed); prefix caching off, so nothing is kept for later.
    engine = LLMEngine(
        loaded, EngineConfig.of(block_size=block_size, max_num_batched_tokens=chunk, enable_prefix_caching=False)
    )
    engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    full_bytes, window_bytes = (engine.kv_cache.group_block_bytes() + [0])[:2]  # groups 0 and 1 (the local layers')
    bm = engine.block_manager
    held = full_held = window_held = 0
    while engine.has_unfinished_requests():
        engine.step()
        used_full, used_window = bm.pool.num_used, bm.groups[1].pool.num_used if len(bm.groups) > 1 else 0
        if used_full * full_bytes + used_window * window_bytes > held:
            held = used_full * full_bytes + used_window * window_bytes
            full_held, window_held = used_full, used_window
    allocated = engine.kv_cache.nbytes
    every = full_held * (full_bytes + window_bytes)
    return {
        "shape": name,
        "family": family,
        "tokens": tokens,
        "layers": len(windows),
        "windowed_layers": sum(w is not None for w in windows),
        "window": next((w for w in windows if w is not None), None),
        "mlx_lm_bytes": theirs,
        "mlxpaged_full_blocks": full_held,
        "mlxpaged_window_blocks": window_held,
        "mlxpaged_bytes": held,
        "mlxpaged_allocated_bytes": allocated,
        "every_block_bytes": every,
        "ratio_mlxpaged_to_mlx_lm": held / theirs,
        "ratio_allocated_to_mlx_lm": allocated / theirs,
        "ratio_mlxpaged_to_every_block": held / every,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    if a.tokens < 1 or a.chunk < 1:
        ap.error("--tokens and --chunk must be positive")
    unknown = [s for s in a.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in a.shapes.split(","):
            rows.append(r := measure(name, a.tokens, a.chunk, a.block_size, Path(d)))
            mb = 1 / 2**20
            print(
                f"{name:>12} | {r['tokens']} tokens | mlx-lm {r['mlx_lm_bytes'] * mb:8.1f} MiB | mlxpaged held "
                f"{r['mlxpaged_bytes'] * mb:8.1f} MiB ({r['mlxpaged_full_blocks']} + {r['mlxpaged_window_blocks']} "
                f"local blocks) x{r['ratio_mlxpaged_to_mlx_lm']:.2f} | allocated "
                f"{r['mlxpaged_allocated_bytes'] * mb:8.1f} MiB x{r['ratio_allocated_to_mlx_lm']:.2f} | every block "
                f"{r['every_block_bytes'] * mb:8.1f} MiB"
            )
    if a.json_out:
        cmd = "python scripts/bench_window_memory.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "json_out"
        )
        Path(a.json_out).write_text(json.dumps({"command": cmd, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
