"""What `LLM.generate` and `LLMEngine.step` return, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprob:
    """One generated token's log-probabilities: the model's log-softmax of the raw logits
    (before temperature, top-k and top-p), as vLLM returns them by default."""

    token_id: int  # the token that was chosen
    logprob: float  # its log-probability
    top_logprobs: list[tuple[int, float]]  # the `SamplingParams.logprobs` most likely (id, logprob), best first


@dataclass
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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
