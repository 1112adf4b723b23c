"""Typed request bodies of the OpenAI API (`/v1/completions`, `/v1/chat/completions`).

Types are strict: `"max_tokens": "5"` is a wrong type, not 5. Truly unknown fields are ignored,
as OpenAI's clients send fields this server has no use for; but a known OpenAI field this server
does not implement (`UNIMPLEMENTED`) is refused by name when it asks for anything, so a client
never believes that JSON mode or tools were honoured. Every string is checked for lone
surrogates (`Text`): JSON allows `"\\ud800"`, UTF-8 (the tokenizer, our responses) does not.
`to_sampling_params` is the only place where a body becomes `SamplingParams`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from ..engine.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]


def _no_surrogates(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone UTF-16 surrogate at character {e.start}; send valid Unicode") from None
    return s


Text = Annotated[str, AfterValidator(_no_surrogates)]

# Known OpenAI fields we do not implement -> the values that ask for nothing (accepted as no-ops).
# One set for every route: implementing a field means deleting its line here.
_OFF = (None, False, 0, "", [], {})
UNIMPLEMENTED: dict[str, tuple] = {
    "tools": _OFF,
    "tool_choice": _OFF + ("none",),
    "functions": _OFF,
    "function_call": _OFF + ("none",),
    "parallel_tool_calls": _OFF + (True,),
    "response_format": _OFF + ({"type": "text"},),
    "best_of": _OFF + (1,),
    "echo": _OFF,
    "suffix": _OFF,
    "audio": _OFF,
    "modalities": _OFF + (["text"],),
    "prediction": _OFF,
    "web_search_options": _OFF,
}


def _asks_for_nothing(value, no_ops: tuple) -> bool:
    # `==` alone would take True for 1 and 0.0 for False; booleans match only booleans.
    return value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in no_ops)


def refuse_unimplemented(data):
    """Raise (a 400 naming the field) if a raw body asks for a known field we do not implement."""
    if isinstance(data, dict):
        for name, no_ops in UNIMPLEMENTED.items():
            if name in data and not _asks_for_nothing(data[name], no_ops):
                raise PydanticCustomError("unimplemented", "{field} is not supported by this server",
                                          {"field": name})
    return data


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Request(_Body):
    """A whole request body (not a part of one)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data):
        return refuse_unimplemented(data)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Request):
    """Fields both endpoints share."""

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # an extension, as in vLLM: 0 or -1 is off
    seed: int | None = None
    # Sampling knobs (SamplingParams checks their ranges); logit_bias keys are token ids as strings.
    min_p: float = 0.0
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = Field(1, ge=1, le=64)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # accepted and ignored

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (SamplingParams' own checks) for values the types let through."""
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, max_tokens=max_tokens, stop=self.stop,
                              stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
                              min_p=self.min_p, logit_bias=self.logit_bias, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              **({"logprobs": logprobs} if logprobs is not None else {}))


class CompletionRequest(_Sampling):
    # One prompt or a batch, as text or token ids (OpenAI accepts all four shapes).
    prompt: Text | list[Text] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: Text


def check_message_content(role: str, content) -> None:
    """The one rule for a message's content: present and not an empty list of parts.

    (An assistant message carrying tool calls may lack content, once tool calls exist.)"""
    if content is None:
        raise ValueError(f"a {role} message needs content")
    if isinstance(content, list) and not content:
        raise ValueError(f"a {role} message's content is an empty list of parts")


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    @model_validator(mode="after")
    def _content(self):
        check_message_content(self.role, self.content)
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        """Top alternatives per token when logprobs are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None
