"""Encoder embedding models (BERT, XLM-RoBERTa and BGE-M3, ModernBERT) and ModernBERT cross-encoders,
run by mlx-embeddings, behind the interface the server's engine loop drives (`add_request`, `step`,
`abort_request`, `has_unfinished_requests`, `metrics`, `trim_pool`, `tokenizer`): the same one
`LLMEngine` offers, so every route, the admission path and the engine thread serve either.

An encoder attends both ways over its whole input at once: there is nothing to cache between steps
and nothing to decode, so it has no KV pool and no scheduler. A step takes the waiting requests in
arrival order (as many as `max_batch_tokens` padded positions hold), pads their ids to the batch's
longest with the pad id and an attention mask (as mlx-embeddings' `generate` pads a batch), runs the
model once, and finishes every request of the batch.

Each request's values come from mlx-embeddings' own outputs: `text_embeds` (its mean pooling over
the mask, L2-normalised) for a checkpoint that pools by mean and normalises; otherwise its
`last_hidden_state`, pooled as the checkpoint's sentence-transformers files say (the first token
for CLS pooling, BGE-M3's; mlx-embeddings' `mean_pooling` for mean), normalised when they have a
Normalize module; a ModernBERT model pools inside (its `classifier_pooling`). A cross-encoder's
score is its classification output, `pooler_output` (mlx-embeddings applies the sigmoid to a one-label
head, as sentence-transformers' CrossEncoder does).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..loading.encoder import EncoderModel
from .outputs import RequestOutput
from .pooling import PoolingParams

MAX_BATCH_TOKENS = 8192  # padded positions in one forward pass


@dataclass
class _Waiting:
    request_id: str
    ids: list[int]
    params: PoolingParams
    arrival: float = field(default_factory=time.monotonic)


class EncoderEngine:
    """Pooled requests on an encoder (module doc).

    Invariant: no KV cache and no decode. A request waits in `waiting` until the one step that
    computes it, in a batch padded to that batch's longest input; that step returns its one
    finished `RequestOutput` (its `pooled` values, no completion outputs) and the request is gone.
    Only the engine loop's thread calls it."""

    grammar_compiler = None  # it generates nothing, so it has no grammars

    def __init__(self, loaded: EncoderModel, max_batch_tokens: int = MAX_BATCH_TOKENS):
        self.loaded, self.tokenizer = loaded, loaded.tokenizer
        self.max_batch_tokens = max_batch_tokens
        self.waiting: OrderedDict[str, _Waiting] = OrderedDict()
        self.counters = {"prompt_tokens_computed": 0, "requests_finished": 0}

    def add_request(self, prompt: list[int], params: PoolingParams, request_id: str) -> str:
        if not isinstance(params, PoolingParams):
            raise ValueError(f"'{self.loaded.path.name}' is an embedding model; it does not generate")
        want = "classify" if self.loaded.task == "score" else "embed"
        if params.task != want:
            raise ValueError(f"prompt: this encoder computes '{want}' requests, not '{params.task}'")
        context = self.loaded.context
        if context is not None and len(prompt) > context:
            raise ValueError(f"prompt has {len(prompt)} tokens, more than the model's {context} positions")
        if not prompt:
            raise ValueError("prompt is empty")
        self.waiting[request_id] = _Waiting(request_id, list(prompt), params)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def trim_pool(self) -> int:
        return 0  # no pool

    def _batch(self) -> list[_Waiting]:
        batch, longest = [], 0
        for w in self.waiting.values():
            wide = max(longest, len(w.ids))
            if batch and wide * (len(batch) + 1) > self.max_batch_tokens:
                break
            batch.append(w)
            longest = wide
        return batch

    def forward(self, rows: list[list[int]]):
        """mlx-embeddings' outputs for `rows`, right-padded to the longest with the pad id and masked."""
        longest = max(map(len, rows))
        ids = np.full((len(rows), longest), self.loaded.pad_id, dtype=np.int32)
        mask = np.zeros((len(rows), longest), dtype=np.float32)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1.0
        return self.loaded.model(mx.array(ids), attention_mask=mx.array(mask).astype(self.loaded.dtype)), mx.array(mask)

    def pooled(self, out, mask: mx.array) -> mx.array:
        """[B, D] float32: each row's embedding (or [B, 1]: its score), as the checkpoint defines it."""
        from mlx_embeddings.models.base import mean_pooling, normalize_embeddings

        m = self.loaded
        if m.task == "score":
            return out.pooler_output.astype(mx.float32)
        h = out.last_hidden_state
        if h.ndim == 2:  # ModernBERT pooled already (its classifier_pooling)
            v = h
        elif m.pooling == "mean" and m.normalize:
            return out.text_embeds.astype(mx.float32)
        elif m.pooling == "mean":
            v = mean_pooling(h, mask)
        else:
            v = h[:, 0]
        v = v.astype(mx.float32)
        return normalize_embeddings(v) if m.normalize else v

    def step(self) -> list[RequestOutput]:
        batch = self._batch()
        if not batch:
            return []
        out, mask = self.forward([w.ids for w in batch])
        values = np.array(self.pooled(out, mask))
        done = []
        for w, v in zip(batch, values):
            del self.waiting[w.request_id]
            p = w.params
            if p.task == "embed":  # normalised (or not) as the checkpoint defines, whatever `p.normalize` says
                v = v[: p.dimensions]
                if p.dimensions is not None and self.loaded.normalize:  # truncated: normalised again
                    v = v / max(float(np.linalg.norm(v)), 1e-12)
            done.append(RequestOutput(w.request_id, None, w.ids, [], True, pooled=v.astype(np.float32).tolist()))
            self.counters["prompt_tokens_computed"] += len(w.ids)
        self.counters["requests_finished"] += len(done)
        return done

    def metrics(self) -> dict:
        return {"requests_waiting": len(self.waiting), "requests_held": len(self.waiting), **self.counters}
