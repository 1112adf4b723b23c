"""The disk tier's test helpers: random prompts, an engine over a store, a run to the end."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mlxpaged.config import EngineConfig
from mlxpaged.engine.llm_engine import LLMEngine
from mlxpaged.engine.sampling_params import SamplingParams


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 380, n).tolist()


def engine(loaded, store: Path | None, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 96)
    return LLMEngine(loaded, EngineConfig.of(prefix_cache_dir=None if store is None else str(store), **kw))


def run_flushed(e: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    """Every prompt's final output, in order, once the store has written what it was handed."""
    rids = [e.add_request(p, params) for p in prompts]
    done = {}
    while e.has_unfinished_requests():
        done.update({o.request_id: o for o in e.step() if o.finished})
    if e.prefix_store is not None:
        e.prefix_store.flush()
    return [done[r] for r in rids]
