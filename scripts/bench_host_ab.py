"""Host work per decode step of two checkouts of mlxpaged, side by side: the CPU time of the
engine's thread per `engine.step()` (`time.thread_time`), which a busy machine's other work does
not inflate the way it inflates wall-clock phases (`scripts/bench_step.py`, which also says where
the time goes).

Each checkout runs in a process of its own (its package first on `sys.path`), the two taking
turns `--repeats` times, each going first in turn; within a turn both time the same workload:
`--seqs` sequences decoding in steady state, greedy, with the forward pass replaced by
ready-made logits (`--vocab` wide; `bench_step.py --noop`), overlapped steps off, so a step's CPU
time is the host's whole share: scheduling, building the inputs and the sampling graph, launching
it, reading the tokens back, stop checks, detokenizing and the outputs. Waiting for the device
takes no CPU. Reported per batch size: the median over steps of each turn, the median and range
of the turns, and the ratio A / B within each turn.

Part of each step is MLX's own: creating the step's arrays, `mx.async_eval`, and `tolist`, whose
wait for the CPU backend's stream thread itself costs the waiting thread CPU time. Each process
also times those calls alone, with no engine around them (the floor: four metadata arrays, the
block tables, the argmax over the same logits, `async_eval`, `tolist`), and the table gives the
ratio of what lies above it, (A - floor) / (B - floor): the engine's own host work.

    python scripts/bench_host_ab.py --a /tmp/base --b . --seqs 1,8,64 --repeats 5
    python scripts/bench_host_ab.py --a /tmp/base --b . --seqs 1,8 --context 8192   # long contexts
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import mlxpaged  # first: OpenBLAS before MLX
import mlx.core as mx
from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.bench.models import load_models

seqs, steps, vocab, context, penalty = (json.loads(a) for a in sys.argv[2:7])
loaded = load_models(None, True, "float32", reference=False)[0]
out = {}
for n in seqs:
    make = getattr(EngineConfig, "of", EngineConfig)  # the config's constructor at either commit
    max_tokens = steps + 16 + n * context // 2048 + 2  # (the first rows decode while the others prefill)
    blocks = n * (-(-(context + max_tokens) // 16)) + 8
    config = make(num_blocks=blocks, max_num_seqs=n, attention_impl="reference", async_scheduling=False)
    engine = LLMEngine(loaded, config)
    pen = {"repetition_penalty": penalty} if penalty != 1.0 else {}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **pen)
    for i in range(n):
        engine.add_request([(7 * i + j) % 200 + 1 for j in range(context)], params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < context for r in sched.running.values() for s in r.seqs):
        engine.step()  # prefill (in chunks, for a long context)
    for _ in range(3):
        engine.step()
    logits = mx.random.normal((n, vocab))
    mx.eval(logits)
    engine.runner.model = lambda tokens, cache, meta: logits[: meta.logits_indices.shape[0]]
    for _ in range(5):
        engine.step()
    cpu = []
    for _ in range(steps):
        t = time.thread_time()
        engine.step()
        cpu.append(time.thread_time() - t)
    out[n] = statistics.median(cpu) * 1e3
    # The floor: the MLX calls a greedy decode step makes, with no engine around them (the
    # metadata's four arrays and the input ids, the forward's slice, the argmax, async_eval and the
    # read-back's tolist), at the same width and block count: MLX's own cost per step.
    width = -(-(context + 8 + steps) // 16)
    ids = list(range(n))
    def bare():
        a = [mx.array(ids, dtype=mx.int32) for _ in range(4)]
        t = mx.array([ids[:1] * width] * n, dtype=mx.int32)
        toks = mx.argmax(logits[:n], axis=-1)
        mx.async_eval(toks, t, *a)
        return toks.tolist()
    for _ in range(5):
        bare()
    cpu = []
    for _ in range(steps):
        t0 = time.thread_time()
        bare()
        cpu.append(time.thread_time() - t0)
    out[f"floor{n}"] = statistics.median(cpu) * 1e3
print(json.dumps(out))
"""


def run(
    checkout: str, seqs: list[int], steps: int, vocab: int, context: int = 20, penalty: float = 1.0
) -> dict[str, float]:
    """One process's medians: ms per step by batch size ("8"), and MLX's floor at it ("floor8")."""
    env = dict(os.environ, PYTHONPATH=checkout)
    args = [
        sys.executable,
        "-c",
        WORKER,
        checkout,
        json.dumps(seqs),
        str(steps),
        str(vocab),
        str(context),
        str(penalty),
    ]
    res = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="checkout A (the reference, e.g. the older commit)")
    ap.add_argument("--b", default=".", help="checkout B")
    ap.add_argument("--seqs", default="1,8,64")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--context", type=int, default=20, help="prompt tokens a request (long: long block tables)")
    ap.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="every request's (1: none; else its counts each step)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    turns = []
    for r in range(args.repeats):
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        got = {
            who: run(getattr(args, who), seqs, args.steps, args.vocab, args.context, args.repetition_penalty)
            for who in order
        }
        turns.append(got)
        print(
            f"turn {r + 1}: " + "; ".join(f"{n}: A {got['a'][str(n)]:.3f} B {got['b'][str(n)]:.3f} ms" for n in seqs),
            flush=True,
        )
    rows = {}
    print(
        "seqs | A ms/step (range) | B ms/step (range) | A/B within a turn (range) | MLX floor ms "
        "| A/B above the floor (range)"
    )
    for n in seqs:
        a = [t["a"][str(n)] for t in turns]
        b = [t["b"][str(n)] for t in turns]
        floor = [min(t["a"][f"floor{n}"], t["b"][f"floor{n}"]) for t in turns]  # the turn's quieter one
        ratio = [x / y for x, y in zip(a, b)]
        own = [(x - f) / (y - f) for x, y, f in zip(a, b, floor)]
        rows[n] = {"a": a, "b": b, "ratio": ratio, "floor": floor, "ratio_above_floor": own}
        print(
            f"{n:4d} | {statistics.median(a):.3f} ({min(a):.3f}-{max(a):.3f}) | {statistics.median(b):.3f} "
            f"({min(b):.3f}-{max(b):.3f}) | {statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}) "
            f"| {statistics.median(floor):.3f} | {statistics.median(own):.2f}x ({min(own):.2f}-{max(own):.2f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "a": args.a, "b": args.b, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
