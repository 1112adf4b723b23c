"""Peak memory of one `generate` run: mlxpaged against mlx-lm, same weights, dtype, prompt and length.

Each run is a fresh process (a process's MLX peak is its own), greedy, with EOS ignored so both
produce exactly `--max-tokens` tokens. Cases alternate which system goes first; the table gives
the median peak (weights included) and the min-max range.

    python scripts/bench_memory.py                         # offline Qwen2.5-Coder-0.5B, float32
    python scripts/bench_memory.py --max-tokens 124 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROMPT = "Write a Python function that reverses a string."

CHILD = r"""
import json, sys
import mlxpaged  # system BLAS first
import mlx.core as mx
from mlxpaged.loading.loader import load

system, model, dtype, max_tokens, prompt = sys.argv[1], sys.argv[2] or None, sys.argv[3], int(sys.argv[4]), sys.argv[5]
loaded = load(model, dtype)
tok = loaded.tokenizer
text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
ids = tok.encode(text, add_special_tokens=False)
if system == "mlxpaged":
    from click.testing import CliRunner
    from mlxpaged.cli.main import main
    args = ["generate", "--model", str(loaded.path), "--dtype", dtype, "--prompt", prompt, "-t", str(max_tokens),
            "--ignore-eos", "--json"]
    del loaded
    mx.clear_cache(); mx.reset_peak_memory()
    r = CliRunner().invoke(main, args)
    stats = json.loads(r.stdout)["stats"]
    out = {"peak_gb": mx.get_peak_memory() / 1e9, "tokens": stats["generation_tokens"], "pool_gb": stats["pool_gb"]}
else:
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler
    del loaded
    mx.clear_cache(); mx.reset_peak_memory()
    model_, tok_ = mlx_lm.load(str(load(model, dtype).path))
    model_.set_dtype({"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[dtype])
    n = 0
    for _ in mlx_lm.stream_generate(model_, tok_, ids, max_tokens=max_tokens, sampler=make_sampler(0.0)):
        n += 1
    out = {"peak_gb": mx.get_peak_memory() / 1e9, "tokens": n}
print("RESULT " + json.dumps(out))
"""


def run(system: str, args) -> dict:
    p = subprocess.run(
        [sys.executable, "-c", CHILD, system, args.model or "", args.dtype, str(args.max_tokens), PROMPT],
        capture_output=True,
        text=True,
    )
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not line:
        sys.exit(
            f"error: the {system} run failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}"
        )
    return json.loads(line[0][7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=124)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    res = {"mlxpaged": [], "mlx_lm": []}
    for i in range(args.repeats):
        order = ["mlxpaged", "mlx_lm"] if i % 2 == 0 else ["mlx_lm", "mlxpaged"]
        for system in order:
            r = run(system, args)
            res[system].append(r)
            print(
                f"run {i + 1} {system:>8}: peak {r['peak_gb']:.3f} GB, {r['tokens']} tokens"
                + (f", pool {r['pool_gb']:.4f} GB" if "pool_gb" in r else ""),
                flush=True,
            )
    for system, rs in res.items():
        peaks = [r["peak_gb"] for r in rs]
        print(
            f"{system:>8}: peak memory median {statistics.median(peaks):.3f} GB "
            f"(range {min(peaks):.3f}-{max(peaks):.3f})"
        )
    diff = [a["peak_gb"] - b["peak_gb"] for a, b in zip(res["mlxpaged"], res["mlx_lm"])]
    print(f"mlxpaged - mlx-lm: median {statistics.median(diff):+.3f} GB (range {min(diff):+.3f} to {max(diff):+.3f})")


if __name__ == "__main__":
    main()
