"""Concurrency at a fixed KV budget, measured in the engine's allocator and in contiguous baselines.

The engine runs real requests (synthetic prompt ids of the traced lengths, EOS ignored so each
answer has its traced length) all submitted at once into a pool of `capacity` slots. After every
scheduled step the allocator is read: real tokens (KV stored or being written) against reserved
slots (blocks in use x block size), and the number of sequences running.

The contiguous baselines (`max`, `pow2`, `oracle` reservations from `mlxpaged.bench.waste`) run the same
requests through a first-come-first-served simulation with the same step model: a request is
admitted when its whole reservation fits in what is left of the budget and holds it until its
answer is done, one token per step.

The headline (requests running at once while others wait, against the oracle) is the most
flattering of the measures, so `headline` prints it beside the others: preemptions, prefill
computed per prompt token (recomputation after preemption included; contiguous schemes never
preempt, so theirs is 1), the mean number running over all steps, and the steps to drain the queue.

`compare_kv_bits` holds the KV memory fixed instead of the slots: the budget is `capacity` slots
of the float16 cache, and an 8- or 4-bit cache gets the blocks those bytes buy by the cache's own
accounting (`CacheShape.bytes_per_block`), then runs the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from .waste import CAPACITY_SLOTS, CONTIGUOUS, WINDOW


@dataclass
class ConcurrencyResult:
    scheme: str
    real_share: float  # time-averaged real tokens / reserved slots
    mean_running: float  # sequences running, averaged over steps
    saturated_running: float  # averaged over the steps when requests were waiting (the budget binds)
    peak_running: int
    steps: int
    preemptions: int = 0
    prefill_per_prompt_token: float = 1.0  # prefill tokens computed / prompt tokens (> 1: recomputation)
    mean_real_tokens: float = 0.0  # real tokens held, averaged over steps
    capacity: int = 0  # slots in the pool

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def engine_concurrency(
    loaded,
    pairs,
    *,
    capacity: int = CAPACITY_SLOTS,
    block_size: int = 16,
    seed: int = 0,
    progress=None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> ConcurrencyResult:
    """Run `pairs` through mlxpaged's engine in a pool of `capacity` slots (K/V at `kv_bits`,
    None: float); read the allocator each step."""
    from ..config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = loaded.model.args.vocab_size
    engine = LLMEngine(
        loaded,
        EngineConfig.of(
            block_size=block_size,
            num_blocks=capacity // block_size,
            max_num_seqs=4096,
            max_num_batched_tokens=4096,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
        ),
    )
    for p, a in pairs:
        engine.add_request(
            [rng.randrange(10, vocab) for _ in range(p)], SamplingParams(temperature=0, max_tokens=a, ignore_eos=True)
        )
    real = reserved = running_sum = peak = steps = sat_sum = sat_steps = 0
    sched, pool = engine.scheduler, engine.block_manager.pool
    while engine.has_unfinished_requests():
        finished = engine.step()
        live = engine.live_sequences()  # the sequences holding blocks (n = 1: each running request's one sample)
        # Counted after the step: what the allocator holds for the sequences still running.
        real += sum(s.num_computed_tokens + 1 for s in live)
        reserved += pool.num_used * block_size
        running_sum += len(live)
        if sched.waiting:
            sat_sum, sat_steps = sat_sum + len(live), sat_steps + 1
        peak = max(peak, engine.stats.running_seqs_peak)
        steps += 1
        if progress:
            progress(sum(o.finished for o in finished))
    name = f"mlxpaged-{block_size}" + (f" kv{kv_bits}" if kv_bits else "")
    return ConcurrencyResult(
        name,
        real / reserved if reserved else 0.0,
        running_sum / steps,
        sat_sum / sat_steps if sat_steps else float("nan"),
        peak,
        steps,
        sched.num_preemptions,
        engine.stats.computed_prefill_tokens / sum(p for p, _ in pairs),
        real / steps,
        engine.num_blocks * block_size,
    )


def contiguous_concurrency(
    pairs, scheme: str, *, capacity: int = CAPACITY_SLOTS, window: int = WINDOW
) -> ConcurrencyResult:
    """First-come-first-served admission of whole reservations of `scheme` into `capacity` slots."""
    reserve = CONTIGUOUS[scheme]
    waiting = list(pairs)
    running: list[list[int]] = []  # [prompt, answer, generated, reservation]
    used = real = reserved = running_sum = peak = steps = sat_sum = sat_steps = 0
    while waiting or running:
        while waiting and used + reserve(*waiting[0], window) <= capacity:
            p, a = waiting.pop(0)
            r = reserve(p, a, window)
            running.append([p, a, 0, r])
            used += r
        if not running:
            raise ValueError(f"a request does not fit in {capacity} slots under '{scheme}'")
        for req in running:
            req[2] += 1
        real += sum(p + t for p, _, t, _ in running)
        reserved += used
        running_sum += len(running)
        if waiting:
            sat_sum, sat_steps = sat_sum + len(running), sat_steps + 1
        peak = max(peak, len(running))
        steps += 1
        done = [req for req in running if req[2] >= req[1]]
        for req in done:
            running.remove(req)
            used -= req[3]
    return ConcurrencyResult(
        scheme,
        real / reserved,
        running_sum / steps,
        sat_sum / sat_steps if sat_steps else float("nan"),
        peak,
        steps,
        mean_real_tokens=real / steps,
        capacity=capacity,
    )


def compare(
    loaded, pairs, *, capacity: int = CAPACITY_SLOTS, block_size: int = 16, progress=None
) -> list[ConcurrencyResult]:
    """The engine's row, then max, pow2 and oracle contiguous reservations, on the same requests."""
    paged = engine_concurrency(loaded, pairs, capacity=capacity, block_size=block_size, progress=progress)
    return [paged] + [contiguous_concurrency(pairs, s, capacity=capacity) for s in ("max", "pow2", "oracle")]


def headline(rows: list[ConcurrencyResult]) -> dict:
    """Every measure of mlxpaged (rows[0]) against the oracle reservation, not only the best one."""
    paged = next(r for r in rows if r.scheme.startswith("mlxpaged"))
    oracle = next(r for r in rows if r.scheme == "oracle")
    return {
        "saturated_running": [
            paged.saturated_running,
            oracle.saturated_running,
            paged.saturated_running / oracle.saturated_running,
        ],
        "mean_running": [paged.mean_running, oracle.mean_running, paged.mean_running / oracle.mean_running],
        "steps_to_drain": [paged.steps, oracle.steps, oracle.steps / paged.steps],
        "preemptions": paged.preemptions,
        "prefill_per_prompt_token": paged.prefill_per_prompt_token,
    }


def table(rows: list[ConcurrencyResult]) -> list[str]:
    out = [
        f"{'scheme':>12} | {'real/reserved':>13} | {'running (saturated)':>19} | {'mean running':>12} | "
        f"{'peak':>5} | {'steps':>6} | {'preempt':>7} | {'prefill/prompt':>14} | {'mlxpaged / this (saturated)':>27}"
    ]
    paged = rows[0]
    for r in rows:
        out.append(
            f"{r.scheme:>12} | {100 * r.real_share:12.1f}% | {r.saturated_running:19.1f} | {r.mean_running:12.1f} | "
            f"{r.peak_running:5d} | {r.steps:6d} | {r.preemptions:7d} | {r.prefill_per_prompt_token:13.2f}x | "
            f"{paged.saturated_running / r.saturated_running:27.2f}"
        )
    h = headline(rows)
    s, m, d = h["saturated_running"], h["mean_running"], h["steps_to_drain"]
    out.append(
        f"vs oracle: {s[0]:.1f} running at once while others wait vs {s[1]:.1f} ({s[2]:.2f}x); but "
        f"{h['preemptions']} preemptions, prefill computed {h['prefill_per_prompt_token']:.2f}x the prompt tokens, "
        f"mean running {m[0]:.1f} vs {m[1]:.1f} ({m[2]:.2f}x), {d[0]:,} vs {d[1]:,} steps to drain the queue "
        f"(oracle / mlxpaged {d[2]:.2f}x)"
    )
    return out


def kv_budget_slots(
    loaded, capacity: int, block_size: int, kv_bits: int | None, kv_group_size: int = 64, budget_dtype=None
) -> int:
    """Slots (whole blocks) that the bytes of `capacity` float slots buy at `kv_bits`.

    Bytes are counted in `budget_dtype` (default float16, a GPU's pool) for both sides, so the
    ratio is the Mac's whatever dtype the model runs in here.
    """
    import mlx.core as mx

    from ..worker.kv_cache import CacheShape

    shape = replace(CacheShape.of(loaded), dtype=budget_dtype or mx.float16)
    budget = (capacity // block_size) * shape.bytes_per_block(block_size)
    return budget // shape.quantized(kv_bits, kv_group_size).bytes_per_block(block_size) * block_size


def compare_kv_bits(
    loaded,
    pairs,
    *,
    capacity: int = CAPACITY_SLOTS,
    block_size: int = 16,
    bits=(8, 4),
    kv_group_size: int = 64,
    progress=None,
) -> list[ConcurrencyResult]:
    """The engine on a float cache of `capacity` slots, then on `bits`-bit caches of the same bytes."""
    return [
        engine_concurrency(
            loaded,
            pairs,
            block_size=block_size,
            progress=progress,
            kv_bits=b,
            kv_group_size=kv_group_size,
            capacity=kv_budget_slots(loaded, capacity, block_size, b, kv_group_size),
        )
        for b in (None, *bits)
    ]


def kv_table(rows: list[ConcurrencyResult]) -> list[str]:
    """Rows of `compare_kv_bits`, each against the float cache (rows[0])."""
    base = rows[0]
    out = [
        f"{'cache':>16} | {'KV slots':>8} | {'real/reserved':>13} | {'running (saturated)':>19} | "
        f"{'mean running':>12} | {'peak':>5} | {'real tokens held':>16} | {'steps':>6} | {'preempt':>7} | "
        f"{'vs float: saturated, mean running, tokens held, float steps / these':>66}"
    ]
    for r in rows:
        out.append(
            f"{r.scheme:>16} | {r.capacity:8d} | {100 * r.real_share:12.1f}% | {r.saturated_running:19.1f} | "
            f"{r.mean_running:12.1f} | {r.peak_running:5d} | {r.mean_real_tokens:16.0f} | {r.steps:6d} | "
            f"{r.preemptions:7d} | {r.saturated_running / base.saturated_running:13.2f}x "
            f"{r.mean_running / base.mean_running:12.2f}x {r.mean_real_tokens / base.mean_real_tokens:11.2f}x "
            f"{base.steps / r.steps:11.2f}x"
        )
    return out
