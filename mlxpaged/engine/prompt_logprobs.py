"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`; what lm-eval's `echo` asks for): the
log-probability of every prompt token given the ones before it, and its top-k, computed in the
step's one packed pass beside everything else.

A prompt chunk of a request that asks for them asks the runner for the logits at every one of its
positions (`logits_wanted`): position p predicts token p + 1, so a chunk over positions
[s, s + n) scores the prompt tokens s + 1 .. min(s + n, P) - 1 (the last position of the prompt
predicts the first generated token: a sample, not a prompt token). Only those rows are computed
through the output layer, so requests that ask for nothing pay nothing. Such a request takes no
prefix-cache hits (`Scheduler._admit`): a cached position has no logits to score; its full blocks
are still cached for others. A preempted request scores its positions again (the same values).

Invariant: `Request.prompt_logprobs` is None until the request's prompt is scored through its
last position; then it holds P entries, the first None (no token comes before it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from .outputs import TokenLogprob
from .sampler import best_first, logprob_arrays
from .step import LaunchedStep, StepLayer

if TYPE_CHECKING:
    from ..core.scheduler import PrefillChunk, SchedulerOutput
    from ..core.sequence import Request


def _wants(chunk: PrefillChunk) -> bool:
    req = chunk.request
    return (
        req.params.prompt_logprobs is not None
        and req.prompt_logprobs is None
        and chunk.seq.num_computed_tokens < req.num_prompt_tokens - 1
    )


class PromptLogprobs(StepLayer):
    """Scores prompt tokens from the extra logits rows the runner returns for the chunks that ask."""

    def __init__(self):
        self._partial: dict[Request, list] = {}  # request -> P entries being filled, chunk by chunk

    def logits_wanted(self, out: SchedulerOutput) -> list[int]:
        if not out.prefills:  # (the decode steps: most steps)
            return []
        first = len(out.decodes)
        return [first + i for i, c in enumerate(out.prefills) if _wants(c)]

    def launched(self, step: LaunchedStep, rows: mx.array) -> list[mx.array]:
        """`rows`: every position's logits of the chunks `logits_wanted` named, in order."""
        held, todo, at = [], [], 0
        for c in step.out.prefills:
            if not _wants(c):
                continue
            req, start, n = c.request, c.seq.num_computed_tokens, c.num_tokens
            m = min(start + n, req.num_prompt_tokens - 1) - start  # positions that predict a prompt token
            targets = mx.array(req.prompt_token_ids[start + 1 : start + 1 + m], dtype=mx.int32)
            chosen, ids, vals = logprob_arrays(
                rows[at : at + m], targets, min(req.params.prompt_logprobs, rows.shape[-1])
            )
            at += n
            top = None if ids is None else (ids, vals)
            todo += [chosen] + ([ids, vals] if ids is not None else [])
            held.append((req, start, chosen, top))
        step.held[self] = held
        return todo

    def read_back(self, step: LaunchedStep) -> list[Request]:
        if not self._partial and self not in step.held:  # (no prompt being scored: most steps)
            return []
        for req, start, chosen, top in step.held.pop(self, ()):
            entries = self._partial.setdefault(req, [None] * req.num_prompt_tokens)
            ids, vals = (top[0].tolist(), top[1].tolist()) if top is not None else (None, None)
            for j, lp in enumerate(chosen.tolist()):
                pos = start + 1 + j
                best = best_first(ids[j], vals[j]) if ids is not None else []
                entries[pos] = TokenLogprob(req.prompt_token_ids[pos], lp, best)
            if all(e is not None for e in entries[1:]):
                req.prompt_logprobs = self._partial.pop(req)
        for req in [r for r in self._partial if r.finished]:  # aborted before its prompt was scored
            del self._partial[req]
        return []
