"""The CPU time per engine step that the device cannot hide, with overlapped steps on and off,
at 1, 16 and 64 running sequences (decode, steady state; greedy unless `--temperature`; `--n`
samples per request).

Three engines run the same workload side by side in one process: `off` and `on`
(EngineConfig.async_scheduling) and `device`, the overlap off with the engine's `mx.async_eval`
replaced by a timed, blocking `mx.eval`: the graph is built before the clock starts, so that time
is the step's device work alone. They take turns in blocks of `--steps` steps, `--repeats`
blocks each, each engine going first in turn, so a busy machine slows all three alike; the
first step of a block is not timed (an overlapped engine's step launched before the break
finished meanwhile). Per step:
- step: wall-clock time of `engine.step()`;
- device: the median device time (the `device` runs);
- unhidden = step - device: the host work the device did not hide, i.e. the time per step the
  device sits idle (the goal: <= 0.5 ms at 64 sequences); on a busy machine this difference of
  two noisy times is noisy itself, so the same idle time is also measured from timestamps:
- idle: the gap between the end of the host's wait for step t (the device done with it) and the
  launch of step t+1 (the start of its `mx.async_eval`), zero when t+1 was launched before that
  wait ended: then the device had t+1 queued when it finished t. Where the host found step t
  already done (wait < 0.05 ms) its end is unknown and the whole span from launch t to launch
  t+1 is counted (an upper bound; `bnd` counts those steps, and their share makes the figure
  loose: with a real model on MLX's CPU backend, whose `async_eval` blocks until most of the
  previous step is done, nearly every overlapped step is such a bound);
- where the host time goes, by wrapping the engine's own methods: `schedule` (Scheduler.schedule),
  `launch` (inputs, forward graph, sampling graph, async_eval), `commit` (update_from_forward,
  pending tokens), `wait` (blocked until the values are ready), `read` (the rest of the read-back:
  tolist, appending, stop checks, detokenizing), `other` (outputs and the rest of step()).
  On MLX's CPU backend `mx.async_eval` itself blocks while more than about 100 operations are
  queued (10 tasks of 10 dispatches), so with a real model's graph part of the device time shows
  up in `launch` rather than `wait`.

With `--noop` the model returns ready-made logits (`--vocab` wide; the runner still builds every
input and the metadata, the sampler still runs on the device): host work against the sampling
alone; a small `--vocab` leaves the device almost nothing to do, so nothing can hide the host.

    python scripts/bench_step.py --tiny --noop                   # host work against sampling only
    python scripts/bench_step.py --tiny --noop --vocab 1024      # a device with next to nothing to do
    python scripts/bench_step.py --tiny --noop --seqs 8 --context 8192  # long block tables
    python scripts/bench_step.py --tiny                          # the tiny model's forward
    python scripts/bench_step.py                                 # the offline 0.5B model (float32)
    python scripts/bench_step.py --seqs 4 --temperature 0.8 --n 4   # one n=4 request (vs --n 1: four requests)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import mlxpaged  # noqa: F401  (first: OpenBLAS must load before MLX, mlxpaged/_blas.py)

# isort: split
import mlx.core as mx

PHASES = ("schedule", "launch", "commit", "wait", "read", "other")
EPS = 0.05e-3  # a wait this short found the values already there
MODES = ("off", "on", "device")


def timed(obj, name: str, acc: dict, key: str) -> None:
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] += time.perf_counter() - t

    setattr(obj, name, wrapper)


class TimingMx:
    """`mlx.core` for the engine module, noting when `async_eval` starts: the device gets the
    step's first operation then (on the CPU backend the call itself may block later, while
    more than about 100 operations are queued). With `blocking`, a timed `eval` instead."""

    def __init__(self, acc: dict, blocking: bool):
        self.acc, self.blocking, self.started = acc, blocking, 0.0

    def __getattr__(self, name):
        return getattr(mx, name)

    def async_eval(self, *arrays):
        self.started = t = time.perf_counter()
        if not self.blocking:
            return mx.async_eval(*arrays)
        mx.eval(*arrays)
        self.acc["device"] += time.perf_counter() - t


class Bench:
    """One engine decoding `num_seqs` sequences in steady state, timed a block at a time."""

    def __init__(
        self,
        loaded,
        num_seqs: int,
        total_steps: int,
        noop: bool,
        vocab: int,
        mode: str,
        temperature: float = 0.0,
        n: int = 1,
        context: int = 20,
    ):
        from mlxpaged import EngineConfig, LLMEngine, SamplingParams

        self.mode = mode
        # (the first rows decode while the others prefill)
        max_tokens = total_steps + 8 + num_seqs * context // 2048 + 2
        blocks = num_seqs * (-(-(context + max_tokens) // 16))
        self.engine = engine = LLMEngine(
            loaded,
            EngineConfig.of(
                num_blocks=blocks + 8, max_num_seqs=num_seqs, attention_impl="reference", async_scheduling=mode == "on"
            ),
        )
        # `num_seqs` rows: num_seqs / n requests of n samples each (their prompts prefilled once).
        for i in range(num_seqs // n):
            params = SamplingParams(temperature=temperature, n=n, seed=i, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request([(7 * i + j) % 200 + 1 for j in range(context)], params)
        sched = engine.scheduler
        while sched.waiting or any(s.num_computed_tokens < context for r in sched.running.values() for s in r.seqs):
            engine.step()  # prefill (in chunks, for a long context)
        for _ in range(3):  # then decode until the overlap's pipeline is full
            engine.step()
        if noop:
            logits = mx.random.normal((num_seqs, vocab))
            mx.eval(logits)
            engine.runner.model = lambda tokens, cache, meta: logits[: meta.logits_indices.shape[0]]
        self.acc: dict = defaultdict(float)
        real_read_back = engine._read_back

        self.launches: dict[int, float] = {}  # step id -> when its launch returned (after async_eval)
        self.waits: dict[int, tuple[float, float]] = {}  # step id -> the host's wait for its values
        real_read_back, real_launch = engine._read_back, engine._launch

        def read_back(step):  # the wait for the device, then the read-back itself
            t = time.perf_counter()
            if step.sampled is not None:
                mx.eval(*step.sampled.arrays())
            self.waits[step.step_id] = (t, time.perf_counter())
            self.acc["wait"] += self.waits[step.step_id][1] - t
            return real_read_back(step)

        self.mx = TimingMx(self.acc, blocking=mode == "device")

        def launch(out):
            step = real_launch(out)
            self.launches[step.step_id] = self.mx.started
            return step

        engine._read_back, engine._launch = read_back, launch
        timed(engine.scheduler, "schedule", self.acc, "schedule")
        timed(engine, "_launch", self.acc, "launch")
        timed(engine, "_commit", self.acc, "commit")
        timed(engine, "_read_back", self.acc, "read_back")

    def device_idle(self) -> tuple[float, int]:
        """Seconds the device sat idle before each timed launch but the first, and how many of
        those are upper bounds (see the module docstring)."""
        ids = sorted(i for i in self.launches if i in self.waits)
        idle, bounded = 0.0, 0
        for prev, cur in zip(ids, ids[1:]):
            start, end = self.waits[prev]
            if end - start >= EPS:
                idle += max(0.0, self.launches[cur] - end)
            else:
                idle += self.launches[cur] - self.launches[prev]
                bounded += 1
        return idle / max(1, len(ids) - 1), bounded

    def block(self, steps: int) -> dict:
        """ms per step of each phase over `steps` steps (after one untimed step)."""
        import mlxpaged.engine.llm_engine as engine_mod

        engine_mod.mx = self.mx
        try:
            self.engine.step()
            self.acc.clear()
            self.launches.clear()
            self.waits.clear()
            t0 = time.perf_counter()
            for _ in range(steps):
                self.engine.step()
            total = time.perf_counter() - t0
            inflight = self.engine._inflight
            if inflight is not None and inflight.sampled is not None:
                mx.eval(*inflight.sampled.arrays())  # nothing of this engine runs during the others' turns
        finally:
            engine_mod.mx = mx
        ms = {k: 1e3 * v / steps for k, v in self.acc.items()}
        ms["read"] = ms.pop("read_back") - ms["wait"]
        ms["step"] = 1e3 * total / steps
        ms["other"] = ms["step"] - sum(ms[k] for k in PHASES if k != "other")
        idle, ms["bnd"] = self.device_idle()
        ms["idle"] = 1e3 * idle
        return ms


def stat(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.3f} ({min(xs):.3f} to {max(xs):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--noop", action="store_true", help="forward pass replaced by ready-made logits")
    ap.add_argument("--seqs", default="1,16,64")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--vocab", type=int, default=151936, help="logits width of the no-op forward (Qwen2.5's vocabulary)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; above 0: a Gumbel draw over the vocabulary per row"
    )
    ap.add_argument("--n", type=int, default=1, help="samples per request (rows = seqs; seqs / n requests)")
    ap.add_argument(
        "--context", type=int, default=20, help="prompt tokens of each request (a long one: long block tables)"
    )
    args = ap.parse_args()
    if args.repeats < 1 or args.steps < 1:
        ap.error("--repeats and --steps must be >= 1")
    try:
        seqs = [int(x) for x in args.seqs.split(",")]
    except ValueError:
        ap.error(f"--seqs takes comma-separated integers, got {args.seqs!r}")
    if args.n < 1 or any(s % args.n for s in seqs) or args.temperature < 0:
        ap.error("--n must be >= 1 and divide every --seqs; --temperature must be >= 0")
    from mlxpaged.bench.models import load_models

    loaded, _ = load_models(args.model, args.tiny, args.dtype, reference=False)
    print(
        f"model {loaded.path.name}, {f'no-op forward, vocab {args.vocab}' if args.noop else 'real forward'}; "
        f"temperature {args.temperature}, n={args.n}, context {args.context}; ms per step, median of "
        f"{args.repeats} blocks of {args.steps} steps (range), engines taking turns"
    )
    print(
        f"{'seqs':>4} {'mode':>6} | {'step':>24} | {'unhidden = step - device':>24} | {'idle':>24} | {'bnd':>4} | "
        + " | ".join(f"{p:>7}" for p in PHASES)
    )
    for n in seqs:
        benches = {
            m: Bench(
                loaded,
                n,
                args.repeats * (args.steps + 1),
                args.noop,
                args.vocab,
                m,
                args.temperature,
                args.n,
                args.context,
            )
            for m in MODES
        }
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(args.repeats):
            for mode in MODES[r % 3 :] + MODES[: r % 3]:  # each mode goes first in turn
                runs[mode].append(benches[mode].block(args.steps))
        del benches
        device = statistics.median(r["device"] for r in runs["device"])
        unhidden = {}
        for mode in MODES:
            rs = runs[mode]
            cells = " | ".join(f"{statistics.median(r[p] for r in rs):7.3f}" for p in PHASES)
            unhidden[mode] = [r["step"] - device for r in rs]
            shown = stat(unhidden[mode]) if mode != "device" else "device " + stat([r["device"] for r in rs])
            bnd = sum(r["bnd"] for r in rs) if mode != "device" else ""
            # Mostly upper bounds: the figure says little (marked "<=").
            loose = mode != "device" and 2 * bnd > len(rs) * (args.steps - 1)
            idle = ("<=" if loose else "") + stat([r["idle"] for r in rs]) if mode != "device" else ""
            print(
                f"{n:>4} {mode:>6} | {stat([r['step'] for r in rs]):>24} | {shown:>24} | {idle:>24} | "
                f"{bnd:>4} | {cells}"
            )
        med = {m: statistics.median(unhidden[m]) for m in ("off", "on")}
        idle = {m: statistics.median(r["idle"] for r in runs[m]) for m in ("off", "on")}
        steps = {m: statistics.median(r["step"] for r in runs[m]) for m in ("off", "on")}
        ratio = lambda a, b: f"{a / b:.2f}x" if b > 0 else "inf"  # noqa: E731
        print(
            f"{n:>4}  ratio | step time off/on {ratio(steps['off'], steps['on'])}; unhidden off/on "
            f"{ratio(med['off'], med['on'])} ({med['off']:.3f} -> {med['on']:.3f} ms); idle off/on "
            f"{ratio(idle['off'], idle['on'])} ({idle['off']:.3f} -> {idle['on']:.3f} ms)"
        )


if __name__ == "__main__":
    main()
