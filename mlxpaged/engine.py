"""`LLMEngine`: requests in, one scheduled step at a time, outputs out.

Wiring, all explicit: `Scheduler` (who runs) -> `BlockManager` (which blocks) ->
`ModelRunner` (the forward pass over `PagedKVCache`) -> `sampler` (which token).
"""

from __future__ import annotations

import itertools
import random
import time

import mlx.core as mx

from .block_manager import BlockManager, HashFn, sha256_block_hash
from .config import EngineConfig
from .errors import MlxPagedError
from .kv_cache import CacheShape, PagedKVCache, blocks_for_memory
from .loader import LoadedModel
from .model_runner import ModelRunner
from .outputs import CompletionOutput, EngineStats, RequestOutput
from .sampler import sample_batch, seed_key
from .sampling_params import SamplingParams
from .scheduler import PrefillChunk, Scheduler, prefill_target
from .sequence import FinishReason, Request, Sequence


class LLMEngine:
    """Continuous batching over a paged KV cache.

    `add_request` queues a prompt; each `step()` runs one scheduled batch and returns the
    outputs of the requests that progressed (finished ones with `finished=True`).
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, *, hash_fn: HashFn = sha256_block_hash):
        self.loaded = loaded
        self.config = config = config or EngineConfig()
        self.tokenizer = loaded.tokenizer
        args = loaded.model.args
        self.cache_shape = CacheShape(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, loaded.dtype)
        num_blocks = config.num_blocks or blocks_for_memory(
            self.cache_shape, config.block_size, config.kv_memory_fraction, config.max_kv_tokens
        )
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            hash_fn=hash_fn,
            extra_key=loaded.identity,
        )
        self.kv_cache = PagedKVCache(self.cache_shape, num_blocks, config.block_size)
        self.runner = ModelRunner(loaded.model, self.kv_cache, config.attention_impl)
        self.scheduler = Scheduler(config, self.block_manager)
        self.eos_token_ids = set(getattr(self.tokenizer, "eos_token_ids", None) or [])
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self._requests: dict[str, Request] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_manager.pool.num_blocks

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue one prompt (text or token ids); returns its request id."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise MlxPagedError("empty prompt: give at least one token")
        self._check_fits(len(ids), params)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._requests:
            raise MlxPagedError(f"duplicate request id '{rid}'")
        seed = params.seed if params.seed is not None else random.getrandbits(31)
        seqs = [
            Sequence(next(self._seq_ids), list(ids), len(ids), sample_index=i,
                     rng_key=None if params.greedy else seed_key(seed + i))
            for i in range(params.n)
        ]
        for s in seqs:
            s.detokenizer = self.tokenizer.detokenizer
        req = Request(rid, list(ids), params, seqs, arrival_index=len(self._requests), prompt_text=text)
        self._requests[rid] = req
        self.scheduler.add(req)
        self.stats.prompt_tokens += len(ids)
        return rid

    def _check_fits(self, num_prompt: int, params: SamplingParams) -> None:
        """Reject a request that could not finish even with the whole pool to itself."""
        bm = self.block_manager
        shared = num_prompt // bm.block_size if params.n > 1 else 0
        per_sample = bm.blocks_for(num_prompt + params.max_tokens - 1) - shared
        need = shared + params.n * per_sample
        if need > self.num_blocks:
            what = "prompt" if bm.blocks_for(num_prompt) > self.num_blocks else "request"
            raise MlxPagedError(
                f"{what} cannot fit in the KV pool: {num_prompt} prompt tokens, n={params.n}, "
                f"max_tokens={params.max_tokens} need up to {need} blocks of {bm.block_size} "
                f"but the pool has {self.num_blocks}; raise --num-blocks or lower -n/--max-tokens"
            )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress")  # guarded by _check_fits
            return []
        self.kv_cache.copy_blocks(out.block_copies)
        progressed: dict[str, Request] = {}

        t0 = time.perf_counter()
        for chunk in out.prefills:
            logits = self.runner.prefill(chunk.seq, chunk.num_tokens)
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.commit(chunk.seq)
            self.stats.computed_prefill_tokens += chunk.num_tokens
            self._after_prefill(chunk, logits)
            progressed[chunk.request.request_id] = chunk.request
        t1 = time.perf_counter()
        if out.decodes:
            seqs = [s for _, s in out.decodes]
            logits = self.runner.decode(seqs)
            for s in seqs:
                s.num_computed_tokens += 1
                self.block_manager.commit(s)
            self._sample_into([(r, s) for r, s in out.decodes], logits)
            self.stats.decode_tokens += len(seqs)
            for r, _ in out.decodes:
                progressed[r.request_id] = r
        t2 = time.perf_counter()
        self.stats.prefill_time += t1 - t0
        self.stats.decode_time += t2 - t1
        self.stats.steps += 1
        self._track_peaks()
        return [self._finish_or_report(r) for r in progressed.values() if r.request_id in self._requests]

    def _after_prefill(self, chunk: PrefillChunk, logits: mx.array) -> None:
        req, seq = chunk.request, chunk.seq
        if req.forked:
            if chunk.sample:
                self._sample_into([(req, seq)], logits[None])
            return
        if seq.num_computed_tokens < prefill_target(req):
            return  # more chunks to go
        # The carrier holds the shared prompt: the other live samples fork from it.
        for other in req.live_seqs():
            if other is not seq:
                self.block_manager.fork(seq, other)
        req.forked = True
        if chunk.sample:
            live = req.live_seqs()
            self._sample_into([(req, s) for s in live], mx.broadcast_to(logits, (len(live), logits.shape[-1])))

    def _sample_into(self, pairs: list[tuple[Request, Sequence]], logits: mx.array) -> None:
        toks, keys = sample_batch(logits, [r.params for r, _ in pairs], [s.rng_key for _, s in pairs])
        for (req, seq), tok, key in zip(pairs, toks, keys):
            seq.rng_key = key
            seq.token_ids.append(tok)
            self.stats.generation_tokens += 1
            self._check_stop(req, seq, tok)
            if seq.finished:
                self.block_manager.free(seq)

    def _check_stop(self, req: Request, seq: Sequence, tok: int) -> None:
        p = req.params
        seq.detokenizer.add_token(tok)
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            seq.finish_reason = FinishReason.STOP
        elif p.stop:
            text = seq.detokenizer.text
            hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
            if hits:
                seq.finish_reason = FinishReason.STOP
                seq.stop_text_len = min(hits)
        if seq.finish_reason is None and seq.num_output_tokens >= p.max_tokens:
            seq.finish_reason = FinishReason.LENGTH

    def _track_peaks(self) -> None:
        st = self.stats
        running = [s for r in self.scheduler.running for s in r.live_seqs()]
        st.blocks_in_use_peak = max(st.blocks_in_use_peak, self.block_manager.pool.num_used)
        st.blocks_without_sharing_peak = max(st.blocks_without_sharing_peak, sum(len(s.block_table) for s in running))
        st.running_seqs_peak = max(st.running_seqs_peak, len(running))

    def _finish_or_report(self, req: Request) -> RequestOutput:
        if req.finished:
            self.scheduler.finish(req)
            del self._requests[req.request_id]
        return self.make_output(req)

    def make_output(self, req: Request) -> RequestOutput:
        outs = []
        for s in req.seqs:
            if s.finished:
                s.detokenizer.finalize()
            text = s.detokenizer.text
            if s.stop_text_len is not None:
                text = text[: s.stop_text_len]
            outs.append(CompletionOutput(s.sample_index, text, list(s.output_token_ids),
                                         s.finish_reason.value if s.finish_reason else None))
        return RequestOutput(req.request_id, req.prompt_text, req.prompt_token_ids, outs, req.finished, req.num_cached_tokens)

    # -- introspection ---------------------------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        return [s for r in self.scheduler.running for s in r.seqs if s.block_table]

    def check_invariants(self) -> None:
        self.block_manager.check(self.live_sequences())

    def stats_dict(self) -> dict:
        st, pool = self.stats, self.block_manager.pool
        return {
            "prompt_tokens": st.prompt_tokens,
            "generation_tokens": st.generation_tokens,
            "prompt_tps": st.computed_prefill_tokens / st.prefill_time if st.prefill_time else 0.0,
            "generation_tps": st.decode_tokens / st.decode_time if st.decode_time else 0.0,
            "peak_memory_gb": mx.get_peak_memory() / 1e9,
            "block_size": self.config.block_size,
            "num_blocks": pool.num_blocks,
            "blocks_in_use_peak": st.blocks_in_use_peak,
            "blocks_without_sharing": st.blocks_without_sharing_peak,
            "cow_copies": self.block_manager.num_cow_copies,
            "prefix_cache_hit_tokens": self.scheduler.prefix_cache_hit_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "blocks_free": pool.num_free,
            "blocks_cached": len(pool.cached),
            "running_seqs_peak": st.running_seqs_peak,
        }
