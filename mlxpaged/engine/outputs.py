"""What `LLM.generate` and `LLMEngine.step` return, shaped like vLLM's outputs.

An output is cumulative (everything so far) or, for `SamplingParams(output_kind="delta")`, a
delta: the text, token ids and logprobs new since the request's previous output. `add` folds a
later delta into an earlier one, so any run of deltas sums to the cumulative output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass
class TokenLogprob:
    """One generated token's log-probabilities: the model's log-softmax of the raw logits
    (before temperature, top-k and top-p), as vLLM returns them by default."""

    token_id: int  # the token that was chosen
    logprob: float  # its log-probability
    top_logprobs: list[tuple[int, float]]  # the `SamplingParams.logprobs` most likely (id, logprob), best first


class IdsSnapshot(NamedTuple):
    """`source[start:stop]`, not copied yet: `source` only ever grows at its end (a sequence's
    `token_ids`), so the slice stays what it was when this was taken."""

    source: list[int]
    start: int
    stop: int


class CompletionOutput:
    """One sample's output (vLLM's fields). A cumulative output's `token_ids` may come as an
    `IdsSnapshot`, copied on the first read: a step hands out every running sample's output, and
    copying each one's whole token list every step (items scattered over the heap) was the largest
    part of an output's cost, for lists mostly never read (`LLM.generate` keeps the last).
    Invariant: reading `token_ids` always gives the same list, the output's own."""

    FIELDS = ("index", "text", "token_ids", "finish_reason", "logprobs", "cumulative_logprob", "score", "stop_reason")
    __slots__ = ("index", "text", "_ids", "finish_reason", "logprobs", "cumulative_logprob", "score", "stop_reason")

    def __init__(
        self,
        index: int,  # the sample's index within its request
        text: str,
        token_ids: list[int] | IdsSnapshot,  # generated ids only
        finish_reason: str | None,  # "stop", "length", or None while running
        logprobs: list[TokenLogprob] | None = None,  # one per generated token when SamplingParams.logprobs is set
        cumulative_logprob: float | None = None,  # beam search: log-probability of token_ids
        score: float | None = None,  # beam search: cumulative_logprob / length ** length_penalty
        # vLLM's: what ended a "stop" sample other than EOS or its grammar: the stop string (cut off
        # `text`) or the `stop_token_ids` entry; None otherwise
        stop_reason: str | int | None = None,
    ):
        self.index = index
        self.text = text
        self._ids = token_ids
        self.finish_reason = finish_reason
        self.logprobs = logprobs
        self.cumulative_logprob = cumulative_logprob
        self.score = score
        self.stop_reason = stop_reason

    @property
    def token_ids(self) -> list[int]:
        ids = self._ids
        if type(ids) is IdsSnapshot:
            ids = self._ids = ids.source[ids.start : ids.stop]
        return ids

    @token_ids.setter
    def token_ids(self, ids: list[int]) -> None:
        self._ids = ids

    def copy(self) -> CompletionOutput:
        """A copy with lists of its own."""
        lps = list(self.logprobs) if self.logprobs is not None else None
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            self.finish_reason,
            lps,
            self.cumulative_logprob,
            self.score,
            self.stop_reason,
        )

    def __eq__(self, other) -> bool:
        if type(other) is not CompletionOutput:
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self.FIELDS)

    def __repr__(self) -> str:
        return "CompletionOutput(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in self.FIELDS) + ")"


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    delta: bool = False  # `outputs` hold only what is new since the previous output
    # SamplingParams.prompt_logprobs: one TokenLogprob per prompt token, the first None; in a
    # cumulative output once the prompt is scored, in the first delta after that
    prompt_logprobs: list | None = None
    # a pooled request (engine/pooling.py): its embedding, or [score], once finished; `outputs` is empty
    pooled: list[float] | None = None

    def add(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by `later` (a delta of the same request), as one delta; in place."""
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            m = mine.get(c.index)
            if m is None:  # a copy: `later` stays as it was
                m = mine[c.index] = c.copy()
                self.outputs.append(m)
                continue
            m.text += c.text
            m.token_ids += c.token_ids
            if c.logprobs is not None:
                m.logprobs = list(c.logprobs) if m.logprobs is None else m.logprobs + c.logprobs
            m.finish_reason, m.stop_reason = c.finish_reason, c.stop_reason
            m.cumulative_logprob, m.score = c.cumulative_logprob, c.score
        self.outputs.sort(key=lambda c: c.index)
        self.finished = later.finished
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        if self.pooled is None:
            self.pooled = later.pooled
        return self
