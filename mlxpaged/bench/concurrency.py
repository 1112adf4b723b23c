"""Concurrency at a fixed KV budget, measured in the engine's allocator and in contiguous baselines.

The engine runs real requests (synthetic prompt ids of the traced lengths, EOS ignored so each
answer has its traced length) all submitted at once into a pool of `capacity` slots. After every
scheduled step the allocator is read: real tokens (KV stored or being written) against reserved
slots (blocks in use x block size), and the number of sequences running.

The contiguous baselines (`max`, `pow2`, `oracle` reservations from `mlxpaged.waste`) run the same
requests through a first-come-first-served simulation with the same step model: a request is
admitted when its whole reservation fits in what is left of the budget and holds it until its
answer is done, one token per step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..waste import CAPACITY_SLOTS, CONTIGUOUS, WINDOW


@dataclass
class ConcurrencyResult:
    scheme: str
    real_share: float  # time-averaged real tokens / reserved slots
    mean_running: float  # sequences running, averaged over steps
    saturated_running: float  # averaged over the steps when requests were waiting (the budget binds)
    peak_running: int
    steps: int
    preemptions: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def engine_concurrency(loaded, pairs, *, capacity: int = CAPACITY_SLOTS, block_size: int = 16,
                       seed: int = 0, progress=None) -> ConcurrencyResult:
    """Run `pairs` through mlxpaged's engine in a pool of `capacity` slots; read the allocator each step."""
    from ..config import EngineConfig
    from ..engine import LLMEngine
    from ..sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = loaded.model.args.vocab_size
    engine = LLMEngine(loaded, EngineConfig(block_size=block_size, num_blocks=capacity // block_size,
                                            max_num_seqs=4096, max_num_batched_tokens=4096))
    for p, a in pairs:
        engine.add_request([rng.randrange(10, vocab) for _ in range(p)],
                           SamplingParams(temperature=0, max_tokens=a, ignore_eos=True))
    real = reserved = running_sum = peak = steps = sat_sum = sat_steps = 0
    sched, pool = engine.scheduler, engine.block_manager.pool
    while engine.has_unfinished_requests():
        finished = engine.step()
        live = [s for r in sched.running for s in r.live_seqs()]
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
    return ConcurrencyResult(f"mlxpaged-{block_size}", real / reserved if reserved else 0.0, running_sum / steps,
                             sat_sum / sat_steps if sat_steps else float("nan"), peak, steps, sched.num_preemptions)


def contiguous_concurrency(pairs, scheme: str, *, capacity: int = CAPACITY_SLOTS, window: int = WINDOW) -> ConcurrencyResult:
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
    return ConcurrencyResult(scheme, real / reserved, running_sum / steps,
                             sat_sum / sat_steps if sat_steps else float("nan"), peak, steps)
