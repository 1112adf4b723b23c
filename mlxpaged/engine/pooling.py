"""Pooled requests: a prompt's embedding (`/v1/embeddings`) or a reranker's score (`/v1/rerank`),
computed as a prefill that samples nothing, in the same packed passes as every other request.

A pooled request (`LLMEngine.add_pooling_request`) is scheduled like any prompt: chunked prefill,
prefix-cache hits (its full blocks are cached for others too), preemption. Its last prompt chunk
draws no token (`PrefillChunk.sample` is False); instead `PoolingLayer` takes that position's final
hidden state (after the model's final norm: the rows the output layer reads) and its logits
(`hidden_wanted` / `pooled`). Once the step is read back the request ends there, its blocks freed:
it never decodes.

- `task="embed"`: last-token pooling (the decoder embedding models' own: Qwen3-Embedding's
  `last_token_pool`), then the first `dimensions` values (Matryoshka truncation) and, with
  `normalize`, L2-normalised. The values are float32.
- `task="score"`: a yes/no reranker's relevance (Qwen3-Reranker's model card): the softmax of the
  last position's logits over the two tokens `(yes, no)`, taken at `yes`.
- `task="classify"`: a cross-encoder's score, its classification head's output; only the encoder
  backend (engine/encoder.py) computes it.

Invariant: a pooled request's `Request.pooled` is None until the step holding its last prompt
position is read back; then it is the vector (embed) or `[score]` (score) and the request is
finished. A preempted or aborted request's values are dropped (a preempted one computes them
again from its prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import mlx.core as mx
import numpy as np

from ..core.sequence import FinishReason, RequestStatus
from .step import LaunchedStep, StepLayer

if TYPE_CHECKING:
    from ..core.scheduler import PrefillChunk, Scheduler, SchedulerOutput
    from ..core.sequence import Request


@dataclass(frozen=True)
class PoolingParams:
    """What a pooled request returns. `dimensions`: keep the first this many values (None: all);
    `yes_no`: the reranker's (yes, no) token ids, for `task="score"`. The other fields are those the
    engine loop and the server's `Job` read off any request's params (a pooled request has one
    sample, no grammar, draws nothing); `output_kind` is kept as given (a pooled request reports
    one final output either way)."""

    task: Literal["embed", "score", "classify"] = "embed"
    dimensions: int | None = None
    normalize: bool = True
    yes_no: tuple[int, int] | None = None
    output_kind: str = "cumulative"
    n: int = 1
    seed: int | None = None
    guided: None = None
    max_tokens: int = 0
    prompt_logprobs: None = None
    logprobs: None = None

    def __post_init__(self):
        if self.task not in ("embed", "score", "classify"):
            raise ValueError(f"task must be 'embed', 'score' or 'classify', not {self.task!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, not {self.dimensions}")
        if self.task == "score" and (self.yes_no is None or len(self.yes_no) != 2):
            raise ValueError("a score request needs the reranker's (yes, no) token ids")

    def to_wire(self) -> dict:
        """JSON data for a tensor-parallel server's other ranks (`from_wire` rebuilds it)."""
        return {"pooling": {**self.__dict__, "yes_no": list(self.yes_no) if self.yes_no else None}}

    @classmethod
    def from_wire(cls, data: dict) -> PoolingParams:
        d = dict(data["pooling"])
        d["yes_no"] = tuple(d["yes_no"]) if d["yes_no"] else None
        return cls(**d)


def pool_values(hidden: np.ndarray, yes_no: np.ndarray, params: PoolingParams) -> list[float]:
    """One request's values from its last position's final hidden state `[H]` and its logits at
    the (yes, no) tokens `[2]` (a score's; an embedding ignores them)."""
    if params.task == "score":
        yes, no = float(yes_no[0]), float(yes_no[1])
        return [float(1.0 / (1.0 + np.exp(no - yes)))]  # softmax over (no, yes), at yes
    v = hidden[: params.dimensions].astype(np.float32)
    if params.normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)  # as torch's F.normalize: a zero vector stays zero
    return v.tolist()


def _ends_prompt(c: PrefillChunk) -> bool:
    return c.request.pooling is not None and c.seq.num_computed_tokens + c.num_tokens == c.request.num_prompt_tokens


class PoolingLayer(StepLayer):
    """Takes the pooled requests' last positions from the step and ends those requests once read back."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def hidden_wanted(self, out: SchedulerOutput) -> list[int]:
        if not out.prefills:  # (the decode steps)
            return []
        first = len(out.decodes)
        return [first + i for i, c in enumerate(out.prefills) if _ends_prompt(c)]

    def pooled(self, step: LaunchedStep, hidden: mx.array, logits: mx.array) -> list[mx.array]:
        """`hidden` [k, H] and `logits` [k, V]: the last positions of the chunks `hidden_wanted` named."""
        reqs = [c.request for c in step.out.prefills if _ends_prompt(c)]
        h = hidden.astype(mx.float32)
        # a score needs two logits of a row, an embedding none: only those are kept with the step
        pairs = [r.pooling.yes_no if r.pooling.task == "score" else (0, 0) for r in reqs]
        picked = mx.take_along_axis(logits, mx.array(pairs, dtype=mx.int32), axis=-1).astype(mx.float32)
        step.held[self] = (reqs, h, picked)
        return [h, picked]

    def read_back(self, step: LaunchedStep) -> list[Request]:
        held = step.held.pop(self, None)
        if held is None:
            return []
        reqs, h, picked = held
        hidden, two = np.array(h), np.array(picked)
        done = []
        for j, req in enumerate(reqs):
            if req.finished or req.status is not RequestStatus.RUNNING:  # aborted, or preempted since
                continue
            req.pooled = pool_values(hidden[j], two[j], req.pooling)
            seq = req.seqs[0]
            seq.finish_reason = FinishReason.STOP
            self.scheduler.finish_sequence(req, seq)  # its blocks go back now (full ones stay cached)
            done.append(req)
        return done
