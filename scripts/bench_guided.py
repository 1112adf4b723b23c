"""What grammar-constrained decoding costs per engine step: batch 16 on the tiny model, every row
JSON-schema constrained against every row unconstrained (the same prompts, seeds and lengths).

The tiny model is where the masks' CPU cost weighs most: its forward pass is short, so little
device time hides the host's work. Each run times `--steps` decode steps (after the prefill,
while all rows decode) of both workloads, alternating which goes first; the figure is the ratio
of the constrained step's time to the unconstrained one's, median and range over `--runs` runs.
The two workloads run on two engines side by side, in turns of `--block` steps (the first step
of a turn is not timed), so a busy machine slows both alike; a workload's step time is the
median over its timed steps. The schema keeps every row generating for the timed steps (a
string of 300 to 400 characters comes first). `mask` is the CPU time per step spent filling
the masks (`LLMEngine._masks`). Each step's process CPU time (all threads, MLX's
included) is reported too: on a machine shared with other work, wall time mostly measures
the wait for a core, CPU time the work done.

    python scripts/bench_guided.py                  # 5 runs of 160 timed steps at batch 16
    python scripts/bench_guided.py --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import mlxpaged  # noqa: F401  (first: system BLAS on Linux)

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 300, "maxLength": 400},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"enum": ["paging", "cache", "kernel"]}, "maxItems": 3},
        "draft": {"type": "boolean"},
    },
    "required": ["title", "year", "tags"],
    "additionalProperties": False,
}
PROMPTS = [
    "The KV cache stores",
    "Paged attention borrows an idea from",
    "Write a Python function",
    "Blocks of sixteen",
]


def start(engine, batch: int, max_tokens: int, constrained: bool) -> None:
    """Queue `batch` requests and run until every row decodes (the prompts are prefilled)."""
    from mlxpaged.engine.guided import GuidedDecoding
    from mlxpaged.engine.sampling_params import SamplingParams

    guided = GuidedDecoding(json_schema=SCHEMA) if constrained else None
    for i in range(batch):
        engine.add_request(
            PROMPTS[i % len(PROMPTS)],
            SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True, guided=guided),
        )
    while any(not r.prompt_prefilled for r in engine.scheduler.running.values()) or engine.scheduler.waiting:
        engine.step()
    engine.step()


def finish(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def one_run(engines: dict, batch: int, steps: int, block: int, order: tuple) -> dict:
    """Per-step times (median, seconds) and mask time per step of each engine, stepping them in
    turns of `block` steps; the first step of a turn is not timed (an overlapped engine's step in
    flight finished during the other engine's turn)."""
    times = {c: [] for c in order}
    cpu = {c: [] for c in order}
    masks = {c: 0.0 for c in order}
    for c in order:
        start(engines[c], batch, -(-steps // (block - 1)) * block + 8, c)
    for c in order:
        eng = engines[c]
        real = eng._masks

        def timed(step, real=real, c=c):
            t = time.perf_counter()
            try:
                return real(step)
            finally:
                masks[c] += time.perf_counter() - t

        eng._masks = timed
    while min(len(t) for t in times.values()) < steps:
        for c in order:
            engines[c].step()
            for _ in range(block - 1):
                t, tc = time.perf_counter(), time.process_time()
                engines[c].step()
                times[c].append(time.perf_counter() - t)
                cpu[c].append(time.process_time() - tc)
    for c in order:
        eng = engines[c]
        running = [s for r in eng.scheduler.running.values() for s in r.live_seqs()]
        assert len(running) == batch, f"only {len(running)} rows still decoding: lengthen the schema's string"
        del eng._masks
        finish(eng)
    n_steps = {c: len(times[c]) + len(times[c]) // (block - 1) for c in order}
    return {c: (statistics.median(times[c]), masks[c] / n_steps[c], statistics.median(cpu[c])) for c in order}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=160, help="timed steps per workload and run")
    ap.add_argument("--block", type=int, default=4, help="steps per turn (the first of each is not timed)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.llm_engine import LLMEngine
    from mlxpaged.loading.loader import load
    from mlxpaged.testing.tiny_model import write_tiny_qwen2

    path = write_tiny_qwen2(Path(tempfile.mkdtemp()) / "tiny")
    loaded = load(str(path), "float32")
    engines = {c: LLMEngine(loaded, EngineConfig.of(num_blocks=1024, max_num_seqs=args.batch)) for c in (False, True)}
    one_run(engines, args.batch, 8, args.block, (False, True))  # warm-up: compiles the grammar (cached) and the graphs
    rows = []
    for run in range(args.runs):
        order = (False, True) if run % 2 == 0 else (True, False)
        got = one_run(engines, args.batch, args.steps, args.block, order)
        (free, _, free_cpu), (cons, mask, cons_cpu) = got[False], got[True]
        rows.append(
            {
                "unconstrained_ms": free * 1e3,
                "constrained_ms": cons * 1e3,
                "mask_ms": mask * 1e3,
                "unconstrained_cpu_ms": free_cpu * 1e3,
                "constrained_cpu_ms": cons_cpu * 1e3,
                "ratio": cons / free,
                "cpu_ratio": cons_cpu / free_cpu,
                "first": "constrained" if order[0] else "unconstrained",
            }
        )
        print(
            f"run {run}: unconstrained {free * 1e3:.2f} ms/step (cpu {free_cpu * 1e3:.2f}), constrained "
            f"{cons * 1e3:.2f} ms/step (cpu {cons_cpu * 1e3:.2f}; masks {mask * 1e3:.2f}), ratio {cons / free:.3f} "
            f"(cpu {cons_cpu / free_cpu:.3f})"
        )
    summary = {"batch": args.batch, "steps": args.steps, "runs": rows}
    for key in ("ratio", "cpu_ratio"):
        vals = [r[key] for r in rows]
        summary.update({f"{key}_median": statistics.median(vals), f"{key}_min": min(vals), f"{key}_max": max(vals)})
    print(
        f"constrained / unconstrained step at batch {args.batch} over {args.runs} runs: wall median "
        f"{summary['ratio_median']:.3f} (range {summary['ratio_min']:.3f}-{summary['ratio_max']:.3f}), "
        f"process CPU time median {summary['cpu_ratio_median']:.3f} "
        f"(range {summary['cpu_ratio_min']:.3f}-{summary['cpu_ratio_max']:.3f})"
    )
    if args.json:
        from mlxpaged.bench.report import write_json

        summary["schema"] = SCHEMA
        summary["load_average"] = list(os.getloadavg())
        write_json(args.json, "bench_guided", "tiny", summary)


if __name__ == "__main__":
    main()
