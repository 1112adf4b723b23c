"""Continuous batching: a waiting queue, a running set, chunked prefill, preemption, and the
one owner of every block table.

Each step decodes every running sequence that is ready (one token each, one batched forward),
then spends the rest of the token budget on prefill chunks of running requests, then admits
waiting requests while blocks allow. When a sequence needs a block and none is free, the most
recently admitted request is preempted whole: its blocks are freed and it returns to the front
of the waiting queue, to be recomputed from its tokens (prompt plus what it generated).

Only this class changes block tables (through `BlockManager`) and a request's state: it
allocates slots before a step; after the forward pass it caches full blocks, forks samples and
marks the drawn tokens pending (`update_from_forward`); once their values are read back it
appends them, applies the stop decision and frees finished samples (`update_from_output`), and
for a beam search forks, drops and reorders beams (`BeamPolicy.apply`, core/beam_policy.py).
Aborts free at once (`abort`).

With overlapped steps (engine.py) a sequence may hold a pending token, sampled but not read back:
it counts as uncomputed, so the sequence decodes in the next step without its value being known
(the runner gathers it on the device), unless it is the sample's `max_tokens`-th token, which ends
the sample whatever its value. Preempting or aborting a sequence drops its pending token.

Invariants: a request's `status` says where it is: WAITING or PREEMPTED requests are in
`waiting` and hold no blocks; RUNNING ones are in `running`, which keeps admission order so
preemption takes from its end; FINISHED ones are in neither.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from os.path import commonprefix

from ..config import EngineConfig
from .beam_policy import BeamPolicy
from .block_manager import BlockManager, PerGroup
from .block_pool import Resize
from .sequence import FinishReason, PendingToken, Request, RequestStatus, Sequence
from .spec_policy import SpecDecode, SpecPolicy

PASSED_OVER_LIMIT = 32  # prefill_order "shortest": steps a prefill may wait behind shorter ones


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
    # per KV cache group, (seq, src, dst) copy-on-write block copies
    copies: PerGroup = field(default_factory=PerGroup)
    preempted: list[Request] = field(default_factory=list)
    # per group, (block_hash, block_id) to fill from the prefix cache's second tier before the
    # forward pass (group 0's are every loaded block; another group's, those it holds). Kept even if
    # their request is preempted in the same step: the blocks stay cached under the hash.
    loads: PerGroup = field(default_factory=PerGroup)
    spec: list[SpecDecode] = field(default_factory=list)
    read_back_now: bool = False  # a sequence may speculate next step: it needs this step's tokens first
    # A pool grew while this step was scheduled: per group, its `Resize` or None (None: no pool
    # changed); the device pools take their sizes before the step runs.
    resize: list[Resize | None] | None = None

    def block_copies(self, group: int = 0) -> list[tuple[int, int]]:
        """The step's copy-on-write copies (src, dst) in `group`."""
        return [(src, dst) for _, src, dst in self.copies[group]] if group < len(self.copies) else []

    def add_copies(self, seq: Sequence, copies: PerGroup) -> None:
        """Record `BlockManager.allocate_slots`' copies for `seq` (every group's)."""
        if copies:
            while len(self.copies) < len(copies):
                self.copies.append([])
            for mine, theirs in zip(self.copies, copies):
                mine.extend((seq, s, d) for s, d in theirs)

    def add_loads(self, loads: PerGroup) -> None:
        """Record `BlockManager.match_second_tier`'s loads (every group's)."""
        if loads:
            while len(self.loads) < len(loads):
                self.loads.append([])
            for mine, theirs in zip(self.loads, loads):
                mine.extend(theirs)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens the decodes compute: one each, plus a speculating row's proposals (vLLM's
        `num_tokens_with_spec` less what is computed): speculation is just more scheduled tokens."""
        return len(self.decodes) + (sum(1 + len(d.proposal) for d in self.spec) if self.spec else 0)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes and not self.spec

    def batch(self) -> list[tuple[Sequence, int]]:
        """(sequence, new tokens) in the order of the step's one forward pass: decodes, prefill chunks,
        then speculating rows (last, so the other rows keep their logits row = their index)."""
        return (
            [(s, 1) for _, s in self.decodes]
            + [(c.seq, c.num_tokens) for c in self.prefills]
            + [(d.seq, 1 + len(d.proposal)) for d in self.spec]
        )

    def requests(self) -> list[Request]:
        """The requests this step computes tokens for, each once."""
        return list(
            dict.fromkeys(
                [r for r, _ in self.decodes] + [c.request for c in self.prefills] + [d.request for d in self.spec]
            )
        )

    def spec_tokens(self) -> dict[int, list[int]]:
        """The proposals by index in `batch()`: the runner feeds them after the row's last token."""
        first = len(self.decodes) + len(self.prefills)
        return {first + i: d.proposal for i, d in enumerate(self.spec)}


@dataclass(slots=True)
class SampleRow:
    """Sequences that draw their next token from row `row` of the step's logits."""

    request: Request
    seqs: list[Sequence]
    row: int


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        proposer: Callable[[list[int], int], list[int]] | None = None,
    ):
        self.config = config
        self.bm = block_manager
        self.spec = SpecPolicy(config, block_manager, proposer)
        self.beams = BeamPolicy(self)
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}  # admission order (dicts keep insertion order)
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        self.prefix_cache_disk_hit_tokens = 0  # the part of prefix_cache_hit_tokens the second tier supplied
        self._num_running_seqs = 0  # live samples of running requests
        self._headroom_blocks = int(config.scheduler.watermark * block_manager.pool.max_blocks)

    @property
    def proposer(self) -> Callable[[list[int], int], list[int]] | None:
        """Speculative decoding's proposer, (token_ids, k) -> up to k tokens; None: no speculation."""
        return self.spec.proposer

    @proposer.setter
    def proposer(self, fn) -> None:
        self.spec.proposer = fn

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    @property
    def num_running_seqs(self) -> int:
        """Live samples of the running requests."""
        return self._num_running_seqs

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        speculate = self.spec.active(self._num_running_seqs)
        prefilling = []  # the running requests with tokens to prefill, in order
        allocate = self.bm.allocate_slots
        for req in list(self.running.values()):
            if req.status is not RequestStatus.RUNNING:
                continue
            if not req.prompt_prefilled:
                prefilling.append(req)
                continue
            for seq in req.seqs:  # the properties inlined: once per sequence per step (host time)
                if seq.finish_reason is not None:
                    continue
                known = len(seq.token_ids)
                todo = known + (seq.pending is not None) - seq.num_computed_tokens  # num_uncomputed
                if todo > 1:
                    if not prefilling or prefilling[-1] is not req:
                        prefilling.append(req)
                # not when the pending token is its last (max_tokens): decoding it would be wasted
                # work, and one slot more than `blocks_for_request` counts
                elif todo == 1 and not (
                    seq.pending is not None and known + 1 - seq.num_prompt_tokens >= req.params.max_tokens
                ):
                    if speculate and self.spec.schedule(req, seq, out):
                        continue  # a decode with its proposals: 1 + K scheduled tokens
                    copies = allocate(seq, 1)
                    if copies is None:  # short of blocks: preempt newer requests
                        if not self._allocate_or_preempt(req, seq, 1, out):
                            break
                    elif copies:
                        out.add_copies(seq, copies)
                    out.decodes.append((req, seq))  # (a preemption rebuilds the list: no alias)
        if prefilling or self.waiting:  # (not in the usual decode step)
            budget = self.config.scheduler.max_num_batched_tokens - out.num_decode_tokens
            if self.config.scheduler.prefill_order == "shortest":
                self._schedule_shortest_first(prefilling, budget, out)
            else:
                for req in prefilling:
                    if budget <= 0:
                        break
                    if req.status is RequestStatus.RUNNING:  # not preempted meanwhile
                        budget = self._schedule_prefill(req, budget, out)
                while self.waiting and budget > 0 and self._admissible():
                    req = self.waiting.popleft()
                    self._admit(req, out)
                    budget = self._schedule_prefill(req, budget, out)
        out.read_back_now = speculate and self.spec.needs_read_back(out)
        out.resize = self.bm.take_resize()
        return out

    # -- speculative decoding: the scheduler's side is core/spec_policy.py -------------------------
    def update_from_spec(
        self,
        req: Request,
        seq: Sequence,
        spec: SpecDecode,
        tokens: list[int],
        logprobs: list,
        rng_key,
        check_stop: Callable[[Request, Sequence, int], FinishReason | None],
    ) -> int:
        """Carry out a verified speculating row: `tokens` are the accepted proposals and the target's
        next token (len = accepted + 1), appended with the stop checks token by token (a stop ends
        the sample there). The row wrote KV for its last token and every proposal; the slots past
        the known tokens but the last are rolled back (`BlockManager.truncate`) before any block is
        named, so no rejected token is ever hashed, cached or handed to the disk tier. Returns the
        tokens appended.
        """
        if seq.finished:
            return 0
        reason = None
        appended = 0
        for j, tok in enumerate(tokens):
            seq.token_ids.append(tok)
            if logprobs[j] is not None:
                seq.logprobs.append(logprobs[j])
            appended += 1
            reason = check_stop(req, seq, tok)
            if reason is not None:
                break
        # Stored as after plain decoding: every known token but the last (all accepted proposals, or
        # fewer when a stop came first); what the row wrote beyond is dropped.
        seq.num_computed_tokens += 1 + len(spec.proposal)
        self.bm.truncate(seq, seq.num_tokens - 1)
        seq.spec.verified(len(spec.proposal), len(tokens) - 1, self.config.speculative.num_speculative_tokens)
        self.bm.cache_full_blocks(seq)
        if reason is not None:
            seq.finish_reason = reason
            self.finish_sequence(req, seq)
        elif rng_key is not None:
            seq.rng_key = rng_key
        return appended

    def _admissible(self) -> bool:
        """Whether the head of the waiting queue may start now (it is admitted in arrival order)."""
        return self._can_admit(self.waiting[0]) and not self._prefix_in_flight(self.waiting[0])

    def _schedule_shortest_first(self, prefilling: list[Request], budget: int, out: SchedulerOutput) -> None:
        """`prefill_order="shortest"`: admit every waiting request that may start, in arrival
        order until one does not fit (one whose shared blocks another is still computing keeps
        its place, not blocking the others): its prefix hit is then known and its cached blocks
        held. Then fill the budget with the prefills that have the fewest tokens left, a request
        passed over `PASSED_OVER_LIMIT` steps in a row first. The running order, which
        preemption reads, is admission order as before."""
        held = []  # their shared blocks are still being computed: they keep their place
        while self.waiting and self._can_admit(self.waiting[0]):
            req = self.waiting.popleft()
            if self._prefix_in_flight(req, whole=True):
                held.append(req)
                continue
            self._admit(req, out)
            prefilling.append(req)
        self.waiting.extendleft(reversed(held))
        left = {req: self._prefill_left(req) for req in prefilling}
        order = sorted(prefilling, key=lambda r: (r.passed_over < PASSED_OVER_LIMIT, left[r]))  # stable
        for req in order:
            if req.status is not RequestStatus.RUNNING:  # preempted meanwhile
                continue
            if budget <= 0:
                req.passed_over += 1
                continue
            budget = self._schedule_prefill(req, budget, out)
            req.passed_over = 0

    def _prefill_left(self, req: Request) -> int:
        """Tokens `req` still computes before it samples: its shared prompt's (or a lone sample's)
        rest, or, once the prompt is shared, the recomputation its samples have left."""
        if not req.prompt_prefilled:
            return req.prefill_target() - req.carrier.num_computed_tokens
        return sum(s.num_uncomputed - 1 for s in req.live_seqs() if s.num_uncomputed > 1)

    def _admit(self, req: Request, out: SchedulerOutput) -> None:
        hits, loads = 0, PerGroup()
        if req.params.prompt_logprobs is None:  # scoring every prompt position computes every one
            hits = self.bm.match_prefix(req.carrier, req.prefill_target())
            loads = self.bm.match_second_tier(req.carrier, req.prefill_target())
        out.add_loads(loads)
        if req.num_preemptions == 0:
            disk = len(loads[0]) * self.bm.block_size if loads else 0
            req.num_cached_tokens = hits + disk
            self.prefix_cache_hit_tokens += hits + disk
            self.prefix_cache_disk_hit_tokens += disk
        req.status = RequestStatus.RUNNING
        self.running[req.request_id] = req
        self._num_running_seqs += len(req.live_seqs())

    def _prefix_in_flight(self, req: Request, whole: bool = False) -> bool:
        """Whether `req`'s first block is being prefilled by a running request right now (`whole`:
        whether any whole block the two prompts share is still to be computed there).

        Such a request waits: once that block is computed and cached it is reused, instead of
        being computed twice (requests that share a system prompt and arrive together). With
        `whole` it waits for every block they share, so it hits them all: admission does not
        wait for budget under prefill_order "shortest", which could otherwise start it right
        after the first block and compute the rest of a shared system prompt a second time.
        """
        bs = self.bm.block_size
        if not self.bm.enable_prefix_caching or req.num_prompt_tokens <= bs:
            return False
        head = req.prompt_token_ids[:bs]
        for r in self.running.values():
            if r.prompt_prefilled or r.prompt_token_ids[:bs] != head:
                continue
            done = r.carrier.num_computed_tokens
            if done < bs or whole and done < len(commonprefix([r.prompt_token_ids, req.prompt_token_ids])) // bs * bs:
                return True
        return False

    def _can_admit(self, req: Request) -> bool:
        if self._num_running_seqs + req.max_live_seqs > self.config.scheduler.max_num_seqs and self.running:
            return False
        return self.bm.fits(req.prefill_target(), self._headroom_blocks if self.running else 0)

    def _schedule_prefill(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Schedule prefill chunks of `req` within `budget` tokens; returns the budget left."""
        if not req.prompt_prefilled:
            carrier = req.carrier
            todo = [(carrier, req.prefill_target() - carrier.num_computed_tokens)]
        else:
            live = req.live_seqs()
            # Beams rank their continuations together: recomputing ones stop one token short
            # and then decode in the same step as the others.
            short = self.beams.recompute_short(req, live)
            todo = [(s, s.num_uncomputed - short) for s in live if s.num_uncomputed > 1]
        for seq, remaining in todo:
            n = min(remaining, budget)
            if n <= 0:
                break
            if not self._allocate_or_preempt(req, seq, n, out):
                break
            sample = seq.num_computed_tokens + n == seq.num_tokens and req.pooling is None  # a pooled one draws nothing
            out.prefills.append(PrefillChunk(req, seq, n, sample))
            budget -= n
        return budget

    def _allocate_or_preempt(self, req: Request, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Allocate slots for `n` tokens of `seq`, preempting newer requests while short.

        Returns False when `req` itself had to be preempted.
        """
        while True:
            copies = self.bm.allocate_slots(seq, n)
            if copies is not None:
                out.add_copies(seq, copies)
                return True
            if self._preempt_newest(out) is req:
                return False

    def _preempt_newest(self, out: SchedulerOutput) -> Request:
        _, victim = self.running.popitem()
        self._release(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        seqs = set(victim.seqs)
        out.prefills = [c for c in out.prefills if c.request is not victim]
        out.decodes = [(r, s) for r, s in out.decodes if r is not victim]
        out.spec = [d for d in out.spec if d.request is not victim]
        for copies in out.copies:
            copies[:] = [c for c in copies if c[0] not in seqs]
        out.preempted.append(victim)
        return victim

    def _release(self, req: Request) -> None:
        """Free every block `req` holds; it starts its prefill over if it runs again."""
        for seq in req.seqs:
            seq.pending = None  # a token still on the device is dropped: the recompute samples it again
            if seq.block_table:
                self.bm.free(seq)
        req.prompt_prefilled = False
        self._num_running_seqs -= len(req.live_seqs())

    # -- after the forward pass ---------------------------------------------------------------------
    def sample_rows(self, out: SchedulerOutput) -> list[SampleRow]:
        """Who samples from which logits row of the step `out`, known before it runs (nothing changes).

        The step's logits rows follow `out.batch()`: the decodes, then the prefill chunks. A chunk
        that completes its request's shared prompt serves every live sample of the request.
        """
        rows = [SampleRow(req, [seq], j) for j, (req, seq) in enumerate(out.decodes)]
        for i, chunk in enumerate(out.prefills, start=len(out.decodes)):
            if not chunk.sample:
                continue
            req = chunk.request
            completes = (
                not req.prompt_prefilled and chunk.seq.num_computed_tokens + chunk.num_tokens >= req.prefill_target()
            )
            rows.append(SampleRow(req, req.live_seqs() if completes else [chunk.seq], i))
        return rows

    def update_from_forward(self, out: SchedulerOutput, pending: list[tuple[Sequence, PendingToken]] = ()) -> None:
        """Record that the scheduled tokens were computed, and the drawn tokens as pending.

        Full blocks are named (prefix cache): every token they hold is known by now, since the
        engine reads back the previous step's tokens before it calls this. A carrier that
        completed its request's prompt shares it with the other samples (fork), which then all
        sample from its logits. A sequence that finished (or was aborted) after the step was
        scheduled is skipped: its blocks are gone and its token is never used.
        """
        bs, cache_full_blocks = self.bm.block_size, self.bm.cache_full_blocks
        for _req, seq in out.decodes:
            if seq.finish_reason is not None:
                continue
            seq.num_computed_tokens += 1
            if seq.num_computed_tokens // bs > len(seq.block_hashes):  # a block filled (its own test, inlined)
                cache_full_blocks(seq)
        for chunk in out.prefills:
            req, seq = chunk.request, chunk.seq
            if seq.finished:
                continue
            seq.num_computed_tokens += chunk.num_tokens
            self.bm.cache_full_blocks(seq)
            if req.prompt_prefilled or seq.num_computed_tokens < req.prefill_target():
                continue  # a recomputation of one sample, or more chunks to go
            for other in req.live_seqs():
                if other is not seq:
                    self.bm.fork(seq, other)
            req.prompt_prefilled = True
        for seq, p in pending:
            if seq.finish_reason is None:  # finished after the step was scheduled: a wasted row
                seq.pending = p

    def update_from_output(
        self,
        step: int,
        pairs: list[tuple[Request, Sequence]],
        tokens: list[int],
        logprobs: list,
        check_stop: Callable[[Request, Sequence, int], FinishReason | None],
    ) -> list[Request]:
        """Append the read-back tokens of step `step` (`pairs[j]` drew `tokens[j]`) and apply each one's
        stop decision; returns the request of every appended token (so its length counts them).

        A sequence whose pending token is gone (preempted, aborted or finished since the launch)
        drops it. A finished sample's blocks are freed now.
        """
        progressed = []
        for j, (req, seq) in enumerate(pairs):
            p = seq.pending
            if p is None:
                continue
            assert p.step == step, "one launched step at most is not read back"
            seq.pending = None
            if p.keys is not None:
                seq.rng_key = p.keys[p.key_row]
            seq.token_ids.append(tokens[j])
            if logprobs[j] is not None:
                seq.logprobs.append(logprobs[j])
            reason = check_stop(req, seq, tokens[j])
            if reason is not None:
                seq.finish_reason = reason
                self.finish_sequence(req, seq)
            progressed.append(req)
        return progressed

    def seqs_started(self, count: int) -> None:
        """`count` samples of running requests started (or, negative, ended) outside admission and
        finishing: a layer's forks and drops (`BeamPolicy`)."""
        self._num_running_seqs += count

    def end_request(self, req: Request) -> None:
        """End a request that holds no live sample any more (a beam search whose beams all ended)."""
        self.running.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED

    def finish_sequence(self, req: Request, seq: Sequence) -> None:
        """Free a finished sample's blocks; the request finishes with its last sample."""
        self.bm.free(seq)
        self._num_running_seqs -= 1
        if req.finished:
            del self.running[req.request_id]
            req.status = RequestStatus.FINISHED

    def abort(self, req: Request) -> None:
        """End `req` wherever it is; its blocks return to the pool at once."""
        if req.status is RequestStatus.RUNNING:
            self._release(req)
            del self.running[req.request_id]
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        for seq in req.live_seqs():
            seq.finish_reason = FinishReason.ABORT
        req.status = RequestStatus.FINISHED
