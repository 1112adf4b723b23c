"""Prefill time of one long prompt: mlxpaged's engine against mlx-lm's `generate_step`, the same
model object (mlxpaged's loaded model called without paged metadata is mlx-lm's model), the same
prompt ids, each system's own chunking (2,048 tokens a step in both by default).

The clock runs from handing the prompt over to the first sampled token (mlxpaged: `add_request`
then steps; mlx-lm: `generate_step` to its first token), prefix caching off, one request. It says
whether a long agent prompt (Claude Code's first turn is ~18,800 tokens in Qwen2.5's tokenizer)
is slow because of the paged engine or because of the machine: repeats alternate which system
goes first; median, range and the ratio within each repeat.

    python scripts/bench_prefill.py --tokens 1024,4096 --repeats 3     # the offline 0.5B
    python scripts/bench_prefill.py --tiny --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlxpaged  # noqa: F401  (first: OpenBLAS must load before MLX, mlxpaged/_blas.py)

# isort: split
import mlx.core as mx


def prompt_ids(tok, n: int) -> list[int]:
    """`n` token ids of real text (this package's own sources, in a fixed order)."""
    text = "".join(p.read_text() for p in sorted(Path(mlxpaged.__file__).parent.rglob("*.py")))
    ids = tok.encode(text)
    if len(ids) < n:
        raise SystemExit(f"only {len(ids)} tokens of text; ask for fewer")
    return ids[:n]


def time_mlxpaged(loaded, ids: list[int]) -> float:
    from mlxpaged import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(loaded, EngineConfig.of(enable_prefix_caching=False))
    mx.synchronize()
    t0 = time.perf_counter()
    engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def time_mlx_lm(model, ids: list[int]) -> float:
    from mlx_lm.generate import generate_step

    mx.synchronize()
    t0 = time.perf_counter()
    for _ in generate_step(mx.array(ids), model, max_tokens=1):
        break
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny random Qwen2 instead of the offline 0.5B")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    from mlxpaged.loading.loader import load

    if args.tiny:
        import tempfile

        from mlxpaged.testing.tiny_model import write_tiny_qwen2

        path = write_tiny_qwen2(Path(tempfile.mkdtemp()) / "tiny")
        loaded = load(str(path), args.dtype or "float32")
    else:
        loaded = load(None, args.dtype)
    print(f"model {Path(loaded.path).name} ({loaded.dtype}), device {mx.default_device()}, mlx {mx.__version__}")
    rows = []
    for n in [int(x) for x in args.tokens.split(",")]:
        ids = prompt_ids(loaded.tokenizer, n)
        ours, theirs, ratios = [], [], []
        for r in range(args.repeats):
            order = [("mlxpaged", time_mlxpaged), ("mlx-lm", time_mlx_lm)]
            got = {}
            for name, fn in order if r % 2 == 0 else order[::-1]:
                got[name] = fn(loaded if name == "mlxpaged" else loaded.model, ids)
            ours.append(got["mlxpaged"])
            theirs.append(got["mlx-lm"])
            ratios.append(got["mlx-lm"] / got["mlxpaged"])
        row = {"tokens": n, "mlxpaged_s": ours, "mlx_lm_s": theirs, "ratios": ratios}
        rows.append(row)
        med = statistics.median
        print(
            f"{n:6d} tokens: mlxpaged {med(ours):7.2f} s ({min(ours):.2f}-{max(ours):.2f}), "
            f"{n / med(ours):6.1f} tok/s; mlx-lm {med(theirs):7.2f} s ({min(theirs):.2f}-{max(theirs):.2f}), "
            f"{n / med(theirs):6.1f} tok/s; mlx-lm time / mlxpaged time {med(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f})",
            flush=True,
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
