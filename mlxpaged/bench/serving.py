"""Serving replay: requests with real (prompt, answer) lengths arrive over time at a fixed KV budget.

mlxpaged's `LLMEngine` runs them with continuous batching, prefix caching and preemption; mlx-lm's
`BatchGenerator` (contiguous caches, no budget) runs the same requests as the peer. Prompts are
synthetic token ids of the traced lengths; an optional shared system prompt sits in front of each.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ..waste import load_pairs

TRACES = Path(__file__).resolve().parents[2] / "scripts" / "data"


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]  # seconds after the start


def load_trace(name: str) -> list[tuple[int, int]]:
    """(prompt, answer) token counts from `scripts/data/<name>_lengths.json`."""
    return load_pairs(TRACES / f"{name}_lengths.json")


def make_workload(pairs: list[tuple[int, int]], num_requests: int, *, vocab: int, seed: int = 0, rate: float = 0.0,
                  system_prompt_len: int = 0, max_prompt: int = 1024, max_output: int = 256) -> Workload:
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
    return Workload(prompts, outs, arrivals)


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
            "system": self.system, "requests": self.num_requests, "wall_s": round(self.wall_s, 3),
            "requests_per_s": self.num_requests / self.wall_s, "output_tps": self.output_tokens / self.wall_s,
            "ttft_ms_median": statistics.median(self.ttft_ms), "ttft_ms_p90": pct(self.ttft_ms, 9),
            "itl_ms_median": statistics.median(self.itl_ms) if self.itl_ms else 0.0,
            "itl_ms_p90": pct(self.itl_ms, 9) if self.itl_ms else 0.0, **self.extra,
        }


def _record(stamps: dict, key, now: float, arrival: float, res: ServingResult) -> None:
    if key not in stamps:
        res.ttft_ms.append(1e3 * (now - arrival))
    else:
        res.itl_ms.append(1e3 * (now - stamps[key]))
    stamps[key] = now


def serve_mlxpaged(loaded, wl: Workload, engine_config, progress=None) -> ServingResult:
    from ..engine import LLMEngine
    from ..sampling_params import SamplingParams

    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    engine = LLMEngine(loaded, engine_config)  # the pool counts as run memory
    res = ServingResult("mlxpaged", 0.0, len(wl.prompts), 0)
    pending = list(range(len(wl.prompts)))
    stamps, lengths, arrival = {}, {}, {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and wl.arrivals[pending[0]] <= now:
            i = pending.pop(0)
            rid = engine.add_request(wl.prompts[i], SamplingParams(temperature=0, max_tokens=wl.output_lens[i], ignore_eos=True))
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
    res.extra = {k: st[k] for k in ("running_seqs_peak", "preemptions", "prefix_cache_hit_tokens", "num_blocks",
                                    "blocks_in_use_peak")}
    res.extra["computed_prefill_tokens"] = engine.stats.computed_prefill_tokens
    res.extra["peak_memory_gb"] = (mx.get_peak_memory() - base) / 1e9  # above the weights
    return res


def serve_mlx_lm(model, wl: Workload, max_concurrency: int, progress=None) -> ServingResult:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=max_concurrency, prefill_batch_size=8)
    res = ServingResult("mlx-lm", 0.0, len(wl.prompts), 0)
    pending = list(range(len(wl.prompts)))
    stamps, arrival, active = {}, {}, 0
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    while pending or active:
        now = time.perf_counter() - start
        ready = []
        while pending and wl.arrivals[pending[0]] <= now:
            ready.append(pending.pop(0))
        if ready:
            uids = gen.insert([wl.prompts[i] for i in ready], [wl.output_lens[i] for i in ready])
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
    res.extra = {"peak_memory_gb": (mx.get_peak_memory() - base) / 1e9}
    return res
