"""Continuous batching: a waiting queue, a running list, chunked prefill and preemption.

Each step decodes every running sequence that is ready (one token each, one batched forward),
then spends the rest of the token budget on prefill chunks of running requests, then admits
waiting requests while blocks allow. When a sequence needs a block and none is free, the most
recently admitted request is preempted whole: its blocks are freed and it returns to the front
of the waiting queue, to be recomputed from its tokens (prompt plus what it generated).

Invariant: every request is in exactly one of `waiting` and `running`; a waiting request holds
no blocks; `running` is in admission order, so preemption takes from its end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Request, Sequence


@dataclass
class PrefillChunk:
    """`num_tokens` tokens of `seq` from `seq.num_computed_tokens` on; `sample` when they end it."""

    request: Request
    seq: Sequence
    num_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[tuple[Request, Sequence]] = field(default_factory=list)
    copies: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (seq, src, dst) copy-on-write
    preempted: list[Request] = field(default_factory=list)

    @property
    def block_copies(self) -> list[tuple[int, int]]:
        return [(src, dst) for _, src, dst in self.copies]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


def prefill_target(req: Request) -> int:
    """How far the request's carrier (first live sample) prefills before the samples fork.

    With several live samples, the carrier computes only the shared prompt, then the others fork
    from it; a lone sample computes all its tokens.
    """
    live = req.live_seqs()
    return req.num_prompt_tokens if len(live) > 1 else live[0].num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        self._watermark_blocks = int(config.watermark * block_manager.pool.num_blocks)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_seqs(self) -> int:
        return sum(len(r.live_seqs()) for r in self.running)

    def finish(self, req: Request) -> None:
        self.running.remove(req)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        for req in list(self.running):
            if req in self.running and req.forked:
                for seq in req.live_seqs():
                    if seq.num_uncomputed == 1:
                        if not self._reserve(req, seq, 1, out):
                            break
                        out.decodes.append((req, seq))
        budget = self.config.max_num_batched_tokens - len(out.decodes)
        for req in list(self.running):
            if budget <= 0:
                break
            if req in self.running:
                budget = self._schedule_prefill(req, budget, out)
        while (self.waiting and budget > 0 and self._can_admit(self.waiting[0])
               and not self._prefix_in_flight(self.waiting[0])):
            req = self.waiting.popleft()
            self.running.append(req)
            carrier = req.live_seqs()[0]
            hits = self.bm.match_prefix(carrier, prefill_target(req))
            if req.num_preemptions == 0:
                req.num_cached_tokens = hits
                self.prefix_cache_hit_tokens += hits
            budget = self._schedule_prefill(req, budget, out)
        return out

    def _prefix_in_flight(self, req: Request) -> bool:
        """Whether `req`'s first block is being prefilled by a running request right now.

        Such a request waits a step: once that block is computed and cached it is reused,
        instead of being computed twice (requests that share a system prompt and arrive together).
        """
        bs = self.bm.block_size
        if not self.bm.enable_prefix_caching or req.num_prompt_tokens <= bs:
            return False
        head = req.prompt_token_ids[:bs]
        for r in self.running:
            carrier = r.live_seqs()[0]
            if not r.forked and carrier.num_computed_tokens < bs and r.prompt_token_ids[:bs] == head:
                return True
        return False

    def _can_admit(self, req: Request) -> bool:
        if self.num_running_seqs() + len(req.live_seqs()) > self.config.max_num_seqs and self.running:
            return False
        need = self.bm.blocks_for(prefill_target(req))
        reserve = self._watermark_blocks if self.running else 0
        return need + reserve <= self.bm.pool.num_free

    def _schedule_prefill(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Schedule prefill chunks of `req` within `budget` tokens; returns the budget left."""
        if not req.forked:
            carrier = req.live_seqs()[0]
            todo = [(carrier, prefill_target(req) - carrier.num_computed_tokens)]
        else:
            todo = [(s, s.num_uncomputed) for s in req.live_seqs() if s.num_uncomputed > 1]
        for seq, remaining in todo:
            n = min(remaining, budget)
            if n <= 0:
                break
            if not self._reserve(req, seq, n, out):
                break
            sample = seq.num_computed_tokens + n == seq.num_tokens
            out.prefills.append(PrefillChunk(req, seq, n, sample))
            budget -= n
        return budget

    def _reserve(self, req: Request, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Reserve room for `n` tokens of `seq`, preempting newer requests while short.

        Returns False when `req` itself had to be preempted.
        """
        while True:
            copies = self.bm.reserve(seq, n)
            if copies is not None:
                out.copies.extend((seq, s, d) for s, d in copies)
                return True
            if self._preempt_newest(out) is req:
                return False

    def _preempt_newest(self, out: SchedulerOutput) -> Request:
        victim = self.running.pop()
        seqs = set(victim.seqs)
        for seq in victim.live_seqs():
            self.bm.free(seq)
        victim.forked = False
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.prefills = [c for c in out.prefills if c.request is not victim]
        out.decodes = [(r, s) for r, s in out.decodes if r is not victim]
        out.copies = [c for c in out.copies if c[0] not in seqs]
        out.preempted.append(victim)
        return victim
