"""Tensor parallelism on one machine: decode tokens/s and per-rank memory, W=1 against W=2.

W=1 is the plain engine in one process; W=2 is `LLM(..., distributed=True)` on two ranks of the
ring backend on this machine (started with the environment `mlx.launch -n 2 --backend ring` gives them).
Each repeat runs both, alternating which goes
first; the clock is the engine's own decode span (pure-decode steps, after a warm-up request),
the same span for both. Here the two ranks share the same CPU cores, so W=2 cannot be faster:
this measures TP's overhead, and the all_sum time per step says how much of it is the collective
(2 all_sums per layer per step, each timed alone on the step's [1, hidden] activation). By
default each W=2 rank gets half the cores' BLAS threads (OPENBLAS_NUM_THREADS), as each Mac
would bring its own; --no-split-cores lets both ranks contend for all of them.

The two-Mac estimate assumes decode reads every weight once per token (bandwidth-bound) and adds
2 * layers all_sums of hidden * 2 bytes (float16) per token, each costing latency + bytes / link
bandwidth; see `estimate`. Assumptions are flags.

    python scripts/bench_tp.py                 # the offline Qwen2.5-Coder-0.5B, float32 on the CPU
    python scripts/bench_tp.py --tiny --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a Python function that merges two sorted lists into one sorted list."


# -- one run (in each rank, or the single process) --------------------------------------------------------
def worker(a) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import mlxpaged  # noqa: F401  (first: system BLAS on Linux)
    from mlxpaged import LLM, SamplingParams

    model = None if a.model == "default" else a.model
    llm = LLM(model, dtype="float32", num_blocks=64, distributed=a.world > 1)
    eng = llm.engine
    ids = llm.tokenizer.encode(PROMPT)
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    t0, n0 = eng.stats.decode_time, eng.stats.decode_tokens
    llm.generate(ids, sp)
    tps = (eng.stats.decode_tokens - n0) / (eng.stats.decode_time - t0)
    args = eng.loaded.model.args
    res = {
        "world": a.world,
        "tps": tps,
        "layers": args.num_hidden_layers,
        "hidden": args.hidden_size,
        "weight_bytes": sum(v.nbytes for _, v in tree_flatten(eng.loaded.model.parameters())),
        "pool_bytes": eng.kv_cache.nbytes,
        "active_bytes": mx.get_active_memory(),
        "peak_bytes": mx.get_peak_memory(),
        "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if a.world > 1:
        group = eng.group
        x = mx.ones((1, args.hidden_size), mx.float32)
        samples = []
        for _ in range(5):  # 5 batches of 100 lone all_sums; median per call
            mx.eval(mx.distributed.all_sum(x, group=group))
            t = time.perf_counter()
            for _ in range(100):
                mx.eval(mx.distributed.all_sum(x, group=group))
            samples.append((time.perf_counter() - t) / 100)
        res["allsum_s"] = statistics.median(samples)
        res["rank"] = group.rank()
    Path(a.out.format(rank=res.get("rank", 0))).write_text(json.dumps(res))


# -- the driver --------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(world: int, a, tmp: Path) -> list[dict]:
    out = str(tmp / f"w{world}-rank{{rank}}.json")
    args = [
        __file__,
        "--worker",
        "--world",
        str(world),
        "--model",
        a.model,
        "--max-tokens",
        str(a.max_tokens),
        "--out",
        out,
    ]
    for r in range(world):
        Path(out.format(rank=r)).unlink(missing_ok=True)
    # The ranks are started as mlx.launch starts them (MLX_RANK, MLX_HOSTFILE; ring backend), but
    # without the launcher itself, which polls the ranks' output and takes half a core here.
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{_free_port()}"] for _ in range(world)]))
    threads = {}
    if a.split_cores:  # each rank gets its share of the cores, as each Mac would have its own
        n = str(max(1, (os.cpu_count() or 1) // world))
        threads = {"OPENBLAS_NUM_THREADS": n, "OMP_NUM_THREADS": n}

    def env(r):
        return {
            **os.environ,
            **threads,
            **({"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)} if world > 1 else {}),
        }

    procs = [
        subprocess.Popen([sys.executable, *args], stderr=subprocess.PIPE, text=True, env=env(r)) for r in range(world)
    ]
    errs = [p.communicate()[1] for p in procs]
    try:
        return [json.loads(Path(out.format(rank=r)).read_text()) for r in range(world)]
    except FileNotFoundError:
        sys.exit(f"error: the W={world} run wrote no result:\n{errs[0][-2000:]}")


def estimate(weight_bytes_w1: float, weight_bytes_w2: float, layers: int, hidden: int, a) -> tuple[float, float]:
    """Tokens/s on one Mac and on two over Thunderbolt 5: bytes read per token at `--mem-gbps`,
    plus (W=2) 2 * layers all_sums of hidden float16 values at `--latency-us` + bytes / link."""
    bw, link = a.mem_gbps * 1e9, a.link_gbps * 1e9 / 8
    comm = 2 * layers * (a.latency_us * 1e-6 + 2 * hidden / link)
    return bw / weight_bytes_w1, 1.0 / (weight_bytes_w2 / bw + comm)


def fmt(xs: list[float], unit: str = "") -> str:
    return f"{statistics.median(xs):.2f}{unit} [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="checkpoint directory or .gguf (default: the offline 0.5B)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random checkpoint (seconds, for a smoke run)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mem-gbps", type=float, default=546.0, help="unified-memory bandwidth of each Mac (M4 Max: 546)")
    ap.add_argument("--link-gbps", type=float, default=80.0, help="Thunderbolt 5: 80 Gb/s each way")
    ap.add_argument(
        "--latency-us", type=float, default=300.0, help="per all_sum; ~300 over TCP (ring), <50 with RDMA (JACCL)"
    )
    ap.add_argument(
        "--split-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give each rank cores/W BLAS threads (W=1 gets all); --no-split-cores lets every rank use all",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    tmp = Path(tempfile.mkdtemp(prefix="bench-tp-"))
    if a.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from mlxpaged.testing.tiny_model import write_tiny_qwen2

        a.model = str(write_tiny_qwen2(tmp / "tiny"))
    runs: dict[int, list[list[dict]]] = {1: [], 2: []}
    for i in range(a.repeats):
        for w in (1, 2) if i % 2 == 0 else (2, 1):
            runs[w].append(run_once(w, a, tmp))
            print(f"repeat {i + 1}, W={w}: {runs[w][-1][0]['tps']:.2f} tokens/s", file=sys.stderr)
    t1 = [r[0]["tps"] for r in runs[1]]
    t2 = [r[0]["tps"] for r in runs[2]]
    ratios = [b / c for b, c in zip(t2, t1)]
    one, two = runs[1][-1][0], runs[2][-1]
    allsum = [r[0]["allsum_s"] * 1e6 for r in runs[2]]
    per_step_ms = [2 * one["layers"] * u / 1e3 for u in allsum]
    step_ms = [1e3 / t for t in t2]
    gb = 1e9
    cores = f"{os.cpu_count()} cores, " + (
        "BLAS threads split between the ranks" if a.split_cores else "every rank on all cores"
    )
    print(
        f"model: {a.model}, float32 on the CPU ({cores}), batch 1, {a.max_tokens} greedy tokens, "
        f"{a.repeats} repeats (alternating)"
    )
    print(f"W=1 decode: {fmt(t1, ' tok/s')}; W=2 decode: {fmt(t2, ' tok/s')}; W=2/W=1: {fmt(ratios, 'x')}")
    print(
        f"all_sum [1, {one['hidden']}] float32: {fmt(allsum, ' us')} per call; {2 * one['layers']} per step = "
        f"{fmt(per_step_ms, ' ms')} of a {fmt(step_ms, ' ms')} W=2 step"
    )
    print(
        f"W=1 memory: weights {one['weight_bytes'] / gb:.3f} GB, KV pool {one['pool_bytes'] / gb:.4f} GB, "
        f"MLX peak {one['peak_bytes'] / gb:.3f} GB, max RSS {one['maxrss_bytes'] / gb:.3f} GB"
    )
    for r in two:
        print(
            f"W=2 rank {r['rank']} memory: weights {r['weight_bytes'] / gb:.3f} GB "
            f"({r['weight_bytes'] / one['weight_bytes']:.2f} of W=1), KV pool {r['pool_bytes'] / gb:.4f} GB "
            f"({r['pool_bytes'] / one['pool_bytes']:.2f}), MLX peak {r['peak_bytes'] / gb:.3f} GB, "
            f"max RSS {r['maxrss_bytes'] / gb:.3f} GB"
        )
    # The Mac estimate, in float16: 2 bytes a weight.
    w1, w2 = one["weight_bytes"] / 2, two[0]["weight_bytes"] / 2
    for lat, name in ((a.latency_us, "ring over TCP"), (min(a.latency_us, 50.0), "JACCL over RDMA")):
        a2 = argparse.Namespace(**{**vars(a), "latency_us": lat})
        s1, s2 = estimate(w1, w2, one["layers"], one["hidden"], a2)
        print(
            f"estimate, two Macs ({a.mem_gbps:g} GB/s) over Thunderbolt 5, {name} ({lat:g} us per all_sum), float16: "
            f"W=1 {s1:.0f} tok/s, W=2 {s2:.0f} tok/s ({s2 / s1:.2f}x)"
        )
        # A 72B-class model at 4 bits (Qwen2.5-72B: 80 layers, hidden 8192, ~40 GB; ~1 GB replicated embedding/head).
        s1, s2 = estimate(40e9, 20.5e9, 80, 8192, a2)
        print(
            f"  same link, a 72B 4-bit model (40 GB; 20.5 GB a rank): W=1 {s1:.1f} tok/s (if it fit), "
            f"W=2 {s2:.1f} tok/s ({s2 / s1:.2f}x)"
        )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
