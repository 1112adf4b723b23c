"""Serving replay: requests with real (prompt, answer) lengths arrive over time at a fixed KV budget.

mlxpaged's `LLMEngine` runs them with continuous batching and preemption; mlx-lm's `BatchGenerator`
(contiguous caches, no budget) runs the same requests as the peer. Prompts are synthetic token
ids of the traced lengths; an optional shared system prompt sits in front of each.

Prefix reuse is compared like for like: without a shared prompt both sides compute every prompt
token (mlxpaged's prefix cache off); with one, mlxpaged's prefix cache is on and mlx-lm gets what
its server does, an `LRUPromptCache` that hands each request a copy of the nearest cached prefix.
The peer is even told where the system prompt ends: it is prefilled once, on the first arrival,
inside the clock. For both systems the clock runs from before the engine / generator is built to
the last token.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import mlx.core as mx

from ..data import load_trace  # noqa: F401  (re-exported: the scripts read traces from here)
from .repeat import alternate, fmt, spread


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]  # seconds after the start
    system_prompt_len: int = 0  # tokens every prompt starts with (0: none)


def make_workload(
    pairs: list[tuple[int, int]],
    num_requests: int,
    *,
    vocab: int,
    seed: int = 0,
    rate: float = 0.0,
    system_prompt_len: int = 0,
    max_prompt: int = 1024,
    max_output: int = 256,
) -> Workload:
    """Synthetic prompts of the traced lengths (capped), Poisson arrivals at `rate` req/s (0: all at once)."""
    rng = random.Random(seed)
    system = [rng.randrange(10, vocab) for _ in range(system_prompt_len)]
    prompts, outs, arrivals, t = [], [], [], 0.0
    for p, a in pairs[:num_requests]:
        prompts.append(system + [rng.randrange(10, vocab) for _ in range(min(p, max_prompt))])
        outs.append(max(1, min(a, max_output)))
        arrivals.append(t)
        if rate > 0:
            t += rng.expovariate(rate)
    return Workload(prompts, outs, arrivals, system_prompt_len)


@dataclass
class ServingResult:
    system: str
    wall_s: float
    num_requests: int
    output_tokens: int
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        def pct(xs, q):
            return statistics.quantiles(xs, n=10)[q - 1] if len(xs) >= 2 else (xs[0] if xs else 0.0)

        return {
            "system": self.system,
            "requests": self.num_requests,
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": self.num_requests / self.wall_s,
            "output_tps": self.output_tokens / self.wall_s,
            "ttft_ms_median": statistics.median(self.ttft_ms),
            "ttft_ms_p90": pct(self.ttft_ms, 9),
            "itl_ms_median": statistics.median(self.itl_ms) if self.itl_ms else 0.0,
            "itl_ms_p90": pct(self.itl_ms, 9) if self.itl_ms else 0.0,
            **self.extra,
        }


def _record(stamps: dict, key, now: float, arrival: float, res: ServingResult) -> None:
    if key not in stamps:
        res.ttft_ms.append(1e3 * (now - arrival))
    else:
        res.itl_ms.append(1e3 * (now - stamps[key]))
    stamps[key] = now


def serve_mlxpaged(loaded, wl: Workload, engine_config, progress=None) -> ServingResult:
    from ..engine.llm_engine import LLMEngine
    from ..engine.sampling_params import SamplingParams

    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    res = ServingResult("mlxpaged", 0.0, len(wl.prompts), 0)
    pending = list(range(len(wl.prompts)))
    stamps, lengths, arrival = {}, {}, {}
    start = time.perf_counter()
    engine = LLMEngine(loaded, engine_config)  # inside the clock, as mlx-lm's generator and caches are
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and wl.arrivals[pending[0]] <= now:
            i = pending.pop(0)
            rid = engine.add_request(
                wl.prompts[i], SamplingParams(temperature=0, max_tokens=wl.output_lens[i], ignore_eos=True)
            )
            arrival[rid] = wl.arrivals[i]
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, wl.arrivals[pending[0]] - now))
            continue
        for o in engine.step():
            t = time.perf_counter() - start
            n = len(o.outputs[0].token_ids)
            if n != lengths.get(o.request_id, 0):
                lengths[o.request_id] = n
                _record(stamps, o.request_id, t, arrival[o.request_id], res)
            if o.finished and progress:
                progress()
    res.wall_s = time.perf_counter() - start
    st = engine.stats_dict()
    res.output_tokens = st["generation_tokens"]
    res.extra = {
        k: st[k]
        for k in ("running_seqs_peak", "preemptions", "prefix_cache_hit_tokens", "num_blocks", "blocks_in_use_peak")
    }
    res.extra["computed_prefill_tokens"] = engine.stats.computed_prefill_tokens
    res.extra["peak_memory_gb"] = (mx.get_peak_memory() - base) / 1e9  # above the weights
    return res


def serve_mlx_lm(model, wl: Workload, max_concurrency: int, progress=None, prompt_cache: bool = False) -> ServingResult:
    """The same requests through mlx-lm's `BatchGenerator`; with `prompt_cache`, prefixes from an `LRUPromptCache`."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import LRUPromptCache

    from .throughput import prefill_prefix

    res = ServingResult("mlx-lm", 0.0, len(wl.prompts), 0)
    pending = list(range(len(wl.prompts)))
    stamps, arrival, active, hits = {}, {}, 0, 0
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    start = time.perf_counter()
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=max_concurrency, prefill_batch_size=8)
    lru = LRUPromptCache() if prompt_cache else None
    while pending or active:
        now = time.perf_counter() - start
        ready = []
        while pending and wl.arrivals[pending[0]] <= now:
            ready.append(pending.pop(0))
        if ready:
            prompts, caches = [wl.prompts[i] for i in ready], None
            if lru is not None and wl.system_prompt_len:
                system = wl.prompts[ready[0]][: wl.system_prompt_len]
                if (
                    len(lru) == 0
                ):  # the first arrival: prefill the system prompt once, as the server's cache would hold it
                    lru.insert_cache("model", system, prefill_prefix(model, system), cache_type="system")
                found = [lru.fetch_nearest_cache("model", p) for p in prompts]
                caches, prompts = [c for c, _ in found], [rest for _, rest in found]
                hits += sum(len(p) - len(r) for p, r in zip([wl.prompts[i] for i in ready], prompts))
            uids = gen.insert(prompts, [wl.output_lens[i] for i in ready], caches=caches)
            for u, i in zip(uids, ready):
                arrival[u] = wl.arrivals[i]
            active += len(ready)
        if not active:
            time.sleep(max(0.0, wl.arrivals[pending[0]] - now))
            continue
        for r in gen.next_generated() or []:
            _record(stamps, r.uid, time.perf_counter() - start, arrival[r.uid], res)
            res.output_tokens += 1
            if r.finish_reason is not None:
                active -= 1
                if progress:
                    progress()
    res.wall_s = time.perf_counter() - start
    gen.close()
    res.extra = {"peak_memory_gb": (mx.get_peak_memory() - base) / 1e9, "prompt_cache_hit_tokens": hits}
    return res


METRICS = [
    "requests_per_s",
    "output_tps",
    "ttft_ms_median",
    "ttft_ms_p90",
    "itl_ms_median",
    "itl_ms_p90",
    "peak_memory_gb",
]


def compare(
    loaded,
    ref,
    pairs,
    *,
    num_requests: int,
    rate: float,
    max_prompt: int,
    max_output: int,
    kv_tokens: int,
    block_size: int,
    max_num_seqs: int,
    system_prompt: int,
    repeats: int,
) -> list[dict]:
    """The replay without and (if `system_prompt`) with a shared system prompt, each `repeats` times alternating."""
    from ..config import EngineConfig

    vocab = loaded.model.args.vocab_size

    def config(prefix_caching: bool):
        return EngineConfig.of(
            block_size=block_size,
            num_blocks=kv_tokens // block_size,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=prefix_caching,
        )

    warm = make_workload(pairs, 2, vocab=vocab, max_output=4)
    serve_mlxpaged(loaded, warm, config(False))
    serve_mlx_lm(ref, warm, max_num_seqs)
    cases = [("no shared prefix", 0)] + (
        [(f"shared {system_prompt}-token system prompt", system_prompt)] if system_prompt else []
    )
    rows = []
    for label, sys_len in cases:
        wl = make_workload(
            pairs,
            num_requests,
            vocab=vocab,
            rate=rate,
            system_prompt_len=sys_len,
            max_prompt=max_prompt,
            max_output=max_output,
        )
        runs = alternate(
            lambda: serve_mlxpaged(loaded, wl, config(sys_len > 0)).summary(),
            lambda: serve_mlx_lm(ref, wl, max_num_seqs, prompt_cache=sys_len > 0).summary(),
            repeats,
        )
        ours, theirs = [r[0] for r in runs], [r[1] for r in runs]
        rows.append(
            {
                "case": label,
                "system_prompt_len": sys_len,
                "peer": "mlx-lm BatchGenerator"
                + (" + LRUPromptCache seeded with the system prompt" if sys_len else ""),
                "mlxpaged_prefix_caching": sys_len > 0,
                "ratio": {
                    k: spread([a[k] / b[k] for a, b in zip(ours, theirs)]) for k in METRICS if all(b[k] for b in theirs)
                },
                "mlxpaged": {k: spread([a[k] for a in ours]) for k in ours[0] if isinstance(ours[0][k], (int, float))},
                "mlx_lm": {
                    k: spread([b[k] for b in theirs]) for k in theirs[0] if isinstance(theirs[0][k], (int, float))
                },
                "first": ["mlxpaged" if f == "a" else "mlx_lm" for _, _, f in runs],
            }
        )
    return rows


def table(row: dict) -> list[str]:
    """One case's printed summary: medians over repeats and the ratio with its min-max range."""
    a, b = row["mlxpaged"], row["mlx_lm"]
    out = [
        f"== {row['case']} (peer: {row['peer']}) ==",
        f"{'metric':>16} | {'mlxpaged':>10} | {'mlx-lm':>10} | ratio median (min-max)",
    ]
    for k in METRICS:
        r = fmt(row["ratio"][k]) if k in row["ratio"] else "-"
        out.append(f"{k:>16} | {a[k]['median']:10.2f} | {b[k]['median']:10.2f} | {r}")
    out.append(
        f"mlxpaged: peak running seqs {a['running_seqs_peak']['median']:.0f}, "
        f"preemptions {a['preemptions']['median']:.0f}, "
        f"prefix-cache hit tokens {a['prefix_cache_hit_tokens']['median']:.0f}, prefill tokens computed "
        f"{a['computed_prefill_tokens']['median']:.0f}; mlx-lm prompt-cache hit tokens "
        f"{b['prompt_cache_hit_tokens']['median']:.0f}"
    )
    return out
