"""What paging costs in one decode forward pass: mlxpaged's model over its paged cache against
mlx-lm's model over its contiguous `KVCache`, the same weights, the same batch and context.

Both compute one decode step of `--batch` sequences at `--context` cached tokens and its argmax,
and wait for it (`mx.eval`); the clock covers building the graph and evaluating it, for both. For
mlxpaged that includes the runner's packed inputs and attention metadata, so this is the
engine's per-step device work plus the graph building the host does for it, without the
scheduler, the sampler or the read-back (see `bench_step.py` for those). Two more rows say where
mlxpaged's extra time goes, with the attention layer swapped for stubs that compute nothing
useful (timing only):
- `no write`: attention over the pool as it is, without this step's scatter of the new K/V;
- `contiguous`: SDPA over one fixed contiguous K/V array per layer: no write, no gather, no
  mask, which is what the paging layer costs, at most;
- `no attention`: the attention layer returns its queries: the rest of the pass (projections,
  MLP, norms, logits), the part both engines share, which paging cannot make faster.
Each block times `--iters` passes of every system in turn (the order rotating between blocks,
`--repeats` blocks); the figure is the median over blocks of each block's median, with the range.

    python scripts/bench_forward.py --tiny --batch 1,8,32 --repeats 7
    python scripts/bench_forward.py --batch 8 --context 256            # the offline 0.5B (float32)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import mlxpaged  # noqa: F401  (first: OpenBLAS must load before MLX, mlxpaged/_blas.py)

# isort: split
import mlx.core as mx


def systems(loaded, ref, batch: int, context: int) -> dict:
    """{name: one timed pass} for mlxpaged (three variants) and mlx-lm, each holding `batch`
    sequences of `context` random tokens."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxpaged import EngineConfig, LLMEngine, SamplingParams
    from mlxpaged.models.paged_adapter import PagedLayerCache

    rng = random.Random(0)
    vocab = loaded.model.args.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(context)] for _ in range(batch)]
    blocks = batch * (-(-(context + 8) // 16)) + 8
    engine = LLMEngine(
        loaded,
        EngineConfig.of(
            num_blocks=blocks,
            enable_prefix_caching=False,
            async_scheduling=False,
            max_num_batched_tokens=max(2048, batch * context),
        ),
    )
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while not any(s.num_output_tokens for r in engine.scheduler.running.values() for s in r.seqs):
        engine.step()  # prefill, then one decode: every sequence has a computed prefix
    seqs = [s for r in engine.scheduler.running.values() for s in r.seqs]
    step = [(s, 1) for s in seqs]  # the same step each time: it rewrites the same slots
    cache = engine.kv_cache

    def paged():
        mx.eval(mx.argmax(engine.runner.forward(step), axis=-1), *cache.arrays)

    # The stubs replace the adapter's per-layer cache methods (models/paged_adapter.py).
    real = (PagedLayerCache.update_and_fetch, PagedLayerCache.attend)
    args = loaded.model.args
    kv = mx.random.normal((batch, args.num_key_value_heads, context + 1, args.head_dim)).astype(loaded.dtype)
    mx.eval(kv)

    def no_write(self, keys, values):
        self.pools = (self.kv_cache.keys[self.layer], self.kv_cache.values[self.layer])
        return keys, values

    def contiguous(self, queries, scale, mask, sinks=None):
        self.attended = True
        return mx.fast.scaled_dot_product_attention(
            queries, kv, kv, scale=scale
        )  # [T, heads, 1, hd]: row t is sequence t

    def no_attention(self, queries, scale, mask, sinks=None):
        self.attended = True
        return queries  # [T, heads, 1, hd]: what is left is the projections, MLP, norms and logits

    def stubbed(write, attend):
        def run():
            PagedLayerCache.update_and_fetch, PagedLayerCache.attend = write, attend
            try:
                paged()
            finally:
                PagedLayerCache.update_and_fetch, PagedLayerCache.attend = real

        return run

    ref_cache = make_prompt_cache(ref)
    mx.eval(ref(mx.array(prompts), cache=ref_cache), [c.state for c in ref_cache])
    token = mx.array([[1]] * batch)

    def mlx_lm():
        mx.eval(mx.argmax(ref(token, cache=ref_cache)[:, -1], axis=-1))
        for c in ref_cache:
            c.offset -= 1  # stay at `context` tokens: the next pass rewrites the same slot

    return {
        "mlxpaged": paged,
        "mlx-lm": mlx_lm,
        "mlxpaged, no write": stubbed(no_write, real[1]),
        "mlxpaged, contiguous": stubbed(no_write, contiguous),
        "mlxpaged, no attention": stubbed(no_write, no_attention),
    }


def measure(runs: dict, iters: int, repeats: int) -> dict:
    """{name: [median ms of each block]}: blocks of `iters` passes per system, order rotating."""
    names = list(runs)
    out = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(3):
                runs[n]()  # warm: the first passes after a switch build kernels and buffers
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                runs[n]()
                times.append(time.perf_counter() - t)
            out[n].append(1e3 * statistics.median(times))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiny", action="store_true", help="a tiny random-weight Qwen2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=100, help="cached tokens per sequence")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from mlxpaged.bench.models import load_models, model_label
    from mlxpaged.bench.repeat import fmt, spread
    from mlxpaged.bench.throughput import parse_levels
    from mlxpaged.errors import MlxPagedError

    try:
        batches = parse_levels(args.batch, "--batch")
        if args.context < 1 or args.iters < 1 or args.repeats < 1:
            raise ValueError("--context, --iters and --repeats must be at least 1")
        loaded, ref = load_models(args.model, args.tiny, args.dtype)
    except (ValueError, MlxPagedError) as e:
        sys.exit(f"error: {e}")
    print(
        f"model {model_label(loaded, args.model, args.tiny)} ({loaded.dtype}), device {mx.default_device()}, "
        f"{args.context} cached tokens, {args.repeats} blocks of {args.iters} passes; ms per pass, median (min-max)"
    )
    for b in batches:
        res = measure(systems(loaded, ref, b, args.context), args.iters, args.repeats)
        base = statistics.median(res["mlx-lm"])
        for name, ms in res.items():
            ratio = spread([m / p for m, p in zip(ms, res["mlx-lm"])])
            print(f"batch {b:3d} {name:22s} {fmt(spread(ms), 3):>22s} ms   {fmt(ratio)} x mlx-lm's")
        print(
            f"batch {b:3d} paging's share: "
            f"{statistics.median(res['mlxpaged']) - statistics.median(res['mlxpaged, contiguous']):.3f} ms "
            f"of {statistics.median(res['mlxpaged']):.3f} (mlx-lm {base:.3f}); "
            f"without attention {statistics.median(res['mlxpaged, no attention']):.3f} ms"
        )


if __name__ == "__main__":
    main()
