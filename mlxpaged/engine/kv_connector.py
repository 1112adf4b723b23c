"""The prefix cache's second tier behind a connector, as vLLM's `KVConnector`: the scheduler asks
it which blocks of a prompt it holds (`BlockManager.second_tier`, the store's `lookup`), and
this layer moves the bytes: blocks the scheduler took from the tier are copied into the pool
before the step's forward pass, and newly full blocks the tier wants are gathered lazily behind
the step and handed to the store's writer thread once the step is read back. Neither the
scheduler nor the step knows the tier is a directory of files (worker/prefix_store.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .step import StepLayer

if TYPE_CHECKING:
    from ..core.block_manager import BlockManager
    from ..core.scheduler import SchedulerOutput
    from ..worker.kv_cache import PagedKVCache
    from ..worker.prefix_store import PrefixStore
    from .stats import EngineStats
    from .step import LaunchedStep


class DiskConnector(StepLayer):
    """Moves blocks between the pool and a `PrefixStore`.

    Invariant: the rows of a step's newly full blocks are gathered when the step is committed
    (before any later step can reuse those blocks) and saved once it is read back; blocks named
    during the read-back itself (a speculating row's verified tokens) are gathered and saved
    then, when no later step has been launched.
    """

    def __init__(self, store: PrefixStore, kv_cache: PagedKVCache, block_manager: BlockManager, stats: EngineStats):
        self.store, self.kv_cache, self.bm, self.stats = store, kv_cache, block_manager, stats
        block_manager.second_tier = store

    def scheduled(self, out: SchedulerOutput) -> None:
        """Copy the blocks the scheduler took from the tier into the pool (they are cached under their hash now)."""
        if out.loads:
            loads = out.loads[0]  # every loaded block; another group's loads are the blocks it holds
            payloads = self.store.take_staged([h for h, _ in loads])
            row = {h: i for i, (h, _) in enumerate(loads)}
            at = [[(row[h], b) for h, b in group] for group in out.loads]
            self.kv_cache.write_blocks(self.store.split_payload(payloads), at)

    def committed(self, step: LaunchedStep) -> None:
        self._gather(step)

    def read_back(self, step: LaunchedStep) -> list:
        self._save(step)
        if self.bm.to_store:  # named by the read-back (verification): nothing launched since
            self._gather(step)
            self._save(step)
        st = self.stats
        if st.computed_prefill_tokens and st.prefill_time:
            self.store.recompute_s_per_token = st.prefill_time / st.computed_prefill_tokens
        return []

    def _gather(self, step: LaunchedStep) -> None:
        """Snapshot the rows of the newly full blocks the tier wants (lazily, behind the step)."""
        items = self.bm.take_to_store()
        others = [g.pool.cached for g in self.bm.groups[1:]]
        if others:  # a newly full block is held by every group: each cached it under its hash
            items = [x for x in items if all(x[0] in cached for cached in others)]
        if items:
            ids = [[b for _, b, _ in items]] + [[cached[h].block_id for h, _, _ in items] for cached in others]
            rows = self.kv_cache.gather_blocks(ids)
            mx.async_eval(*rows)
            step.held[self] = ([(h, t) for h, _, t in items], rows)

    def _save(self, step: LaunchedStep) -> None:
        """The step is read back, so its gathered rows are ready: the writer thread takes them from here."""
        got = step.held.pop(self, None)
        if got is not None:
            items, rows = got
            self.store.save(items, [np.array(r).reshape(len(items), -1) for r in rows])
