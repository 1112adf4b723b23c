"""`LLMEngine`: requests in, one scheduled step at a time, outputs out.

Wiring, all explicit: `Scheduler` (who runs, and the one owner of the block tables and of every
request's state, through `BlockManager`) -> `ModelRunner` (the forward pass over `PagedKVCache`)
-> `sampler` (which token) -> `Scheduler.update_from_output` (appends, with `stopping.StopChecker`
deciding stops and detokenizing) -> `stopping.make_output`. The engine never changes a block table
or a sequence itself: it launches steps, reads them back and reports. `step()` is the same five
stages for every step (schedule, launch, commit, read back, report); each feature beyond them (the
draft model, speculation, beam search, grammar masks, prompt logprobs, the disk tier) is a
`StepLayer` (step.py) built with the engine's other parts (parts.py) and called at each stage through its hooks (rows
a layer takes or adds, tokens it feeds the forward pass, masks on the draws, what it reads
back), so the step itself names none.

Overlapped steps (`EngineConfig.async_scheduling`, on by default), as mlx-lm's generate loop:
one `step()` call schedules step t+1, builds its inputs and its sampling graph and launches it
with `mx.async_eval`, and only then reads back step t's tokens (one `tolist`), appends them,
runs the stop checks and detokenizes, while the device computes t+1. Invariants:
- a token sampled in step t stays an MLX array until read back; a sequence that decodes in
  t+1 takes its input id (and its random key) as a row of step t's arrays (`Sequence.pending`);
- anything that needs token values waits for the read-back: stop checks, detokenizing, block
  hashing (`update_from_forward` runs after it), beam selection (`beam_search.beam_step`);
- a sequence found finished after t+1 was launched has computed one token too many: that row
  is dropped (never appended, never counted) and its blocks are freed. Reuse is safe because
  MLX arrays are functional: a later write to a pool is a new version built on the version
  step t+1 reads and writes, so it happens after it. A sequence whose pending token is its
  `max_tokens`-th is not decoded again, so no slot beyond `blocks_for_request` is ever taken;
- a preempted or aborted sequence drops its pending token and keeps its key: the recompute
  samples that position again from the same stream;
- a step with beam-search rows is read back before the next is scheduled (its beams fork and
  drop on the values); so is a step with speculating rows or after which a sequence may
  speculate (`SchedulerOutput.read_back_now`: n-gram proposals are looked up in its known
  tokens, so the token it samples now must be known); copy-on-write copies wait for the device
  inside `copy_blocks`;
- a step with masked rows (grammar-constrained ones, `GrammarLayer`) launches its forward pass
  first and its draws after reading back the step before: a row's mask needs the value of its
  previous token, so the CPU advances the matchers and fills the masks while the device runs
  the forward pass, and the draws of all rows (one graph) follow. Steps without such rows
  launch forward and draws together;
- a speculating row (spec_decode.py) draws K+1 targets, one per position, with the keys of the
  sequence's stream; after the read-back `Scheduler.update_from_spec` appends the accepted
  tokens and rolls back the slots of the rejected ones, and only then names full blocks, which
  the disk tier copies at once (no later step has been launched to reuse them).
With the flag off every step is read back at once, in the same order of operations.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import TYPE_CHECKING

import mlx.core as mx

from ..config import EngineConfig
from ..core.block_manager import HashFn, sha256_block_hash
from ..core.scheduler import SchedulerOutput
from ..core.sequence import PendingToken, Request, Sequence
from ..errors import MlxPagedError, StepError
from .beam_search import BeamSearchParams, BeamState
from .guided import GrammarCompiler
from .multimodal import ImageInputs, decode_images, encode_prompt_images, process_images
from .outputs import RequestOutput
from .parts import EngineParts, build_parts
from .pooling import PoolingParams
from .sampler import (
    GuideMasks,
    PenaltyCounts,
    SampleArrays,
    TokenHistory,
    read_samples,
    row_kinds,
    sample_arrays,
    sample_key,
)
from .sampling_params import SamplingParams, salt_key
from .sizing import check_fits
from .stats import METRIC_KEYS, engine_stats
from .step import LaunchedStep, RowPlan, StepLayer, requests_of
from .stopping import make_output

if TYPE_CHECKING:  # annotations only: loading imports nothing of the engine
    from ..loading.loader import LoadedModel


class LLMEngine:
    """Continuous batching over a paged KV cache.

    `add_request` queues a prompt; each `step()` runs one scheduled batch and returns the
    outputs of the requests that progressed (finished ones with `finished=True`).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        *,
        parts: EngineParts | None = None,
        hash_fn: HashFn = sha256_block_hash,
    ):
        """An engine over `loaded` running with `parts` (parts.py); without them, it asks
        `build_parts` for them (`hash_fn` goes there). An engine with LoRA adapters comes from
        `engine.builder.build_engine`."""
        self.loaded = loaded
        self.config = config = config or EngineConfig()
        self.tokenizer = loaded.tokenizer
        if parts is None:
            parts = build_parts(loaded, config, hash_fn=hash_fn)
        # LoRA adapters by name (models/lora.py), and those of `adapter_dir` when a request first
        # names one; None: none
        self.adapters, self._detokenizer = parts.adapters, parts.detokenizer
        self.cache_shape, self.state_bytes = parts.cache_shape, parts.state_bytes
        self.block_manager, self.scheduler = parts.block_manager, parts.scheduler
        self.kv_cache, self.runner, self.prefix_store = parts.kv_cache, parts.runner, parts.prefix_store
        self.check_stop, self.stats = parts.check_stop, parts.stats
        self.layers = parts.layers  # the features beyond the plain pipeline, in the step's order
        # the layers the engine names: a request's feature wakes its layer
        self.drafter, self._beams, self._grammar = parts.drafter, parts.beams, parts.grammar
        self._prompt_logprobs, self._pooling = parts.prompt_logprobs, parts.pooling
        self.encoder_cache = parts.encoder_cache
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._inflight: LaunchedStep | None = None  # launched, not read back (overlapped steps)
        self._last_plan: RowPlan | None = None  # the last decode-only step's (`_plan`)
        self._carried: list[Request] = []  # read back during a failed step: reported at the next
        self._last_read = 0.0

    def _resize_pools(self, num_blocks: int, copies: list[tuple[int, int]] = (), group: int = 0) -> None:
        """Grow or trim the KV pool of a group, and every layer's pool beside the full group's
        (the same block ids)."""
        self.kv_cache.resize(num_blocks, copies, group)
        if group == 0:
            for layer in self.layers.resize:
                layer.resize(num_blocks, copies)

    @property
    def eos_token_ids(self) -> set[int]:
        return self.check_stop.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.check_stop.eos_token_ids = set(ids)

    @property
    def vocab_size(self) -> int:
        """Width of the model's logits (may exceed the tokenizer's vocabulary)."""
        return self.loaded.model.args.vocab_size

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        return self._grammar.compiler

    @property
    def num_blocks(self) -> int:
        return self.block_manager.pool.num_blocks

    @property
    def max_blocks(self) -> int:
        """The pool's cap: `num_blocks` for a fixed pool; a growable one grows up to it."""
        return self.block_manager.pool.max_blocks

    def trim_pool(self) -> int:
        """Give an idle engine's unneeded KV blocks back (`BlockPool.trim`); returns how many."""
        if self.has_unfinished_requests():
            return 0
        given = 0
        self.block_manager.trim_groups()  # a group's pins hold blocks: nothing would trim
        for group, g in enumerate(self.block_manager.groups):
            given += g.pool.trim()
            if resize := g.pool.take_resize():
                self._resize_pools(*resize, group=group)
        return given

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        images: list | None = None,
    ) -> str:
        """Queue one prompt (text or token ids); returns its request id. `PoolingParams` make it a
        pooled request (`add_pooling_request`). `images` (a vision model's: PIL images, paths or
        bytes, or `ImageInputs` already processed from this prompt) fill the prompt's image markers
        (one image token each, as its chat template writes them) in order."""
        if isinstance(params, PoolingParams):
            if images:
                raise MlxPagedError("images: embeddings and scores take text only")
            return self.add_pooling_request(prompt, params, request_id)
        params = params or SamplingParams()
        ids, text, prompt_images = self._prompt_with_images(prompt, images)
        self._check_fits(len(ids), params.n, params.max_tokens)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise MlxPagedError(
                f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary (size {self.vocab_size})"
            )
        try:
            matcher = self._grammar.matcher(params)
        except ValueError as e:
            raise MlxPagedError(str(e)) from None
        if matcher is not None:
            self.layers.wake(self._grammar)
        if params.prompt_logprobs is not None:
            self.layers.wake(self._prompt_logprobs)
        seed = params.seed if params.seed is not None else random.getrandbits(31)
        adapter = self.adapter(params.adapter)
        seqs = [
            Sequence(
                list(ids),
                len(ids),
                sample_index=i,
                rng_key=None if params.greedy else sample_key(seed, i),
                penalties=PenaltyCounts() if params.has_penalties else None,
                detokenizer=self._detokenizer(),
                matcher=matcher() if matcher is not None else None,
                cache_salt=salt_key(params.cache_salt),
                adapter=adapter,
                images=prompt_images,
            )
            for i in range(params.n)
        ]
        return self._queue(Request(self._new_id(request_id), list(ids), params, seqs, text))

    def add_pooling_request(self, prompt: str | list[int], params: PoolingParams, request_id: str | None = None) -> str:
        """Queue a prompt whose output is its embedding or score (engine/pooling.py), not tokens:
        a prefill that samples nothing and ends there."""
        ids, text = self._prompt_ids(prompt)
        self._check_fits(len(ids), 1, 0)
        if params.yes_no is not None and max(params.yes_no) >= self.vocab_size:
            raise MlxPagedError(f"yes/no token id {max(params.yes_no)} is outside the vocabulary ({self.vocab_size})")
        req = Request(self._new_id(request_id), list(ids), params, [Sequence(list(ids), len(ids))], text)
        req.pooling = params
        self.layers.wake(self._pooling)
        return self._queue(req)

    def add_beam_request(
        self,
        prompt: str | list[int],
        params: BeamSearchParams,
        request_id: str | None = None,
        images: list | None = None,
    ) -> str:
        """Queue a beam search of `params.beam_width` beams over one prompt (see `beam_search`);
        `images` as `add_request`'s (the beams share the prompt's blocks and image positions)."""
        ids, text, prompt_images = self._prompt_with_images(prompt, images)
        self._check_fits(len(ids), params.beam_width, params.max_tokens)
        sp = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
        seq = Sequence(list(ids), len(ids), adapter=self.adapter(params.adapter), images=prompt_images)
        req = Request(self._new_id(request_id), list(ids), sp, [seq], text)
        req.beam = BeamState(params)
        self.layers.wake(self._beams)
        return self._queue(req)

    def adapter(self, name: str | None):
        """The LoRA adapter named `name` (None: the base model), loaded now if it is a folder of
        `adapter_dir` named for the first time; MlxPagedError naming an unknown one."""
        if name is None:
            return None
        if self.adapters is None:
            raise MlxPagedError(f"unknown adapter '{name}': this engine was given no adapters")
        try:
            return self.adapters.get(name)  # AdapterRefused: a folder of adapter_dir that does not fit
        except KeyError as e:
            raise MlxPagedError(e.args[0]) from None

    def _prompt_with_images(self, prompt: str | list[int], images: list | None) -> tuple:
        """(the prompt's ids, its text or None, its `PromptImages` or None): with images (a vision
        model's prompt, multimodal.py) its image markers widened and the images encoded."""
        ids, text = self._prompt_ids(prompt)
        if not images:
            return ids, text, None
        if not isinstance(images, ImageInputs):
            images = process_images(self.loaded, ids, decode_images(images))
        return images.ids, text, encode_prompt_images(self.loaded, images, self.encoder_cache)

    def _prompt_ids(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise MlxPagedError("empty prompt: give at least one token")
        return ids, text

    def _new_id(self, request_id: str | None) -> str:
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._requests:
            raise MlxPagedError(f"duplicate request id '{rid}'")
        return rid

    def _queue(self, req: Request) -> str:
        self._requests[req.request_id] = req
        self.scheduler.add(req)
        self.stats.prompt_tokens += req.num_prompt_tokens
        return req.request_id

    def _check_fits(self, num_prompt: int, n: int, max_tokens: int) -> None:
        """Reject a request that could not finish even with the whole pool to itself."""
        check_fits(num_prompt, n, max_tokens, self.block_manager.block_size, self.max_blocks, self._pool_flag)

    @property
    def _pool_flag(self) -> str:
        """Which flag makes the pool larger: a fixed pool's size, or a growing pool's memory cap."""
        if self.config.cache.num_blocks is not None:
            return "raise --num-blocks"
        return "raise --kv-memory-gb (the pool grows up to it; default a quarter of the free memory)"

    def num_requests_held(self) -> int:
        """Requests the engine still tracks: a finished one is dropped once its output is reported."""
        return len(self._requests)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._carried)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks now; False if it is unknown or done."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(req)
        return True

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the outputs of the requests that progressed.

        With overlapped steps, a call launches a step and reads back the one before it, so the
        tokens it reports are those of the previous launch (plus requests whose prefill chunks
        it launched). Raises `StepError` if building or running a step fails: the requests of
        that step are aborted (their blocks freed) and the engine goes on with the others at
        the next call; tokens of the step before, read back meanwhile, come with the next call.
        """
        for layer in self.layers.failed:
            self._fail_layer(layer)
        progressed, self._carried = self._carried, []
        prev, self._inflight = self._inflight, None
        out = self._schedule()  # 1 schedule
        if out.empty:
            return self._report(self._idle(prev, progressed))
        launched = False
        try:
            cur = self._launch(out)  # 2 launch (step t+1)
            launched = True
            if prev is not None:
                progressed += self._read_back(prev)  # 4 read back step t, while t+1 runs
                prev = None
            if cur.logits_rows is not None:
                self._draw_masked(cur)
            self._commit(cur)  # 3 commit
            if self._overlaps(cur):
                self._inflight = cur
            else:
                progressed += self._read_back(cur)
        except Exception as e:
            self._fail_step(out, prev, launched, progressed, e)
        self.stats.steps += 1
        self._track_peaks()
        if out.prefills:
            progressed += [c.request for c in out.prefills]
        return self._report(progressed)  # 5 report

    def _fail_layer(self, layer: StepLayer) -> None:
        """Fail the requests a layer ends before this step (a grammar too slow to enforce);
        reported with this step's outputs."""
        failed = layer.failed()
        if live := [r for r in failed if r.request_id in self._requests]:
            self._fail(live, self._carried, failed[live[0]])

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next step; the device pools take the pool's new size before any block
        is touched, and each layer sees the step (the disk tier loads its blocks, even for an
        empty step: they are cached under their hash now)."""
        out = self.scheduler.schedule()
        if out.resize:
            for group, resize in enumerate(out.resize):
                if resize:
                    self._resize_pools(*resize, group=group)
        for layer in self.layers.scheduled:
            layer.scheduled(out)
        return out

    def _idle(self, prev: LaunchedStep | None, progressed: list[Request]) -> list[Request]:
        """Nothing to launch: read back the step in flight, if any. The last plan goes (an idle
        engine holds no finished request through it)."""
        self._last_plan = None
        if prev is None:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress")  # guarded by _check_fits
            return progressed
        try:
            progressed += self._read_back(prev)
        except Exception as e:
            self._fail(prev.requests(), progressed, e)
        return progressed

    def _overlaps(self, step: LaunchedStep) -> bool:
        """Whether `step` stays in flight while the next is scheduled: not when its values decide
        the next schedule (a row may speculate on them, `read_back_now`; a layer's, e.g. beams)."""
        if not self.config.scheduler.async_scheduling or step.out.read_back_now:
            return False
        return not any(layer.reads_at_once(step) for layer in self.layers.reads_at_once)

    def _draw_masked(self, step: LaunchedStep) -> None:
        """A step whose rows some layer masks draws once the step before is read back: the masks
        needed its tokens."""
        added = [(layer, step.held[layer]) for layer in self.layers.added_rows if layer in step.held]
        step.sampled = self._draws(step.pairs, step.logits_rows, added, step.plan, self._masks(step))
        step.logits_rows = None
        mx.async_eval(*step.sampled.arrays())

    def _fail_step(
        self, out: SchedulerOutput, prev: LaunchedStep | None, launched: bool, progressed: list, error: Exception
    ):
        """A step failed: abort its requests, and those of the step in flight if reading it back failed."""
        failed = requests_of(out)
        if prev is not None:
            if launched:  # reading `prev` back failed (and `cur` is built on its tokens)
                failed += prev.requests()
            else:  # `prev` is fine: deliver its tokens with the next call
                try:
                    progressed += self._read_back(prev)
                except Exception:
                    failed += prev.requests()
        self._fail(failed, progressed, error)

    def _fail(self, failed: list[Request], progressed: list[Request], error: Exception):
        """Abort the `failed` requests (their blocks return to the pool) and raise `StepError`;
        the other requests that progressed are reported by the next call."""
        ids = list(dict.fromkeys(r.request_id for r in failed))
        for rid in ids:
            self.abort_request(rid)
        self._carried = [r for r in progressed if r.request_id in self._requests]
        raise StepError(ids, error) from error

    def _report(self, progressed: list[Request]) -> list[RequestOutput]:
        """Each progressed request's output, once; a finished request is let go of here."""
        held, tokenizer, outs = self._requests, self.tokenizer, []
        for r in dict.fromkeys(progressed):
            if r.request_id in held:
                out = make_output(r, tokenizer)
                if out.finished:
                    del held[r.request_id]
                outs.append(out)
        return outs

    def _launch(self, out: SchedulerOutput) -> LaunchedStep:
        """Build the step's forward pass and draws and hand them to the device; waits for nothing
        (but copy-on-write copies, which `copy_blocks` evaluates). A step whose rows some layer
        masks launches its forward pass only: `step` builds the draws after reading back the step
        in flight, if any (`logits_rows` holds their logits meanwhile)."""
        t0 = time.perf_counter()
        plan = self._plan(out)
        logits, extra = self._forward(out, plan.batch)
        pairs, index, in_order = plan.pairs, plan.index, plan.in_order
        held, added = {}, []
        for layer in self.layers.added_rows:  # rows beyond the samples' own (speculation's)
            if (got := layer.added_rows(out, len(index))) is not None:
                rows, held[layer] = got
                added.append((layer, held[layer]))
                index = index + rows  # (the plan's list stays the plan's)
        if added:
            in_order = index == list(range(len(index)))
        sampled = logits_rows = None
        todo = self.kv_cache.arrays  # every pool array, a new list (a QuantizedPool is not an array)
        if index:
            if in_order and len(index) == logits.shape[0]:
                logits_rows = logits
            else:
                logits_rows = logits[mx.array(index)]
            if plan.masking:
                todo.append(logits_rows)
            else:
                sampled = self._draws(pairs, logits_rows, added, plan)
                todo += sampled.arrays()
                logits_rows = None
        for layer, rows in plan.taken:
            held[layer] = rows
        if plan.taken:
            todo.append(logits)
        step = LaunchedStep(
            self.stats.steps,
            out,
            plan,
            pairs,
            sampled,
            logits if plan.taken else None,
            sum(c.num_tokens for c in out.prefills) if out.prefills else 0,
            t0,
            logits_rows,
            held=held,
        )
        for layer, rows_of_layer in extra:
            todo += layer.launched(step, rows_of_layer)
        for layer in self.layers.hidden_wanted:
            if entries := layer.hidden_wanted(out):  # (never a speculating entry: their rows shift)
                rows = mx.array(entries)
                hidden = self.runner.hidden[rows]
                todo += layer.pooled(step, hidden.reshape(hidden.shape[0], -1), logits[rows])
        mx.async_eval(*todo)
        self.stats.computed_prefill_tokens += step.num_prefill
        return step

    def _plan(self, out: SchedulerOutput) -> RowPlan:
        """Who draws from which logits row of `out` (`RowPlan`): the last decode-only step's plan
        when `out` decodes the same samples in the same order, else a new one."""
        decode_only = not out.prefills and out.num_decode_tokens == len(out.decodes)
        last = self._last_plan
        if decode_only and last is not None and out.decodes == last.decodes:  # (identity: eq=False)
            return last
        rows, taken = self.scheduler.sample_rows(out), []
        for layer in self.layers.take_rows:  # rows a layer reads itself (beams)
            mine, rows = layer.take_rows(rows)
            if mine:
                taken.append((layer, mine))
        pairs, index = [], []
        for r in rows:
            for s in r.seqs:
                pairs.append((r.request, s))
                index.append(r.row)
        masking = [layer for layer in self.layers.masks_rows if layer.masks_rows(pairs)]
        params = [r.params for r, _ in pairs]
        in_order = index == list(range(len(index)))
        decodes = out.decodes if decode_only else None
        plan = RowPlan(pairs, index, taken, masking, params, row_kinds(params), out.batch(), in_order, decodes)
        if decode_only:
            self._last_plan = plan
        return plan

    def _draws(
        self,
        pairs: list[tuple[Request, Sequence]],
        logits_rows: mx.array,
        added: list[tuple[StepLayer, object]],
        plan: RowPlan,
        masks: GuideMasks | None = None,
    ) -> SampleArrays:
        """The draws of `pairs[j]` from `logits_rows[j]` with the plan's params, then the draws
        the layers `added` (each with what it kept), one graph: `masks` for the masked rows, token
        histories for the rows with penalties (see sampler.py). Added rows have neither
        (`SpecPolicy.speculates`)."""
        params, kinds = plan.params, plan.kinds
        keys = [None] * len(pairs)  # only the rows that draw read theirs
        for i in kinds.drawn:
            keys[i] = pairs[i][1].current_key()
        if added:
            params = list(params)  # (a plan's list stays the plan's)
            for layer, kept in added:
                layer.added_draws(kept, params, keys)
            kinds = row_kinds(params)
        histories = None
        if kinds.penalties:  # (never an added row)
            histories = [
                TokenHistory(
                    s.token_ids,
                    s.num_prompt_tokens,
                    (s.pending.tokens, s.pending.row) if s.pending is not None else None,
                    s.penalties,
                )
                if r.params.has_penalties
                else None
                for r, s in pairs
            ]
            histories += [None] * (len(params) - len(pairs))
        return sample_arrays(logits_rows, params, keys, masks=masks, histories=histories, kinds=kinds)

    def _masks(self, step: LaunchedStep) -> GuideMasks | None:
        """The masks of the step's drawn rows, filled by its plan's masking layers (one layer
        masks: the grammar's) once the step before is read back."""
        masks = None
        for layer in step.plan.masking:
            masks = layer.masks(step.pairs, self.vocab_size) or masks
        return masks

    def _forward(self, out: SchedulerOutput, batch: list[tuple[Sequence, int]]) -> tuple[mx.array, list]:
        """The step's one forward pass over every scheduled token, lazily: the logits of each entry of
        `batch` (`out.batch()`; an entry fed tokens by a layer, every position's), and (layer, rows)
        for each layer that asked for every position of some entries (`StepLayer.logits_wanted`).
        Copy-on-write copies go first (they wait for the device: `copy_blocks` evaluates)."""
        if out.copies:
            for group in range(len(out.copies)):
                self.kv_cache.copy_blocks(out.block_copies(group), group)
        wanted, tokens = [], {}
        for layer in self.layers.before_forward:
            layer.before_forward(out)
        for layer in self.layers.forward_tokens:
            tokens.update(layer.forward_tokens(out))
        for layer in self.layers.logits_wanted:
            if entries := layer.logits_wanted(out):
                wanted.append((layer, entries))
        if not wanted and not tokens:
            return self.runner.forward(batch), []  # (the plain call)
        all_rows = [i for _, entries in wanted for i in entries]
        logits = self.runner.forward(batch, tokens or None, all_rows)
        if not wanted:
            return logits, []
        at = logits.shape[0] - sum(batch[i][1] for i in all_rows)
        extra = []
        for layer, entries in wanted:
            n = sum(batch[i][1] for i in entries)
            extra.append((layer, logits[at : at + n]))
            at += n
        return logits, extra

    def _commit(self, step: LaunchedStep) -> None:
        """The step's tokens are computed (block tables, hashes, forks); its draws become pending."""
        pending = []
        s = step.sampled
        if s is not None and not s.sampled:  # every row greedy: no keys
            sid, tokens = step.step_id, s.tokens
            pending = [(seq, PendingToken(sid, tokens, j, None, 0)) for j, (_, seq) in enumerate(step.pairs)]
        elif s is not None:
            key_row = {i: j for j, i in enumerate(s.sampled)}
            pending = [
                (seq, PendingToken(step.step_id, s.tokens, j, s.keys if j in key_row else None, key_row.get(j, 0)))
                for j, (_, seq) in enumerate(step.pairs)
            ]
        self.scheduler.update_from_forward(step.out, pending)
        for layer in self.layers.committed:
            layer.committed(step)

    def _read_back(self, step: LaunchedStep) -> list[Request]:
        """Wait for the step's values; the scheduler appends the tokens (stop checks and detokenizing
        by `StopChecker`), then each layer takes its part (verification, beams, the disk tier)."""
        progressed: list[Request] = []
        if step.sampled is not None:
            step.tokens, _, step.logprobs = read_samples(step.sampled, key_slices=False)
            progressed += self.scheduler.update_from_output(
                step.step_id, step.pairs, step.tokens, step.logprobs, self.check_stop
            )
            self.stats.generation_tokens += len(progressed)
        for layer in self.layers.read_back:
            progressed += layer.read_back(step)
        # Time between read-backs: with overlapped steps, one step's share of the wall clock.
        now = time.perf_counter()
        dt = now - max(step.launched_at, self._last_read)
        self._last_read = now
        if step.num_prefill:  # a pass with prefill chunks counts as prefill time
            self.stats.prefill_time += dt
        else:
            self.stats.decode_time += dt
            self.stats.decode_tokens += len(step.out.decodes)  # speculating rows count in Verifier
        return progressed

    def _track_peaks(self) -> None:
        """The gauges' peaks, from counters the pool and the scheduler keep (no walk over the
        sequences: every table entry holds one reference, `BlockManager.check`)."""
        st, pool = self.stats, self.block_manager.pool
        st.blocks_in_use_peak = max(st.blocks_in_use_peak, pool.num_used)
        groups = self.block_manager.groups
        if len(groups) > 1:
            peaks = st.group_blocks_in_use_peak
            peaks += [0] * (len(groups) - len(peaks))
            for i in range(1, len(groups)):  # (group 0's is blocks_in_use_peak)
                peaks[i] = max(peaks[i], groups[i].pool.num_used)
        st.blocks_without_sharing_peak = max(st.blocks_without_sharing_peak, pool.num_refs)
        st.running_seqs_peak = max(st.running_seqs_peak, self.scheduler.num_running_seqs)

    # -- introspection ---------------------------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        return [s for r in self.scheduler.running.values() for s in r.seqs if s.block_table]

    def check_invariants(self) -> None:
        self.block_manager.check(self.live_sequences())
        running = sum(not s.finished for r in self.scheduler.running.values() for s in r.seqs)
        assert self.scheduler.num_running_seqs == running, "running samples miscounted"

    def stats_dict(self) -> dict:
        """Every counter and gauge of this engine (engine/stats.py)."""
        return engine_stats(self)

    def metrics(self) -> dict:
        """The gauges and counters a server's /metrics exports (blocks "used" have ref_cnt > 0)."""
        st = self.stats_dict()
        return {k: st[k] for k in METRIC_KEYS}
