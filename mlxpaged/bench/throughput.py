"""Generation throughput and latency: mlxpaged's engine against mlx-lm's `BatchGenerator`.

Both get the same token-id prompts, the same number of output tokens (EOS ignored) and the
same sampler settings; each run starts from a fresh cache and is timed end to end.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import mlx.core as mx


@dataclass
class RunResult:
    system: str
    num_requests: int
    output_tokens: int
    wall_s: float
    ttft_ms_median: float  # time to first token
    itl_ms_median: float  # inter-token latency within one sequence
    peak_memory_gb: float  # above what was allocated before the run (the weights): KV cache and activations
    extra: dict

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s

    def as_dict(self) -> dict:
        return {**asdict(self), "output_tps": self.output_tps}


def _latencies(first: dict, stamps: dict, start: float) -> tuple[float, float]:
    ttft = [1e3 * (t - start) for t in first.values()]
    gaps = [1e3 * (b - a) for ts in stamps.values() for a, b in zip(ts, ts[1:])]
    return (statistics.median(ttft) if ttft else 0.0, statistics.median(gaps) if gaps else 0.0)


def run_mlxpaged(loaded, prompts: list[list[int]], max_tokens: int, *, n: int = 1, temperature: float = 0.0,
                 engine_kwargs: dict | None = None) -> RunResult:
    """All prompts submitted at once to a fresh `LLMEngine`; EOS ignored."""
    from ..config import EngineConfig
    from ..engine import LLMEngine
    from ..sampling_params import SamplingParams

    # A pool sized to the workload, as a user would set --num-blocks: peak memory is then comparable.
    bs = (engine_kwargs or {}).get("block_size", 16)
    need = sum(-(-(len(p) + max_tokens) // bs) for p in prompts) * n + 8
    kw = {"max_num_seqs": max(64, len(prompts) * n), "num_blocks": need, **(engine_kwargs or {})}
    params = SamplingParams(n=n, temperature=temperature, seed=0, max_tokens=max_tokens, ignore_eos=True)
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    engine = LLMEngine(loaded, EngineConfig(**kw))  # the pool counts as run memory, not as run time
    start = time.perf_counter()
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
    return RunResult("mlxpaged", len(prompts), st["generation_tokens"], wall, ttft, itl, (mx.get_peak_memory() - base) / 1e9,
                     {k: st[k] for k in ("blocks_in_use_peak", "blocks_without_sharing", "cow_copies", "num_blocks")})


def run_mlx_lm(model, prompts: list[list[int]], max_tokens: int, *, temperature: float = 0.0) -> RunResult:
    """mlx-lm's continuous batcher (what `batch_generate` runs) on contiguous per-sequence caches."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    gen = BatchGenerator(model, stop_tokens=[], sampler=make_sampler(temp=temperature),
                         completion_batch_size=max(32, len(prompts)), prefill_batch_size=min(8, len(prompts)))
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    uids = gen.insert(prompts, [max_tokens] * len(prompts))
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
    return RunResult("mlx-lm", len(prompts), count, wall, ttft, itl, (mx.get_peak_memory() - base) / 1e9, {})
