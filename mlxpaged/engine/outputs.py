"""What `LLM.generate` and `LLMEngine.step` return, shaped like vLLM's outputs.

An output is cumulative (everything so far) or, for `SamplingParams(output_kind="delta")`, a
delta: the text, token ids and logprobs new since the request's previous output. `add` folds a
later delta into an earlier one, so any run of deltas sums to the cumulative output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class TokenLogprob:
    """One generated token's log-probabilities: the model's log-softmax of the raw logits
    (before temperature, top-k and top-p), as vLLM returns them by default."""

    token_id: int  # the token that was chosen
    logprob: float  # its log-probability
    top_logprobs: list[tuple[int, float]]  # the `SamplingParams.logprobs` most likely (id, logprob), best first


@dataclass(slots=True)
class CompletionOutput:
    index: int  # the sample's index within its request
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str | None  # "stop", "length", or None while running
    logprobs: list[TokenLogprob] | None = None  # one per generated token when SamplingParams.logprobs is set
    cumulative_logprob: float | None = None  # beam search: log-probability of token_ids
    score: float | None = None  # beam search: cumulative_logprob / length ** length_penalty
    # vLLM's: what ended a "stop" sample other than EOS or its grammar: the stop string (cut off
    # `text`) or the `stop_token_ids` entry; None otherwise
    stop_reason: str | int | None = None


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

    def add(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by `later` (a delta of the same request), as one delta; in place."""
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            m = mine.get(c.index)
            if m is None:  # a copy: `later` stays as it was
                lps = list(c.logprobs) if c.logprobs is not None else None
                m = mine[c.index] = replace(c, token_ids=list(c.token_ids), logprobs=lps)
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
        return self
