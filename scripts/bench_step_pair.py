"""The host work per decode step of two checkouts of mlxpaged in one process, taking turns.

`bench_step_ab.py` runs `bench_step.py --tiny --noop` from each checkout in processes of their
own. On this project's 2-core VM a process draws one of two speeds when it starts (the same
code's 8-sequence step reads 0.29 or 0.45 ms of host work from one start to the next), so a
round's ratio moves with the speeds its two processes drew. Here both checkouts run in the same
process, on the same ready-made logits, and take turns block by block (each going first in turn),
so both see the same speed; the ratio is taken within each round.

Checkout B is imported as `mlxpaged`, checkout A as `mlxpaged_a` (its modules import each other
relatively; the Metal paths that import `mlxpaged` by name are not used by the reference
attention). Each builds its engines on its own load of the tiny checkpoint, decoding `--seqs`
sequences in steady state (a fresh engine for each block: 20-token prompts, then `--steps`
steps timed after 8), greedy, overlapped steps off, the forward pass replaced by one shared
`[seqs, --vocab]` logits array from its first step (`bench_step.py --noop` after its prefill).
Per step:
- host: the wall-clock time of `engine.step()` less its wait for the device (the `mx.eval` of the
  step's draws before the read-back, as `bench_step.py` times it): bench_step.py's `off` row summed;
- cpu: the engine thread's CPU time (`time.thread_time`) of the step, as `bench_host_ab.py`.
Reported per batch size: each checkout's median over rounds of its blocks' medians, the range,
and the ratio A / B within each round (median and range).

    python scripts/bench_step_pair.py --a .base --b . --seqs 1,8,64 --rounds 9
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time


def load_package(checkout: str, name: str):
    """The `mlxpaged` package of `checkout`, imported under `name`."""
    root = os.path.join(os.path.abspath(checkout), "mlxpaged")
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(root, "__init__.py"), submodule_search_locations=[root]
    )
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    spec.loader.exec_module(pkg)
    return pkg


class Side:
    """One checkout's tiny model; `block` builds an engine decoding `n` sequences on the shared
    logits and times `steps` steps of it (a fresh engine each block: every block decodes the same
    token positions, as bench_step.py's blocks do, since the older engines' cost grows with them)."""

    def __init__(self, pkg, mx):
        self.pkg, self.mx = pkg, mx
        self.loaded = importlib.import_module(pkg.__name__ + ".bench.models").load_models(
            None, True, "float32", reference=False
        )[0]

    def engine(self, n: int, steps: int, logits, context: int = 20):
        pkg, mx = self.pkg, self.mx
        make = getattr(pkg.EngineConfig, "of", pkg.EngineConfig)  # the config's constructor at either commit
        max_tokens = steps + 16
        blocks = n * (-(-(context + max_tokens) // 16)) + 8
        config = make(num_blocks=blocks, max_num_seqs=n, attention_impl="reference", async_scheduling=False)
        engine = pkg.LLMEngine(self.loaded, config)
        # From the first step: the two packages' adapters patch the same mlx-lm module (each would
        # find the other's patch), and the host's work does not depend on the logits' values.
        engine.runner.model = lambda tokens, cache, meta: logits[: meta.logits_indices.shape[0]]
        params = pkg.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(n):
            engine.add_request([(7 * i + j) % 200 + 1 for j in range(context)], params)
        sched = engine.scheduler
        while sched.waiting or any(s.num_computed_tokens < context for r in sched.running.values() for s in r.seqs):
            engine.step()
        waits = []
        real = engine._read_back

        def read_back(step):  # the wait for the device, then the read-back itself
            t = time.perf_counter()
            if step.sampled is not None:
                mx.eval(*step.sampled.arrays())
            waits.append(time.perf_counter() - t)
            return real(step)

        engine._read_back = read_back
        for _ in range(8):  # warm
            engine.step()
        return engine, waits

    def block(self, n: int, steps: int, logits) -> tuple[float, float]:
        """Median ms per step over `steps` steps of a fresh engine: (host wall-clock less the wait, thread CPU)."""
        engine, waits = self.engine(n, steps, logits)
        gc.collect()
        host, cpu, step = [], [], engine.step
        for _ in range(steps):
            waits.clear()
            c, t = time.thread_time(), time.perf_counter()
            step()
            t, c = time.perf_counter() - t, time.thread_time() - c
            host.append(t - sum(waits))
            cpu.append(c)
        return 1e3 * statistics.median(host), 1e3 * statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="checkout A (the reference, e.g. the older commit)")
    ap.add_argument("--b", default=".", help="checkout B")
    ap.add_argument("--seqs", default="1,8,64")
    ap.add_argument("--steps", type=int, default=150, help="steps per block (bench_step.py: 3 blocks of 50)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--vocab", type=int, default=151936, help="logits width (Qwen2.5's vocabulary)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be >= 1")
    try:
        seqs = [int(x) for x in args.seqs.split(",")]
    except ValueError:
        ap.error(f"--seqs takes comma-separated integers, got {args.seqs!r}")
    sys.path.insert(0, os.path.abspath(args.b))
    pkg_b = importlib.import_module("mlxpaged")  # first: OpenBLAS must load before MLX (mlxpaged/_blas.py)
    if os.path.dirname(os.path.abspath(pkg_b.__file__)) != os.path.join(os.path.abspath(args.b), "mlxpaged"):
        raise SystemExit(f"`mlxpaged` came from {pkg_b.__file__}, not from --b {args.b}")
    pkg_a = load_package(args.a, "mlxpaged_a")
    import mlx.core as mx

    sides = {"a": Side(pkg_a, mx), "b": Side(pkg_b, mx)}
    result = {
        "command": "python scripts/bench_step_pair.py " + " ".join(sys.argv[1:]),
        "packages": {"a": [pkg_a.__name__, pkg_a.__file__], "b": [pkg_b.__name__, pkg_b.__file__]},
        "by_seqs": {},
    }
    print(f"ms per step, median of {args.rounds} rounds of {args.steps}-step blocks (range); ratio A/B within a round")
    print(f"{'seqs':>4} | {'':>4} | {'A':>22} | {'B':>22} | {'A/B':>22}")
    for n in seqs:
        logits = mx.random.normal((n, args.vocab))
        mx.eval(logits)
        got = {"a": [], "b": []}
        for r in range(args.rounds):
            for name in ("a", "b") if r % 2 == 0 else ("b", "a"):
                got[name].append(sides[name].block(n, args.steps, logits))
        row = {}
        for k, label in ((0, "host"), (1, "cpu")):
            a, b = [x[k] for x in got["a"]], [x[k] for x in got["b"]]
            ratios = [x / y for x, y in zip(a, b)]
            row[label] = {"a": a, "b": b, "ratio": ratios}
            fmt = lambda xs: f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"  # noqa: E731
            print(f"{n:>4} | {label:>4} | {fmt(a):>22} | {fmt(b):>22} | {fmt(ratios):>22}")
        result["by_seqs"][str(n)] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
