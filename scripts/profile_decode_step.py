"""Where a batch-1 decode step's time goes: mlxpaged against mlx-lm on the same model, prompt and tokens.

Everything is timed twice: by the wall clock and by the process's CPU time (`time.process_time`,
all threads: BLAS's, MLX's and the host's). On a shared machine the wall time of the same step
moves by 2x and more with the other processes; its CPU time moves much less, so it is the figure
that says whether the two do the same work. Three parts:
- steps: steady-state decode steps of one greedy request (the first benchmark prompt, EOS
  ignored): mlxpaged's `LLMEngine.step()` (overlapped steps on, as `mlxpaged generate` and
  bench_decode.py run it), mlx-lm's `generate_step` (what `stream_generate` runs) and mlx-lm's
  `BatchGenerator.next_generated()` (what bench_decode.py compares with). A block builds a fresh
  system on the prompt, runs 3 steps, times `--steps`; the three take turns `--repeats` times,
  each going first in turn; ratios are formed within a round. Every block's tokens must be the
  same (checked: the run stops otherwise).
- passes: one decode forward pass and its argmax, evaluated (bench_forward.py's systems, at
  `--context` cached tokens); the same with every weight matmul stubbed out (each `nn.Linear` and the tied
  output layer a broadcast of one input column, in both systems: what is left is the norms, RoPE,
  attention, the KV writes, the argmax and building the graph); and the weight matmuls alone
  (every `nn.Linear` and the output layer on one row, nothing else). The passes take turns one
  by one, `--passes` times each.
- ops: the operations of one step's graph by primitive (`mx.export_to_dot`): mlxpaged's launched
  step, mlx-lm's `generate_step` step (forward, logsumexp, argmax).

    python scripts/profile_decode_step.py --json docs/data/profile_decode_step_b1_float32.json
    python scripts/profile_decode_step.py --dtype bfloat16 --steps 6 --repeats 3
    python scripts/profile_decode_step.py --tiny --steps 16 --repeats 5 --passes 100
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import mlxpaged  # noqa: F401  (first: OpenBLAS must load before MLX, mlxpaged/_blas.py)

# isort: split
import mlx.core as mx
import mlx.nn as nn

WARM = 3  # steps before a block's clock starts (prefill, first decodes)


def clocks():
    return time.perf_counter(), time.process_time()


def since(start) -> tuple[float, float]:
    w, c = clocks()
    return 1e3 * (w - start[0]), 1e3 * (c - start[1])


def engine_block(loaded, prompt: list[int], steps: int):
    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.llm_engine import LLMEngine
    from mlxpaged.engine.sampling_params import SamplingParams

    need = -(-(len(prompt) + steps + WARM + 1) // 16) + 8
    engine = LLMEngine(loaded, EngineConfig.of(num_blocks=need, enable_prefix_caching=False, max_num_seqs=64))
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=steps + WARM + 1, ignore_eos=True))
    times, outs = [], []
    for i in range(steps + WARM):
        start = clocks()
        engine.step()
        if i >= WARM:
            times.append(since(start))
    while engine.has_unfinished_requests():
        outs = engine.step() or outs
    return times, list(outs[0].outputs[0].token_ids)


def generate_step_block(ref, prompt: list[int], steps: int):
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    gen = generate_step(mx.array(prompt), ref, max_tokens=steps + WARM + 1, sampler=make_sampler(temp=0.0))
    times, tokens = [], []
    for i in range(steps + WARM):
        start = clocks()
        y, _ = next(gen)
        if i >= WARM:
            times.append(since(start))
        tokens.append(y)
    return times, tokens + [y for y, _ in gen]


def batch_generator_block(ref, prompt: list[int], steps: int):
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    gen = BatchGenerator(
        ref, stop_tokens=[], sampler=make_sampler(temp=0.0), completion_batch_size=32, prefill_batch_size=1
    )
    gen.insert([prompt], [steps + WARM + 1])
    times, tokens = [], []
    for i in range(steps + WARM):
        start = clocks()
        got = gen.next_generated()
        if i >= WARM:
            times.append(since(start))
        tokens += [r.token for r in got]
    while got := gen.next_generated():
        tokens += [r.token for r in got]
    gen.close()
    return times, tokens


def summary(values: list[float]) -> dict:
    from mlxpaged.bench.repeat import spread

    return spread(values)


def compare_steps(loaded, ref, prompt: list[int], steps: int, repeats: int) -> dict:
    systems = {
        "mlxpaged": lambda: engine_block(loaded, prompt, steps),
        "mlx-lm generate_step": lambda: generate_step_block(ref, prompt, steps),
        "mlx-lm BatchGenerator": lambda: batch_generator_block(ref, prompt, steps),
    }
    names = list(systems)
    for n in names:
        systems[n]()  # warm-up
    per = {n: {"wall_ms": [], "cpu_ms": []} for n in names}
    tokens = None
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            times, toks = systems[n]()
            if tokens is None:
                tokens = toks
            elif toks != tokens:
                raise SystemExit(f"{n} made other tokens: {toks} against {tokens}")
            per[n]["wall_ms"].append(statistics.median(t[0] for t in times))
            per[n]["cpu_ms"].append(statistics.median(t[1] for t in times))
    out = {"tokens": tokens, "systems": {}}
    for n in names:
        row = {k: summary(v) for k, v in per[n].items()}
        if n != "mlxpaged":
            for k in ("wall_ms", "cpu_ms"):  # mlx-lm's per-token time over mlxpaged's: > 1, mlxpaged faster
                row[f"speed_ratio_{k[:-3]}"] = summary([b / a for a, b in zip(per["mlxpaged"][k], per[n][k])])
        out["systems"][n] = row
    return out


@contextmanager
def matmuls_stubbed():
    """Every `nn.Linear` (and a tied output layer, `nn.Embedding.as_linear`) returns a broadcast of
    its input's first column, of the output's shape: no weight is read (timing only)."""
    linear, as_linear = nn.Linear.__call__, nn.Embedding.as_linear

    def stub(self, x):
        return mx.broadcast_to(x[..., :1], (*x.shape[:-1], self.weight.shape[0]))

    nn.Linear.__call__, nn.Embedding.as_linear = stub, stub
    try:
        yield
    finally:
        nn.Linear.__call__, nn.Embedding.as_linear = linear, as_linear


def weight_matmuls(ref):
    """One pass's weight matmuls alone: every `nn.Linear` of the model and the output layer on
    one row of ones (the same BLAS calls as a batch-1 decode pass, none of the rest)."""
    linears = [m for _, m in ref.named_modules() if isinstance(m, nn.Linear)]
    head = ref.get("lm_head") if isinstance(ref.get("lm_head"), nn.Linear) else None
    embed = next(m for _, m in ref.named_modules() if isinstance(m, nn.Embedding))
    rows = {}

    def run():
        outs = []
        for lin in linears:
            n = lin.weight.shape[1]
            if n not in rows:
                rows[n] = mx.ones((1, 1, n), dtype=lin.weight.dtype)
            outs.append(lin(rows[n]))
        if head is None:  # tied: the output layer is the embedding's
            n = embed.weight.shape[1]
            outs.append(embed.as_linear(rows.setdefault(n, mx.ones((1, 1, n), dtype=embed.weight.dtype))))
        mx.eval(outs)

    return run


def compare_passes(loaded, ref, context: int, passes: int) -> dict:
    from bench_forward import systems  # scripts/bench_forward.py: the same passes it times

    full = systems(loaded, ref, 1, context)
    runs = {
        "mlxpaged": full["mlxpaged"],
        "mlx-lm": full["mlx-lm"],
        "weight matmuls alone": weight_matmuls(ref),
    }

    def stubbed(fn):
        def run():
            with matmuls_stubbed():
                fn()

        return run

    for name in ("mlxpaged", "mlxpaged, no write", "mlxpaged, contiguous", "mlx-lm"):
        runs[f"{name}, matmuls stubbed"] = stubbed(full[name])
    names = list(runs)
    for n in names:
        for _ in range(3):
            runs[n]()
    per = {n: {"wall_ms": [], "cpu_ms": []} for n in names}
    for i in range(passes):
        for n in names if i % 2 == 0 else names[::-1]:
            start = clocks()
            runs[n]()
            w, c = since(start)
            per[n]["wall_ms"].append(w)
            per[n]["cpu_ms"].append(c)
    out = {}
    for n in names:
        out[n] = {k: summary(v) for k, v in per[n].items()}
        out[n]["cpu_ms_q25"] = statistics.quantiles(per[n]["cpu_ms"], n=4)[0]
    return out


def count_ops(arrays) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "graph.dot"
        mx.export_to_dot(str(path), *arrays)
        return dict(collections.Counter(re.findall(r'label ="([^"]+)"', path.read_text())).most_common())


def compare_ops(loaded, ref, prompt: list[int]) -> dict:
    """The primitives of one steady-state decode step of each."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.llm_engine import LLMEngine
    from mlxpaged.engine.sampling_params import SamplingParams

    engine = LLMEngine(loaded, EngineConfig.of(num_blocks=64, enable_prefix_caching=False, max_num_seqs=64))
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for _ in range(WARM + 2):
        engine.step()
    real, seen = mx.async_eval, {}

    def capture(*arrays):
        # The step's sampled tokens (its last array) depend on the whole pass, the KV writes included.
        seen.setdefault("ops", count_ops(arrays[-1:]))
        return real(*arrays)

    mx.async_eval = capture
    try:
        engine.step()
    finally:
        mx.async_eval = real
    cache = make_prompt_cache(ref)
    mx.eval(ref(mx.array(prompt)[None], cache=cache), [c.state for c in cache])
    logits = ref(mx.array([[prompt[-1]]]), cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)  # generate_step's step
    theirs = count_ops([mx.argmax(logprobs, axis=-1), logprobs])
    mx.eval(logprobs)
    return {"mlxpaged": seen["ops"], "mlx-lm generate_step": theirs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiny", action="store_true", help="a tiny random-weight Qwen2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per block")
    ap.add_argument("--repeats", type=int, default=5, help="rounds of the three step blocks")
    ap.add_argument("--passes", type=int, default=20, help="timed passes of each pass variant (0 skips them)")
    ap.add_argument("--context", type=int, default=100, help="cached tokens of the timed passes")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()

    from mlxpaged.bench.models import load_models, model_label
    from mlxpaged.bench.prompts import encode_chat, load_prompts
    from mlxpaged.bench.report import write_json
    from mlxpaged.errors import MlxPagedError

    try:
        if min(args.steps, args.repeats, args.context) < 1 or args.passes < 0:
            raise ValueError("--steps, --repeats and --context must be at least 1, --passes at least 0")
        loaded, ref = load_models(args.model, args.tiny, args.dtype)
    except (ValueError, MlxPagedError) as e:
        sys.exit(f"error: {e}")
    label = model_label(loaded, args.model, args.tiny)
    prompt = encode_chat(loaded.tokenizer, load_prompts(1))[0]
    load_before = os.getloadavg()
    print(
        f"model {label} ({loaded.dtype}), device {mx.default_device()}, mlx {mx.__version__}, "
        f"prompt {len(prompt)} tokens"
    )
    payload = {"dtype": str(loaded.dtype), "prompt_tokens": len(prompt), "steps": args.steps, "repeats": args.repeats}
    payload["ops"] = ops = compare_ops(loaded, ref, prompt)
    print("\nops of one step (primitive: mlxpaged / mlx-lm generate_step)")
    a, b = ops["mlxpaged"], ops["mlx-lm generate_step"]
    print(f"  total: {sum(a.values())} / {sum(b.values())}")
    for k in sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0))):
        print(f"  {k[:40]:40s} {a.get(k, 0):5d} / {b.get(k, 0):5d}")

    payload["steps_per_token"] = st = compare_steps(loaded, ref, prompt, args.steps, args.repeats)
    print(
        f"\nper decode step, median over {args.repeats} blocks of each block's median (min-max); "
        f"same tokens: {st['tokens'][:8]}..."
    )
    for n, row in st["systems"].items():
        blocks = ", ".join(f"{v:.0f}" for v in row["cpu_ms"]["values"])
        line = f"  {n:24s} wall {fmt(row['wall_ms'])} ms  cpu {fmt(row['cpu_ms'])} ms (each block: {blocks})"
        if "speed_ratio_wall" in row:
            line += (
                f"  mlxpaged speed / this: wall {fmt(row['speed_ratio_wall'], 3)}, cpu {fmt(row['speed_ratio_cpu'], 3)}"
            )
        print(line)

    if args.passes:
        payload["passes"] = ps = compare_passes(loaded, ref, args.context, args.passes)
        print(f"\none decode pass at {args.context} cached tokens, {args.passes} each (ms, median (min-max); cpu q25)")
        for n, row in ps.items():
            print(f"  {n:40s} wall {fmt(row['wall_ms'])}  cpu {fmt(row['cpu_ms'])}  q25 {row['cpu_ms_q25']:.2f}")
    payload["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    print(f"load average before {load_before[0]:.1f}, after {payload['load_average']['after'][0]:.1f}")
    if args.json_out:
        print(f"results: {write_json(args.json_out, 'profile_decode_step', label, payload)}")


def fmt(s: dict, digits: int = 1) -> str:
    from mlxpaged.bench.repeat import fmt as f

    return f(s, digits)


if __name__ == "__main__":
    main()
