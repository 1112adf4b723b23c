"""Typed request bodies of the OpenAI API (`/v1/completions`, `/v1/chat/completions`).

Types are strict: `"max_tokens": "5"` is a wrong type, not 5. Unknown fields are ignored, as
OpenAI's clients send fields this server has no use for. `to_sampling_params` is the only
place where a body becomes `SamplingParams`.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields both endpoints share."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # an extension, as in vLLM: 0 or -1 is off
    seed: Optional[int] = None
    n: int = Field(1, ge=1, le=64)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    speculative: bool = True  # false opts this request out of speculative decoding
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # accepted and ignored

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (SamplingParams' own checks) for values the types let through."""
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, max_tokens=max_tokens, stop=self.stop,
                              stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
                              speculative=self.speculative,
                              **({"logprobs": logprobs} if logprobs is not None else {}))


class CompletionRequest(_Sampling):
    # One prompt or a batch, as text or token ids (OpenAI accepts all four shapes).
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        """Top alternatives per token when logprobs are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None
