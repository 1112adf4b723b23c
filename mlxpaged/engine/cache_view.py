"""A read-only picture of the paged KV cache for the server's web page: shapes and counts only.

`cache_view(engine, labels)` reads the block pool, the block tables and the scheduler once and
returns plain JSON-ready data. Invariant: it never contains a token id, a block hash (a hash of
token ids) or any text, so a viewer learns no one's prompt or answer, only where its KV lives.
Requests are named by a small serial number (`labels`), not by their request id.

`CacheFeed` is what the engine thread fills after its steps (`publish`) and the web routes read
(`latest`). It builds a picture only while a viewer is connected, at most every `min_interval`
seconds, plus once each time the engine goes idle, so a server nobody watches pays one attribute
check per step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

log = logging.getLogger("mlxpaged.server")

# Pool states, one character per block, in block-id order.
FREE, CACHED, USED = ".", "c", "u"


class Labels:
    """Serial numbers for request ids, in order of first sight; forgotten when a request is gone."""

    def __init__(self):
        self._of: dict[str, int] = {}
        self._next = 1

    def of(self, rid: str) -> int:
        if rid not in self._of:
            self._of[rid] = self._next
            self._next += 1
        return self._of[rid]

    def keep(self, rids: set[str]) -> None:
        self._of = {r: n for r, n in self._of.items() if r in rids}


def cache_view(engine: LLMEngine, labels: Labels) -> dict:
    """The pool, the running requests' block tables and the cache counters, now (see the module invariant)."""
    pool, sched, st = engine.block_manager.pool, engine.scheduler, engine.stats
    bs = engine.config.cache.block_size
    states = "".join(USED if b.ref_cnt else CACHED if b.block_hash is not None else FREE for b in pool.blocks)
    shared = [[b.block_id, b.ref_cnt] for b in pool.blocks if b.ref_cnt > 1]
    fill: dict[int, int] = {}  # block id -> tokens whose KV it stores (a shared block counts once)
    logical = 0  # block-table entries: the blocks needed if nothing were shared
    requests = []
    for req in sched.running.values():
        samples = []
        for s in req.seqs:
            if not s.block_table:
                continue
            logical += len(s.block_table)
            for i, b in enumerate(s.block_table):
                fill[b.block_id] = max(fill.get(b.block_id, 0), min(bs, max(0, s.num_computed_tokens - i * bs)))
            samples.append({"sample": s.sample_index, "tokens": s.num_computed_tokens, "blocks": s.block_ids})
        requests.append(_request(req, labels, samples))
    waiting = [_request(req, labels, []) for req in sched.waiting]
    labels.keep({r.request_id for r in sched.running.values()} | {r.request_id for r in sched.waiting})
    used = pool.num_used
    stored = sum(fill.values())
    return {
        "block_size": bs,
        "num_blocks": pool.num_blocks,
        "max_blocks": pool.max_blocks,
        "pool": states,
        "shared": shared,
        "requests": requests,
        "waiting": waiting,
        "counters": {
            "blocks_used": used,
            "blocks_cached": states.count(CACHED),
            "blocks_free": pool.num_free,
            "blocks_without_sharing": logical,
            "blocks_in_use_peak": st.blocks_in_use_peak,
            "tokens_stored": stored,
            "slots_reserved": used * bs,
            # Waste as the seed's table counts it: reserved slots that hold no token (only last blocks).
            "waste": 1 - stored / (used * bs) if used else 0.0,
            "tokens_per_block": stored / used if used else 0.0,
            "prefix_hit_tokens": sched.prefix_cache_hit_tokens,
            "prefix_disk_hit_tokens": sched.prefix_cache_disk_hit_tokens,
            "preemptions": sched.num_preemptions,
            "cow_copies": engine.block_manager.num_cow_copies,
            "generation_tokens": st.generation_tokens,
            "steps": st.steps,
        },
    }


def _request(req, labels: Labels, samples: list[dict]) -> dict:
    return {
        "id": labels.of(req.request_id),
        "status": req.status.value,
        "n": len(req.seqs),
        "prompt_tokens": req.num_prompt_tokens,
        "cached_tokens": req.num_cached_tokens,
        "preemptions": req.num_preemptions,
        "forked": req.prompt_prefilled and len(req.seqs) > 1,
        "samples": samples,
    }


class CacheFeed:
    """The newest cache picture, filled on the engine thread, read on the event loop.

    `viewers` is changed by the web routes (`attach`/`detach`); `publish` runs on the engine
    thread only, so `Labels` and the engine are never touched from two threads. `latest` is
    replaced whole, never mutated, so a reader always sees one consistent picture.
    """

    def __init__(self, min_interval: float = 0.05, rate_window: float = 2.0):
        self.min_interval = min_interval
        self.rate_window = rate_window
        self.viewers = 0
        self.latest: dict | None = None
        self.version = 0
        self._lock = threading.Lock()
        self._labels = Labels()
        self._last = 0.0
        self._rates: deque[tuple[float, int]] = deque()  # (time, generation tokens) of recent pictures
        self._broken = False

    def attach(self) -> None:
        with self._lock:
            self.viewers += 1

    def detach(self) -> None:
        with self._lock:
            self.viewers -= 1

    def publish(self, engine: LLMEngine, idle: bool = False) -> None:
        """After a step (or when going idle): a new picture if someone watches and it is due.
        Never raises: the page is not worth a step (a failure is logged once and the feed stops)."""
        if not self.viewers and not idle or self._broken:
            return
        now = time.monotonic()
        if not idle and now - self._last < self.min_interval:
            return
        self._last = now
        try:
            self._build(engine, now, idle)
        except Exception:
            self._broken = True
            log.exception("the web page's cache view failed; it shows no more pictures")

    def _build(self, engine: LLMEngine, now: float, idle: bool) -> None:
        view = cache_view(engine, self._labels)
        gen = view["counters"]["generation_tokens"]
        if idle:
            self._rates.clear()
        self._rates.append((now, gen))
        while len(self._rates) > 2 and now - self._rates[0][0] > self.rate_window:
            self._rates.popleft()
        t0, g0 = self._rates[0]
        view["counters"]["tokens_per_s"] = 0.0 if idle or now <= t0 else (gen - g0) / (now - t0)
        view["idle"] = idle
        self.latest = view
        self.version += 1
