"""Where one engine step's time goes, at 1, 16 and 64 running sequences (greedy decode).

Each phase is timed by wrapping the engine's own methods: scheduling (`Scheduler.schedule`),
the forward pass (`ModelRunner.forward`, input building included), sampling and stop checks
(`LLMEngine._sample`, which waits for the token values), and the rest of `step()`. With
`--noop` the model returns ready-made logits (`--vocab` wide; the runner still builds every
input and the metadata), so what is left is the host work a device could not hide.

    python scripts/bench_step.py --tiny --noop          # host work only
    python scripts/bench_step.py --tiny                 # with the tiny model's forward
    python scripts/bench_step.py                        # the offline 0.5B model
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import mlxpaged  # noqa: F401  (first: system BLAS on Linux)
import mlx.core as mx


def timed(obj, name: str, acc: dict, key: str) -> None:
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] += time.perf_counter() - t

    setattr(obj, name, wrapper)


def run(loaded, num_seqs: int, steps: int, noop: bool, vocab: int) -> dict:
    from mlxpaged import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(loaded, EngineConfig(num_blocks=num_seqs * 16 + 8, max_num_seqs=num_seqs, attention_impl="reference"))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request([(7 * i + j) % 200 + 1 for j in range(20)], params)
    engine.step()  # prefill, outside the measurement
    acc: dict = defaultdict(float)
    if noop:
        logits = mx.random.normal((num_seqs, vocab))
        mx.eval(logits)
        engine.runner.model = lambda tokens, cache, meta: logits[: meta.logits_indices.shape[0]]
    timed(engine.scheduler, "schedule", acc, "schedule")
    timed(engine.runner, "forward", acc, "forward")
    timed(engine, "_sample", acc, "sample")
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - t0
    ms = {k: 1e3 * v / steps for k, v in acc.items()}
    ms["other"] = 1e3 * total / steps - sum(ms.values())
    ms["step"] = 1e3 * total / steps
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--noop", action="store_true", help="forward pass replaced by ready-made logits")
    ap.add_argument("--seqs", default="1,16,64")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=151936, help="logits width of the no-op forward (Qwen2.5's vocabulary)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from mlxpaged.bench.models import load_models

    loaded, _ = load_models(args.model, args.tiny, args.dtype, reference=False)
    print(f"model {loaded.path.name}, {f'no-op forward, vocab {args.vocab}' if args.noop else 'real forward'}, ms per step "
          f"(median of {args.repeats} runs of {args.steps} steps, range in brackets)")
    print(f"{'seqs':>5} | {'step':>17} | {'schedule':>15} | {'forward':>17} | {'sample+stops':>17} | {'other':>15}")
    for n in (int(x) for x in args.seqs.split(",")):
        runs = [run(loaded, n, args.steps, args.noop, args.vocab) for _ in range(args.repeats)]
        cell = lambda k: f"{statistics.median(r[k] for r in runs):7.2f} ({min(r[k] for r in runs):.2f}-{max(r[k] for r in runs):.2f})"  # noqa: E731
        print(f"{n:>5} | {cell('step'):>17} | {cell('schedule'):>15} | {cell('forward'):>17} | {cell('sample'):>17} | {cell('other'):>15}")


if __name__ == "__main__":
    main()
