"""Decode at long contexts: time per token of mlxpaged's paged reference path against mlx-lm's
contiguous `KVCache`, the same prompt and greedy tokens on both sides.

Each side prefills its prompt once, then the two take turns decoding `--steps` tokens a window
(`--windows` windows each, the side that goes first alternating); a window's time per step is its
wall-clock time over its steps, and the ratio (mlxpaged / mlx-lm, < 1 means mlxpaged is faster)
is taken within each pair of windows. Printed per context: each side's median ms per step and
range, the ratio's median and range, the load average when the windows ran (the machine may be
shared), and the KV bytes one step reads against the minimum.

- batch 1: mlxpaged's engine (attention_impl "reference", prefix caching off) against mlx-lm's
  `generate_step` on its `make_prompt_cache` cache;
- `--batch N`: N sequences sharing the context as a prefix, each with its own 8-token suffix:
  mlxpaged prefills the prefix once and shares its blocks (prefix caching on); mlx-lm's
  `BatchGenerator` starts every row from one prefilled prompt cache, which it copies per row.

KV bytes per step: the minimum reads each cached row once (a shared prefix once for the batch);
mlxpaged's figure is the rows its attention reads where they lie (runs of consecutive blocks,
attention/reference.py), or gathers and reads again (scattered tables); mlx-lm's reads every
row's own copy.

    python scripts/bench_long_context.py                               # tiny attention-heavy model, 1K..32K
    python scripts/bench_long_context.py --contexts 16384 --windows 4
    python scripts/bench_long_context.py --real --contexts 8192        # the offline Qwen2.5-0.5B
    python scripts/bench_long_context.py --batch 8 --contexts 16384    # 8 rows sharing a 16K prefix
    python scripts/bench_long_context.py --attention --contexts 16384  # one layer's attention call alone
    python scripts/bench_long_context.py --attention --contexts 16384 --prefill 8,16,32  # a prefill chunk's
    python scripts/bench_long_context.py --profile --contexts 16384    # one step's parts, runs against gather

`--attention` times one layer's decode attention alone at the tiny model's shapes (8 heads, 8 KV
heads, head_dim 128, float32; `--batch` rows sharing the context): the paged reference reading
runs in place, the same call forced onto the gather (`MIN_RUN_BLOCKS` out of reach: the path
every table took before), and `mx.fast.scaled_dot_product_attention` over contiguous K/V as
mlx-lm's cache holds them (one copy per row), in turns, median and range of `--windows` rounds.
With `--prefill CHUNKS` the same three time a prefill chunk of each size over the context (the
gather: `PREFILL_RUN_ROWS` out of reach; SDPA with the causal mask offset by the prefix).

`--profile` splits one batch-1 decode step of the tiny model into attention, KV write, the rest
of the pass and host, with the runs read in place and with every table gathered (`profile`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlxpaged  # noqa: F401  (first: OpenBLAS must load before MLX, mlxpaged/_blas.py)

# isort: split
import mlx.core as mx


def tiny_checkpoint(max_context: int) -> Path:
    """The attention-heavy tiny Qwen2: 4 layers of 8 heads and 8 KV heads, head_dim 128."""
    from mlxpaged.testing.tiny_model import write_tiny_qwen2

    path = write_tiny_qwen2(
        Path(tempfile.mkdtemp(prefix="bench-long-")) / "tiny", hidden=1024, layers=4, heads=8, kv_heads=8
    )
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = max(config["max_position_embeddings"], max_context + 1024)
    (path / "config.json").write_text(json.dumps(config))
    return path


def prompt_tokens(n: int, salt: int = 0) -> list[int]:
    return [(7 * j + 13 * salt) % 200 + 1 for j in range(n)]


class Ours:
    """mlxpaged's engine decoding `batch` sequences whose prompts share `ctx` tokens."""

    def __init__(self, loaded, ctx: int, batch: int, suffix: int, budget: int):
        from mlxpaged import EngineConfig, LLMEngine, SamplingParams

        per_seq = -(-(ctx + suffix + budget) // 16)
        # room for every row's whole prompt, which admission may ask for before its prefix hit
        blocks = batch * per_seq + 64
        config = EngineConfig.of(
            num_blocks=blocks,
            max_num_seqs=batch,
            attention_impl="reference",
            enable_prefix_caching=batch > 1,
        )
        self.engine = LLMEngine(loaded, config)
        params = SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True)
        prefix = prompt_tokens(ctx)
        if batch == 1:
            self.engine.add_request(prefix, params)
        for i in range(batch if batch > 1 else 0):  # the first computes the prefix, the others hit its blocks
            self.engine.add_request(prefix + prompt_tokens(suffix, i + 1), params)
        self._until_decoding(batch)

    def _until_decoding(self, n: int) -> None:
        sched = self.engine.scheduler
        while sched.waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for r in sched.running.values() for s in r.seqs
        ):
            self.engine.step()
        running = sum(len(r.seqs) for r in sched.running.values())
        assert running == n, f"{running} sequences running, {n} expected"
        for _ in range(2):
            self.engine.step()

    def window(self, steps: int) -> float:
        t = time.perf_counter()
        for _ in range(steps):
            self.engine.step()
        return (time.perf_counter() - t) / steps

    def kv_rows_read(self) -> int:
        """Cached rows (token slots) one decode step's attention reads: each piece of the tables'
        runs once, where it lies (a shared prefix once for the batch), or three times the
        gathered blocks (read, written, read again) when the runs are too short."""
        import numpy as np

        from mlxpaged.attention.reference import _runs_plan

        seqs = [s for r in self.engine.scheduler.running.values() for s in r.seqs]
        tables = [list(s.ids[0].list[: -(-s.num_computed_tokens // 16)]) for s in seqs]
        width = max(map(len, tables))
        padded = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
        ctx = mx.array([s.num_computed_tokens for s in seqs], dtype=mx.int32)
        plan = _runs_plan(mx.array(padded), ctx, 16, None, None)
        if plan is None:
            return 3 * 16 * sum(map(len, tables))
        return 16 * sum(n for _, n in plan.pieces)


class Theirs:
    """mlx-lm: `generate_step` (batch 1) or `BatchGenerator` rows from one prefilled cache."""

    def __init__(self, model, ctx: int, batch: int, suffix: int, budget: int):
        from mlx_lm.generate import BatchGenerator, generate_step
        from mlx_lm.models.cache import make_prompt_cache

        prefix = prompt_tokens(ctx)
        cache = make_prompt_cache(model)
        if batch == 1:
            self.gen = generate_step(
                mx.array(prefix), model, max_tokens=budget, prompt_cache=cache, sampler=lambda x: mx.argmax(x, -1)
            )
            self.step = lambda: next(self.gen)
        else:
            for i in range(0, ctx, 2048):  # chunked, as generate_step prefills
                model(mx.array(prefix[i : i + 2048])[None], cache=cache)
                mx.eval([c.state for c in cache])
            self.gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=batch, prefill_batch_size=batch)
            self.gen.insert(
                [prompt_tokens(suffix, i + 1) for i in range(batch)],
                [budget] * batch,
                caches=[copy.deepcopy(cache) for _ in range(batch)],
            )
            self.step = self._batch_step
        for _ in range(3):  # the prompt, then two decode steps
            self.step()

    def _batch_step(self):
        while True:
            out = self.gen.next()
            generated = out[1] if isinstance(out, tuple) else out
            if generated:
                return generated

    def window(self, steps: int) -> float:
        t = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - t) / steps


def attention_alone(ctx: int, batch: int, rounds: int) -> dict:
    """ms per call of one layer's decode attention: runs in place, gathered, contiguous SDPA."""
    import numpy as np

    from mlxpaged.attention import reference

    H = kvh = 8
    d, bs = 128, 16
    nb = ctx // bs
    k, v = (mx.random.normal((nb + 2 * batch + 8, kvh, bs, d)) for _ in range(2))
    q = mx.random.normal((batch, H, d))
    tables = np.zeros((batch, nb + 2), np.int32)
    for i in range(batch):  # a shared prefix run, then two blocks of each row's own
        tables[i, :nb] = np.arange(4, 4 + nb)
        tables[i, nb:] = [nb + 4 + 2 * i, nb + 5 + 2 * i]
    bt, cl = mx.array(tables), mx.array([ctx + 20] * batch, dtype=mx.int32)
    kc, vc = (mx.random.normal((batch, kvh, ctx + 256, d)) for _ in range(2))
    mx.eval(k, v, q, kc, vc)

    def runs():
        return reference.paged_attention_reference(q, k, v, bt, cl, d**-0.5, {})

    def gather():
        keep, reference.MIN_RUN_BLOCKS = reference.MIN_RUN_BLOCKS, 1 << 30
        try:
            return reference.paged_attention_reference(q, k, v, bt, cl, d**-0.5, {})
        finally:
            reference.MIN_RUN_BLOCKS = keep

    def contiguous():
        return mx.fast.scaled_dot_product_attention(
            q[:, :, None], kc[:, :, : ctx + 20], vc[:, :, : ctx + 20], scale=d**-0.5
        )

    return timed((runs, gather, contiguous), rounds)


def prefill_alone(ctx: int, chunk: int, rounds: int) -> dict:
    """ms per call of one layer's attention for a `chunk`-token prefill over `ctx` cached tokens:
    the prefix's runs read in place, the same call forced onto the gather (the path every chunk
    took before), and contiguous SDPA with the causal mask offset by the prefix."""
    from mlxpaged.attention import reference

    H = kvh = 8
    d, bs = 128, 16
    total = ctx + chunk
    nb = -(-total // bs)
    k, v = (mx.random.normal((nb + 8, kvh, bs, d)) for _ in range(2))
    q = mx.random.normal((chunk, H, d))
    bt = mx.array([list(range(4, 4 + nb))], dtype=mx.int32)
    cu, cl = mx.array([0, chunk], dtype=mx.int32), mx.array([total], dtype=mx.int32)
    kc, vc = (mx.random.normal((1, kvh, total + 256, d)) for _ in range(2))
    mask = mx.arange(ctx, total)[:, None] >= mx.arange(total)[None]
    mx.eval(k, v, q, kc, vc, mask)

    def runs():
        return reference.paged_attention_varlen_reference(q, k, v, bt, cu, cl, d**-0.5, {})

    def gather():
        keep, reference.PREFILL_RUN_ROWS = reference.PREFILL_RUN_ROWS, -1
        try:
            return reference.paged_attention_varlen_reference(q, k, v, bt, cu, cl, d**-0.5, {})
        finally:
            reference.PREFILL_RUN_ROWS = keep

    def contiguous():
        return mx.fast.scaled_dot_product_attention(
            q.transpose(1, 0, 2)[None], kc[:, :, :total], vc[:, :, :total], scale=d**-0.5, mask=mask
        )

    return timed((runs, gather, contiguous), rounds)


def timed(fns, rounds: int) -> dict:
    """Seconds per call of each of `fns`, in turns: `rounds` rounds of 3 calls after a warm-up."""
    times = {f.__name__: [] for f in fns}
    for _ in range(rounds):
        for f in fns:
            mx.eval(f())
            t = time.perf_counter()
            for _ in range(3):
                mx.eval(f())
            times[f.__name__].append((time.perf_counter() - t) / 3)
    return times


def profile(loaded, ctx: int, rounds: int, iters: int) -> dict:
    """ms of one batch-1 decode step at `ctx` tokens, and of its parts, with the runs read in
    place ("runs") and with every table gathered ("gather": `MIN_RUN_BLOCKS` out of reach, the path
    before). The parts come from passes with parts of the attention layer stubbed out (timing
    only, as scripts/bench_forward.py does): `forward` is the runner's forward pass and its
    argmax, waited for; `no write` skips the scatter of the new K/V; `no attention` also returns
    the queries instead of attending (what is left: projections, MLP, norms, logits). KV write =
    forward - no write, attention = no write - no attention, host = a whole `engine.step()`
    (scheduler, sampler, read-back, not overlapped) - forward. Each round times every variant
    `iters` times (median), the order rotating."""
    from mlxpaged.attention import reference
    from mlxpaged.models.paged_adapter import PagedLayerCache

    ours = Ours(loaded, ctx, 1, 0, 2 * rounds * 7 * (iters + 2) + 16)
    engine = ours.engine
    seqs = [s for r in engine.scheduler.running.values() for s in r.seqs]
    batch = [(s, 1) for s in seqs]  # the same pass each time: it rewrites the same slot
    real = (PagedLayerCache.update_and_fetch, PagedLayerCache.attend)

    def no_write(self, keys, values):
        self.pools = (self.kv_cache.keys[self.layer], self.kv_cache.values[self.layer])
        return keys, values

    def no_attention(self, queries, scale, mask, sinks=None, softcap=None):
        self.attended = True
        return queries

    def slot_ready():
        """A pass alone needs the token's block in the table; a whole step allocates it."""
        while any(s.num_computed_tokens // 16 >= len(s.ids[0].list) for s in seqs):
            engine.step()

    def variant(runs: bool, write, attend, whole_step: bool):
        def run():
            if not whole_step:
                slot_ready()
            keep = reference.MIN_RUN_BLOCKS
            reference.MIN_RUN_BLOCKS = keep if runs else 1 << 30
            PagedLayerCache.update_and_fetch, PagedLayerCache.attend = write, attend
            try:
                if whole_step:
                    engine.step()
                else:
                    mx.eval(mx.argmax(engine.runner.forward(batch), axis=-1), *engine.kv_cache.arrays)
            finally:
                reference.MIN_RUN_BLOCKS = keep
                PagedLayerCache.update_and_fetch, PagedLayerCache.attend = real

        return run

    variants = {}
    for side in ("runs", "gather"):
        on = side == "runs"
        variants[(side, "step")] = variant(on, *real, True)
        variants[(side, "forward")] = variant(on, *real, False)
        variants[(side, "no write")] = variant(on, no_write, real[1], False)
    variants[("either", "no attention")] = variant(True, no_write, no_attention, False)
    names = list(variants)
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            variants[n]()  # warm: the first pass after a switch builds its buffers
            ts = []
            for _ in range(iters):
                t = time.perf_counter()
                variants[n]()
                ts.append(time.perf_counter() - t)
            times[n].append(statistics.median(ts))
    parts = {}
    for side in ("runs", "gather"):
        rs = range(rounds)
        get = lambda part, i: times[(side, part)][i]  # noqa: E731
        parts[side] = {
            "step": list(times[(side, "step")]),
            "attention": [get("no write", i) - times[("either", "no attention")][i] for i in rs],
            "KV write": [get("forward", i) - get("no write", i) for i in rs],
            "MLP, projections, logits": list(times[("either", "no attention")]),
            "host": [get("step", i) - get("forward", i) for i in rs],
        }
    del ours
    mx.clear_cache()
    return parts


def span(xs: list[float], unit: float = 1.0, fmt: str = "{:.1f}") -> str:
    return (fmt + " ({}-{})").format(
        statistics.median(xs) * unit, fmt.format(min(xs) * unit), fmt.format(max(xs) * unit)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--real", action="store_true", help="the offline Qwen2.5-0.5B instead of the tiny model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--windows", type=int, default=4, help="windows per side (alternating)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per window")
    ap.add_argument("--attention", action="store_true", help="time one layer's attention call alone")
    ap.add_argument(
        "--prefill",
        default=None,
        help="with --attention: chunk sizes (comma-separated) of a prefill over each context, instead of decode",
    )
    ap.add_argument(
        "--profile", action="store_true", help="where one batch-1 decode step's time goes, runs against gather"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        ap.error(f"--contexts takes comma-separated integers, got {args.contexts!r}")
    if args.batch < 1 or args.windows < 1 or args.steps < 1 or min(contexts) < 16:
        ap.error("--batch, --windows and --steps must be >= 1, contexts >= 16")

    if args.attention and args.prefill:
        try:
            chunks = [int(c) for c in args.prefill.split(",")]
        except ValueError:
            ap.error(f"--prefill takes comma-separated integers, got {args.prefill!r}")
        if min(chunks) < 2:
            ap.error("--prefill chunks must be >= 2 tokens (one is a decode)")
        print("one layer's prefill attention over a cached prefix, 8 heads / 8 KV heads, head_dim 128, float32")
        print(
            f"{'context':>7} | {'chunk':>5} | {'runs ms':>20} | {'gather ms':>20} | {'contiguous SDPA ms':>20} | load"
        )
        rows = []
        for ctx in contexts:
            for chunk in chunks:
                load = os.getloadavg()[0]
                t = prefill_alone(ctx, chunk, args.windows)
                print(
                    f"{ctx:>7} | {chunk:>5} | {span(t['runs'], 1e3):>20} | {span(t['gather'], 1e3):>20} | "
                    f"{span(t['contiguous'], 1e3):>20} | {load:.1f}",
                    flush=True,
                )
                rows.append({"context": ctx, "chunk": chunk, "load": load, **{f"{k}_s": x for k, x in t.items()}})
        if args.json:
            command = "python scripts/bench_long_context.py " + " ".join(sys.argv[1:])
            Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
        return
    if args.attention:
        print(f"one layer's decode attention, 8 heads / 8 KV heads, head_dim 128, float32, batch {args.batch}")
        print(f"{'context':>7} | {'runs ms':>20} | {'gather ms':>20} | {'contiguous SDPA ms':>20} | load")
        for ctx in contexts:
            load = os.getloadavg()[0]
            t = attention_alone(ctx, args.batch, args.windows)
            print(
                f"{ctx:>7} | {span(t['runs'], 1e3):>20} | {span(t['gather'], 1e3):>20} | "
                f"{span(t['contiguous'], 1e3):>20} | {load:.1f}",
                flush=True,
            )
        return

    import mlx_lm

    from mlxpaged.loading.loader import load

    loaded = load(None if args.real else str(tiny_checkpoint(max(contexts))), "auto" if args.real else "float32")
    if args.profile:
        results = {"command": "python scripts/bench_long_context.py " + " ".join(sys.argv[1:]), "rows": []}
        print(f"one decode step's parts, ms, median (range) of {args.windows} rounds of {args.steps} passes each")
        print(f"{'context':>7} | {'part':>24} | {'runs (in place)':>22} | {'gather (before)':>22} | load")
        for ctx in contexts:
            avg = os.getloadavg()[0]
            parts = profile(loaded, ctx, args.windows, args.steps)
            for part in parts["runs"]:
                print(
                    f"{ctx:>7} | {part:>24} | {span(parts['runs'][part], 1e3):>22} | "
                    f"{span(parts['gather'][part], 1e3):>22} | {avg:.1f}",
                    flush=True,
                )
            results["rows"].append({"context": ctx, "load": avg, **parts})
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return
    ref, _ = mlx_lm.load(str(loaded.path))
    ref.set_dtype(loaded.dtype)
    spec = loaded.cache_spec.pool_dims[0]
    layers = len(loaded.cache_spec.pool_dims)
    row_bytes = 2 * layers * spec[0] * spec[1] * loaded.dtype.size  # K and V of one token, all layers
    label = "qwen2.5-0.5b (offline)" if args.real else "tiny qwen2 (hidden 1024, 4 layers, 8/8 heads)"
    print(f"{label}, {loaded.dtype}, batch {args.batch}, {args.windows} windows of {args.steps} steps per side")
    print(
        f"{'context':>7} | {'mlx-lm ms/step':>20} | {'mlxpaged ms/step':>20} | {'ratio':>18} | load | "
        "KV MiB read/step: min, ours, mlx-lm"
    )
    results = {"command": "python scripts/bench_long_context.py " + " ".join(sys.argv[1:]), "rows": []}
    suffix, budget = 8, 3 + args.windows * args.steps + 8
    for ctx in contexts:
        ours = Ours(loaded, ctx, args.batch, suffix if args.batch > 1 else 0, budget)
        theirs = Theirs(ref, ctx, args.batch, suffix, budget)
        a, b, loads = [], [], []
        for w in range(args.windows):
            loads.append(os.getloadavg()[0])
            if w % 2:
                b.append(theirs.window(args.steps))
                a.append(ours.window(args.steps))
            else:
                a.append(ours.window(args.steps))
                b.append(theirs.window(args.steps))
        ratios = [x / y for x, y in zip(a, b)]
        shared = ctx + args.batch * (suffix if args.batch > 1 else 0)
        mib = 2**20
        kv = (
            shared * row_bytes / mib,
            ours.kv_rows_read() * row_bytes / mib,
            args.batch * (ctx + suffix) * row_bytes / mib,
        )
        if args.batch == 1:
            kv = (ctx * row_bytes / mib, ours.kv_rows_read() * row_bytes / mib, ctx * row_bytes / mib)
        print(
            f"{ctx:>7} | {span(b, 1e3):>20} | {span(a, 1e3):>20} | {span(ratios, 1, '{:.2f}'):>18} | "
            f"{statistics.median(loads):.1f} | {kv[0]:.0f}, {kv[1]:.0f}, {kv[2]:.0f}",
            flush=True,
        )
        results["rows"].append(
            {"context": ctx, "mlx_lm_s": b, "mlxpaged_s": a, "ratios": ratios, "load": loads, "kv_mib": kv}
        )
        del ours, theirs
        mx.clear_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
