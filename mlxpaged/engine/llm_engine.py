"""`LLMEngine`: requests in, one scheduled step at a time, outputs out.

Wiring, all explicit: `Scheduler` (who runs, and the one owner of the block tables and of every
request's state, through `BlockManager`) -> `ModelRunner` (the forward pass over `PagedKVCache`)
-> `sampler` (which token) -> `Scheduler.update_from_output` (appends, with `stopping.StopChecker`
deciding stops and detokenizing) -> `stopping.make_output`. The engine never changes a block table
or a sequence itself: it launches steps, reads them back and reports. `step()` is the same five
stages for every step (schedule, launch, commit, read back, report); each feature beyond them (the
draft model, speculation, beam search, grammar masks, prompt logprobs, the disk tier) is a
`StepLayer` (step.py) registered in `__init__` and called at each stage through its hooks (rows
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
from ..core.block_manager import BlockManager, HashFn, sha256_block_hash
from ..core.kv_groups import GroupSpec, RecurrentStateGroup
from ..core.scheduler import Scheduler, SchedulerOutput
from ..core.sequence import PendingToken, Request, Sequence
from ..errors import MlxPagedError, StepError
from ..models.lora import AdapterSet
from ..utils import cdiv
from ..worker.kv_cache import CacheShape, PagedKVCache, growable_pool, pool_blocks
from ..worker.kv_calibration import model_key_scales
from ..worker.model_runner import ModelRunner
from ..worker.state_cache import CHECKPOINT_BYTES, CHECKPOINTS, Checkpoints, spec_nbytes, state_spec
from .beam_search import BeamLayer, BeamSearchParams, BeamState
from .draft import DraftProposer, draft_slots
from .grammar_layer import GrammarLayer
from .guided import GrammarCompiler
from .kv_connector import DiskConnector
from .multimodal import EncoderCache, ImageInputs, decode_images, encode_images, process_images
from .outputs import RequestOutput
from .pooling import PoolingLayer, PoolingParams
from .prompt_logprobs import PromptLogprobs
from .recurrent_state import CheckpointNamer
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
from .spec_decode import NgramProposer, Verifier
from .stats import METRIC_KEYS, EngineStats, engine_stats
from .step import LaunchedStep, Layers, RowPlan, StepLayer, requests_of
from .stopping import StopChecker, detokenizers, hidden_token_ids, make_output

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
        hash_fn: HashFn = sha256_block_hash,
        adapters: dict[str, str] | None = None,
        adapter_dir: str | None = None,
    ):
        self.loaded = loaded
        # LoRA adapters by name (models/lora.py), each checked against the model now, and those of
        # `adapter_dir` when a request first names one; None: none
        self.adapters = None
        if adapters or adapter_dir:
            self.adapters = AdapterSet.load(loaded.model, adapters, loaded.config.get("model_type"), adapter_dir)
        self.config = config = config or EngineConfig()
        self.tokenizer = loaded.tokenizer
        self._detokenizer = detokenizers(self.tokenizer)
        self.cache_shape = CacheShape.of(loaded).quantized(config.cache.kv_bits, config.cache.kv_group_size)
        checkpoints = self._recurrent_checks()  # a hybrid model's features and state bytes
        draft = self._load_draft() if config.speculative.method == "draft" else None
        # The draft's pool has the target pool's block ids: its bytes count in every block.
        extra = CacheShape.of(draft).bytes_per_block(config.cache.block_size) if draft is not None else 0
        # A hybrid's running sequences hold recurrent states beside their blocks: a pool sized from
        # memory leaves room for max_num_seqs of them (and the checkpoints), at most half its budget.
        held = self.state_bytes * config.scheduler.max_num_seqs + (checkpoints.cap_bytes if checkpoints else 0)
        growth = growable_pool(loaded, config, extra, held)  # (start, cap, chunk), or None for a fixed pool
        num_blocks = growth[0] if growth else pool_blocks(loaded, config, extra_block_bytes=extra, reserved_bytes=held)
        # Layers of each kind of cache form a group of their own (core/kv_groups.py), whose blocks
        # no later token reads go back. A growing pool's local group (a window, a chunk) starts at a
        # span's worth of blocks and grows by as much (memory follows the spans); a fixed pool gives
        # every group its size (what a group releases is room for more sequences, as in vLLM).
        kinds, layer_groups = loaded.cache_spec.groups()
        bs = config.cache.block_size
        steps = [cdiv(span, bs) + 1 if span is not None and growth else None for _, span in kinds]
        self.block_manager = BlockManager(
            num_blocks,
            bs,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            hash_fn=hash_fn,
            extra_key=loaded.identity,
            groups=[GroupSpec(k, n, min(step, num_blocks) if step else None) for (k, n), step in zip(kinds, steps)]
            + ([RecurrentStateGroup(checkpoints)] if checkpoints is not None else []),  # hits end at a checkpoint
        )
        # A quantized cache divides keys by per-channel scales, measured once per loaded model (kv_calibration.py).
        quant = config.cache.kv_bits is not None and not self.cache_shape.keys_only  # MLA: keys stay unscaled
        scales = model_key_scales(loaded) if quant else None
        self.kv_cache = PagedKVCache.for_model(
            loaded.model,
            self.cache_shape,
            num_blocks,
            bs,
            scales,
            groups=layer_groups if len(kinds) > 1 else (),
            group_blocks=tuple(g.pool.num_blocks for g in self.block_manager.groups),
            spec=loaded.cache_spec,
        )
        self.drafter = (
            DraftProposer(draft, loaded, num_blocks, config.cache.block_size, config.attention_impl)
            if draft is not None
            else None
        )
        if growth:
            self.block_manager.pool.enable_growth(growth[1], growth[2])
            for g, step in zip(self.block_manager.groups[1:], steps[1:]):
                g.pool.enable_growth(max(growth[1], g.pool.num_blocks), step)
        self.runner = ModelRunner(loaded.model, self.kv_cache, config.attention_impl, checkpoints, self.adapters)
        self.prefix_store = self._open_prefix_store() if config.cache.prefix_cache_dir else None
        if checkpoints is not None and self.prefix_store is not None and self.prefix_store.enabled:
            checkpoints.disk = self.prefix_store.dir / "states"  # beside the blocks, in their namespace
        proposer = None
        if config.speculative.method == "ngram":
            proposer = NgramProposer(config.speculative.prompt_lookup_min, config.speculative.prompt_lookup_max)
        elif config.speculative.method == "draft":
            proposer = draft_slots
        self.scheduler = Scheduler(config, self.block_manager, proposer)
        self.check_stop = StopChecker(
            set(getattr(self.tokenizer, "eos_token_ids", None) or []), hidden_token_ids(self.tokenizer)
        )
        self.stats = EngineStats()
        # The features beyond the plain pipeline, called at each of its stages in this order (step.py).
        self.layers = Layers([self.drafter] if self.drafter is not None else [])
        if config.speculative.method is not None:
            self.layers.append(Verifier(self.scheduler, self.stats, self.check_stop))
        # (dormant until a request asks for their feature: the plain step calls neither)
        self._beams = BeamLayer(self.scheduler, self.stats, lambda t: t in self.eos_token_ids)
        self.layers.append(self._beams, dormant=True)
        self._prompt_logprobs = PromptLogprobs()
        self.layers.append(self._prompt_logprobs, dormant=True)
        self._pooling = PoolingLayer(self.scheduler)
        self.layers.append(self._pooling, dormant=True)
        # Grammars are compiled by the first guided request; each rank of a tensor-parallel group
        # would time its masks apart, so there none is failed as too slow (grammar_layer.py).
        self._grammar = GrammarLayer(
            lambda: GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids),
            judge_time=getattr(loaded.model, "tp_group", None) is None,
        )
        self.layers.append(self._grammar, dormant=True)
        if checkpoints is not None:
            self.layers.append(CheckpointNamer(checkpoints))
        if self.prefix_store is not None:
            self.layers.append(DiskConnector(self.prefix_store, self.kv_cache, self.block_manager, self.stats))
        self._check_kernels()
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self.encoder_cache = EncoderCache()  # a vision model's tower outputs, by image (multimodal.py)
        self._inflight: LaunchedStep | None = None  # launched, not read back (overlapped steps)
        self._last_plan: RowPlan | None = None  # the last decode-only step's (`_plan`)
        self._carried: list[Request] = []  # read back during a failed step: reported at the next
        self._last_read = 0.0

    def _recurrent_checks(self) -> Checkpoints | None:
        """A hybrid model (recurrent layers, worker/state_cache.py): refuse by name the features its
        state cannot follow yet; its prefix-state checkpoints when prefix caching is on."""
        self.state_bytes = 0  # one sequence's recurrent state, every layer
        if not self.loaded.cache_spec.num_recurrent:
            return None
        spec = state_spec(self.loaded.model)
        self.state_bytes = spec_nbytes(spec)
        c = self.config
        if not c.cache.enable_prefix_caching:
            return None
        return Checkpoints(min(CHECKPOINT_BYTES, CHECKPOINTS * self.state_bytes), spec, c.cache.block_size)

    def _load_draft(self) -> LoadedModel:
        """The draft model, in the target's dtype (engine/draft.py checks its tokenizer)."""
        from ..loading.loader import DTYPES, load

        dtype = next(name for name, d in DTYPES.items() if d == self.loaded.dtype)
        draft = load(self.config.speculative.draft_model, dtype)
        if draft.cache_spec.num_recurrent:
            raise MlxPagedError(
                f"a draft model with recurrent layers ({draft.config.get('model_type')!r}) is not supported: "
                "its own state cannot roll back rejected proposals yet; "
                "use an attention-only draft or --speculative ngram"
            )
        return draft

    def _resize_pools(self, num_blocks: int, copies: list[tuple[int, int]] = (), group: int = 0) -> None:
        """Grow or trim the KV pool of a group, and every layer's pool beside the full group's
        (the same block ids)."""
        self.kv_cache.resize(num_blocks, copies, group)
        if group == 0:
            for layer in self.layers.resize:
                layer.resize(num_blocks, copies)

    def _open_prefix_store(self):
        """The disk tier, namespaced by everything that changes a block's bytes (prefix_store.py);
        on a tensor-parallel rank, by its rank too, and lookups agree on the smallest hit count."""
        from pathlib import Path

        from ..worker.prefix_store import PrefixStore, namespace, namespace_parts

        rank, world, agree = self._ranks()
        root = Path(self.config.cache.prefix_cache_dir).expanduser()
        parts = namespace_parts(
            self.loaded, self.kv_cache, rank=rank, world=world, memo_file=root / "weights-digests.json"
        )
        gb = self.config.cache.prefix_cache_disk_gb
        return PrefixStore(
            root,
            namespace(parts),
            self.kv_cache.block_nbytes(),
            self.config.cache.block_size,
            cap_bytes=None if gb is None else int(gb * 1e9),
            agree=agree,
            parts=parts,
        )

    def _ranks(self):
        """(rank, world size, agree): a plain engine is rank 0 of 1 and agrees with itself (TPEngine overrides)."""
        return 0, 1, None

    def _check_kernels(self) -> None:
        """With the Metal kernel in use, build and check its variants now, before any request:
        a variant that fails falls back to the reference with one warning (attention/metal.py)."""
        from ..attention import resolve_impl

        if resolve_impl(self.config.attention_impl) == "metal":
            from ..attention.metal import check_pools

            check_pools(self.loaded.model.args.num_attention_heads, self.kv_cache.keys)
            for layer in self.layers.check_kernels:
                layer.check_kernels()

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
        ids, text = self._prompt_ids(prompt)
        prompt_images = None
        if images:  # a vision model's prompt (multimodal.py): its image markers widened, their features
            if not isinstance(images, ImageInputs):
                images = process_images(self.loaded, ids, decode_images(images))
            ids = images.ids
            prompt_images = encode_images(self.loaded.model, images, self.encoder_cache)
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

    def add_beam_request(self, prompt: str | list[int], params: BeamSearchParams, request_id: str | None = None) -> str:
        """Queue a beam search of `params.beam_width` beams over one prompt (see `beam_search`)."""
        ids, text = self._prompt_ids(prompt)
        self._check_fits(len(ids), params.beam_width, params.max_tokens)
        sp = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
        seq = Sequence(list(ids), len(ids), adapter=self.adapter(params.adapter))
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
