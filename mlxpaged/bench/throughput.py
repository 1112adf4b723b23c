"""Generation throughput and latency: mlxpaged's engine against mlx-lm's `BatchGenerator`.

Both get the same token-id prompts (distinct: `prompts.load_prompts`), the same number of output
tokens (EOS ignored) and the same sampler settings. What is timed, for both: from before the
system is built (mlxpaged's `LLMEngine` with its KV pool; mlx-lm's `BatchGenerator`, whose caches
grow inside the loop) to the last token. Prefix caching is off in mlxpaged, so no row gains from
a shared prefix (the chat template's first block is the same in every prompt); prefix reuse has
its own row in the serving benchmark. For n samples of one prompt, mlxpaged prefills the prompt
once and forks it (copy-on-write); mlx-lm gets its best equivalent: the prompt (all but its last
token) prefilled once into a `make_prompt_cache` cache that each of the n requests starts from
(`BatchGenerator.insert(caches=...)`, as mlx-lm's server starts a request from a cached prefix).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import mlx.core as mx

from .repeat import alternate, fmt, spread


@dataclass
class RunResult:
    system: str
    num_requests: int
    output_tokens: int
    wall_s: float
    ttft_ms_median: float  # time to first token, from the start of the clock
    itl_ms_median: float  # inter-token latency within one sequence
    peak_memory_gb: float  # above what was allocated before the run (the weights): KV cache and activations
    extra: dict

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s

    def as_dict(self) -> dict:
        return {**asdict(self), "output_tps": self.output_tps}


@dataclass
class Case:
    name: str
    prompts: list[list[int]]
    n: int
    temperature: float


def _latencies(first: dict, stamps: dict, start: float) -> tuple[float, float]:
    ttft = [1e3 * (t - start) for t in first.values()]
    gaps = [1e3 * (b - a) for ts in stamps.values() for a, b in zip(ts, ts[1:])]
    return (statistics.median(ttft) if ttft else 0.0, statistics.median(gaps) if gaps else 0.0)


def _memory_baseline() -> int:
    mx.clear_cache()
    mx.reset_peak_memory()
    return mx.get_active_memory()


def run_mlxpaged(
    loaded,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    n: int = 1,
    temperature: float = 0.0,
    engine_kwargs: dict | None = None,
) -> RunResult:
    """All prompts submitted at once to a fresh `LLMEngine` (prefix caching off unless asked); EOS ignored."""
    from ..config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..engine.sampling_params import SamplingParams

    # A pool sized to the workload, as a user would set --num-blocks: peak memory is then comparable.
    bs = (engine_kwargs or {}).get("block_size", 16)
    need = sum(-(-(len(p) + max_tokens) // bs) for p in prompts) * n + 8
    kw = {
        "max_num_seqs": max(64, len(prompts) * n),
        "num_blocks": need,
        "enable_prefix_caching": False,
        **(engine_kwargs or {}),
    }
    params = SamplingParams(n=n, temperature=temperature, seed=0, max_tokens=max_tokens, ignore_eos=True)
    base = _memory_baseline()
    start = time.perf_counter()
    engine = LLMEngine(loaded, EngineConfig.of(**kw))  # inside the clock: mlx-lm builds its caches inside it too
    for p in prompts:
        engine.add_request(p, params)
    first, stamps, lengths = {}, {}, {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            for c in o.outputs:
                key = (o.request_id, c.index)
                if len(c.token_ids) != lengths.get(key, 0):
                    lengths[key] = len(c.token_ids)
                    first.setdefault(key, now)
                    stamps.setdefault(key, []).append(now)
    wall = time.perf_counter() - start
    ttft, itl = _latencies(first, stamps, start)
    st = engine.stats_dict()
    return RunResult(
        "mlxpaged",
        len(prompts),
        st["generation_tokens"],
        wall,
        ttft,
        itl,
        (mx.get_peak_memory() - base) / 1e9,
        {
            k: st[k]
            for k in (
                "blocks_in_use_peak",
                "blocks_without_sharing",
                "cow_copies",
                "num_blocks",
                "prefix_cache_hit_tokens",
            )
        },
    )


def prefill_prefix(model, tokens: list[int]) -> list:
    """mlx-lm's contiguous cache (`make_prompt_cache`) holding `tokens`, computed once."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def run_mlx_lm(model, prompts: list[list[int]], max_tokens: int, *, n: int = 1, temperature: float = 0.0) -> RunResult:
    """mlx-lm's continuous batcher (what `batch_generate` runs) on contiguous per-sequence caches.

    With n > 1 each prompt is prefilled once (all but its last token) and its n requests start
    from that cache; `BatchGenerator` copies it into its batch cache, so one cache serves all n.
    """
    try:
        return _run_batch_generator(model, prompts, max_tokens, n, temperature)
    except ValueError as e:
        # A cache mlx-lm cannot batch (Llama 4's ChunkedKVCache), or a model whose attention cannot
        # take the batcher's padded mask (gemma2 splits queries by KV head, the mask keeps one axis).
        if "does not yet support batching" not in str(e) and "broadcast_shapes" not in str(e):
            raise
        return _run_one_by_one(model, prompts, max_tokens, n, temperature)


def _run_one_by_one(model, prompts: list[list[int]], max_tokens: int, n: int, temperature: float) -> RunResult:
    """mlx-lm's `generate_step` (what `stream_generate` runs), one request after another: the
    best mlx-lm does for a model whose caches its batcher refuses."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    base = _memory_baseline()
    start = time.perf_counter()
    first, stamps, count = {}, {}, 0
    for uid, p in enumerate(q for q in prompts for _ in range(n)):
        stamps[uid] = []
        steps = generate_step(mx.array(p), model, max_tokens=max_tokens, sampler=make_sampler(temp=temperature))
        for _ in steps:
            now = time.perf_counter()
            first.setdefault(uid, now)
            stamps[uid].append(now)
            count += 1
    wall = time.perf_counter() - start
    ttft, itl = _latencies(first, stamps, start)
    return RunResult(
        "mlx-lm", len(stamps), count, wall, ttft, itl, (mx.get_peak_memory() - base) / 1e9, {"one_by_one": True}
    )


def _run_batch_generator(model, prompts: list[list[int]], max_tokens: int, n: int, temperature: float) -> RunResult:
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    total = len(prompts) * n
    base = _memory_baseline()
    start = time.perf_counter()
    gen = BatchGenerator(
        model,
        stop_tokens=[],
        sampler=make_sampler(temp=temperature),
        completion_batch_size=max(32, total),
        prefill_batch_size=min(8, total),
    )
    if n == 1:
        uids = gen.insert(prompts, [max_tokens] * total)
    else:
        uids = []
        for p in prompts:
            cache = prefill_prefix(model, p[:-1])
            uids += gen.insert([p[-1:]] * n, [max_tokens] * n, caches=[cache] * n, all_tokens=[p[:-1]] * n)
    first, stamps, count = {}, {u: [] for u in uids}, 0
    while responses := gen.next_generated():
        now = time.perf_counter()
        for r in responses:
            first.setdefault(r.uid, now)
            stamps[r.uid].append(now)
            count += 1
    wall = time.perf_counter() - start
    gen.close()
    ttft, itl = _latencies(first, stamps, start)
    return RunResult(
        "mlx-lm", total, count, wall, ttft, itl, (mx.get_peak_memory() - base) / 1e9, {"shared_prompt_cache": n > 1}
    )


def parse_levels(text: str, option: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; anything else is a one-line error naming the option."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"{option} must be comma-separated positive integers, got '{text}'")
    return levels


def make_cases(prompts: list[list[int]], levels: list[int], samples: int, temperature: float) -> list[Case]:
    """Batch `b` of the first b (distinct) prompts at temperature 0 for each level; then one prompt x n samples."""
    cases = [Case(f"batch {b}", prompts[:b], 1, 0.0) for b in levels]
    if samples:
        cases.append(Case(f"1 prompt, n={samples}", prompts[:1], samples, temperature))
    return cases


def compare(loaded, ref, cases: list[Case], max_tokens: int, repeats: int, progress=None) -> list[dict]:
    """Each case `repeats` times, alternating which system runs first; ratios within a repeat."""
    warm = max(cases, key=lambda c: len(c.prompts)).prompts[:2]
    run_mlxpaged(loaded, warm, 4)  # warm-up both
    run_mlx_lm(ref, warm, 4)
    rows = []
    for case in cases:
        pairs = alternate(
            lambda: run_mlxpaged(loaded, case.prompts, max_tokens, n=case.n, temperature=case.temperature),
            lambda: run_mlx_lm(ref, case.prompts, max_tokens, n=case.n, temperature=case.temperature),
            repeats,
        )
        ours, theirs = [p[0] for p in pairs], [p[1] for p in pairs]
        rows.append(
            {
                "case": case.name,
                "requests": len(case.prompts),
                "n": case.n,
                "temperature": case.temperature,
                "ratio_output_tps": spread([a.output_tps / b.output_tps for a, b in zip(ours, theirs)]),
                "mlxpaged_output_tps": spread([a.output_tps for a in ours]),
                "mlx_lm_output_tps": spread([b.output_tps for b in theirs]),
                "ttft_ms_median": {
                    "mlxpaged": statistics.median(a.ttft_ms_median for a in ours),
                    "mlx_lm": statistics.median(b.ttft_ms_median for b in theirs),
                },
                "itl_ms_median": {
                    "mlxpaged": statistics.median(a.itl_ms_median for a in ours),
                    "mlx_lm": statistics.median(b.itl_ms_median for b in theirs),
                },
                "peak_memory_gb": {
                    "mlxpaged": max(a.peak_memory_gb for a in ours),
                    "mlx_lm": max(b.peak_memory_gb for b in theirs),
                },
                "first": ["mlxpaged" if f == "a" else "mlx_lm" for _, _, f in pairs],
                "runs": [{"mlxpaged": a.as_dict(), "mlx_lm": b.as_dict()} for a, b, _ in pairs],
            }
        )
        if progress:
            progress()
    return rows


def table(rows: list[dict]) -> list[str]:
    """The printed summary: medians over repeats, the ratio with its min-max range."""
    out = [
        f"{'case':>16} | {'mlxpaged tok/s':>14} | {'mlx-lm tok/s':>12} | {'ratio median (min-max)':>22} | "
        f"{'TTFT ms (ours/theirs)':>21} | {'ITL ms (ours/theirs)':>20} | {'peak GB (ours/theirs)':>21}"
    ]
    for r in rows:
        t, i, m = r["ttft_ms_median"], r["itl_ms_median"], r["peak_memory_gb"]
        out.append(
            f"{r['case']:>16} | {r['mlxpaged_output_tps']['median']:14.1f} | "
            f"{r['mlx_lm_output_tps']['median']:12.1f} | "
            f"{fmt(r['ratio_output_tps']):>22} | {t['mlxpaged']:9.0f} / {t['mlx_lm']:9.0f} | "
            f"{i['mlxpaged']:8.1f} / {i['mlx_lm']:8.1f} | {m['mlxpaged']:9.3f} / {m['mlx_lm']:9.3f}"
        )
    return out


SPAN = (
    "clock: from before the engine / BatchGenerator is built (mlxpaged's KV pool allocation included) "
    "to the last token, for both; prefix caching off in mlxpaged; mlx-lm's n-sample requests share one "
    "prefilled prompt cache"
)


def benchmark(
    loaded, ref, *, levels: list[int], samples: int, temperature: float, max_tokens: int, repeats: int, progress=None
) -> dict:
    """The whole throughput benchmark as a JSON-ready payload (rows, settings, what was timed)."""
    from .prompts import alpaca_path, encode_chat, load_prompts

    prompts = encode_chat(loaded.tokenizer, load_prompts(max(levels)))
    rows = compare(loaded, ref, make_cases(prompts, levels, samples, temperature), max_tokens, repeats, progress)
    return {
        "dtype": str(loaded.dtype),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "prompts": "alpaca" if alpaca_path() else "builtin",
        "timed_span": SPAN,
        "rows": rows,
    }
