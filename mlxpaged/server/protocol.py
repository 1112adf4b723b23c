"""Typed request bodies of the OpenAI API (`/v1/completions`, `/v1/chat/completions`).

Types are strict: `"max_tokens": "5"` is a wrong type, not 5. Unknown fields are ignored, as
OpenAI's clients send fields this server has no use for. `to_sampling_params` is the only
place where a body becomes `SamplingParams`.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

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
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # accepted and ignored
    # The sampling knobs (OpenAI's penalties and logit_bias; min_p and repetition_penalty as in vLLM).
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    min_p: float = Field(0.0, ge=0, le=1)
    logit_bias: Optional[dict[str, float]] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None, vocab_size: int | None = None,
                           **extra) -> SamplingParams:
        """Raises ValueError (SamplingParams' own checks) for values the types let through."""
        knobs = dict(presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                     repetition_penalty=self.repetition_penalty, min_p=self.min_p,
                     logit_bias=logit_bias_ids(self.logit_bias, vocab_size))
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, max_tokens=max_tokens, stop=self.stop,
                              stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
                              **({"logprobs": logprobs} if logprobs is not None else {}), **knobs,
                              **{k: v for k, v in extra.items() if v is not None})


def logit_bias_ids(bias: dict[str, float] | None, vocab_size: int | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token id as a string -> bias in [-100, 100]) with int keys."""
    if not bias:
        return None
    out = {}
    for k, v in bias.items():
        try:
            tid = int(k)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            raise ValueError(f"logit_bias keys must be token ids in 0..{(vocab_size or 1) - 1}, got {tid}")
        if not -100 <= v <= 100:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {v} for token {tid}")
        out[tid] = float(v)
    return out


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


class FunctionCall(_Body):
    name: str
    arguments: str  # a JSON object, as text


class ChatToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ChatToolCall]] = None  # an assistant turn that called tools
    tool_call_id: Optional[str] = None  # a tool's result: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments
    strict: Optional[bool] = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaSpec(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaSpec] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    response_format: Optional[ResponseFormat] = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        """Top alternatives per token when logprobs are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None
