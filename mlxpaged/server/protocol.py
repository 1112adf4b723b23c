"""Typed request bodies of the OpenAI API (`/v1/completions`, `/v1/chat/completions`).

Types are strict: `"max_tokens": "5"` is a wrong type, not 5. A top-level field the body does not
declare is refused by name (bodies.py), as OpenAI's API refuses one, unless it changes nothing
here (`IGNORED`: `metadata`, `store`, ...); a known OpenAI field this server does not implement
(`UNIMPLEMENTED`) is refused by name when it asks for anything, so a client never believes that
JSON mode or tools were honoured. Every string is checked for lone
surrogates (`Text`): JSON allows `"\\ud800"`, UTF-8 (the tokenizer, our responses) does not.
`to_sampling_params` is the only place where a body becomes `SamplingParams`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from ..engine.sampling_params import SamplingParams
from .bodies import Body, refuse_unknown

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
    "functions": _OFF,
    "function_call": _OFF + ("none",),
    "best_of": _OFF + (1,),
    "suffix": _OFF,
    "audio": _OFF,
    "modalities": _OFF + (["text"],),
    "prediction": _OFF,
    "web_search_options": _OFF,
    "reasoning_effort": (None,),  # a reasoning model's thinking follows its template's default here
    "verbosity": (None,),
    # vLLM's completions extension; 0 asks for them (the logprob alone), so only null is a no-op.
    # `echo` with `logprobs` gives the same values in OpenAI's shape.
    "prompt_logprobs": (None,),
}


def _asks_for_nothing(value, no_ops: tuple) -> bool:
    # `==` alone would take True for 1 and 0.0 for False; booleans match only booleans.
    return value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in no_ops)


def refuse_unimplemented(data):
    """Raise (a 400 naming the field) if a raw body asks for a known field we do not implement."""
    if isinstance(data, dict):
        for name, no_ops in UNIMPLEMENTED.items():
            if name in data and not _asks_for_nothing(data[name], no_ops):
                raise PydanticCustomError("unimplemented", "{field} is not supported by this server", {"field": name})
    return data


_Body = Body


class _Request(_Body):
    """A whole request body (not a part of one): its undeclared top-level fields refused by name,
    but for `IGNORED` and the no-op values of `UNIMPLEMENTED`."""

    IGNORED: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data):
        return refuse_unknown(cls, refuse_unimplemented(data), cls.IGNORED | UNIMPLEMENTED.keys())


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Request):
    """Fields both endpoints share."""

    # OpenAI's fields that change no answer: stored completions, tags, tiers, cache routing hints
    IGNORED = frozenset({"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # an extension, as in vLLM: 0 or -1 is off
    seed: int | None = None
    n: int = Field(1, ge=1, le=64)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    speculative: bool = True  # false opts this request out of speculative decoding
    cache_salt: str | None = None  # vLLM's: prefix-cache isolation (blocks shared only within one salt)
    adapters: Text | None = None  # mlx_lm.server's: a LoRA adapter given at start, by name or folder
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # accepted and ignored
    # The sampling knobs (OpenAI's penalties and logit_bias; min_p and repetition_penalty as in vLLM).
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    min_p: float = Field(0.0, ge=0, le=1)
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def to_sampling_params(
        self, max_tokens: int, logprobs: int | None, vocab_size: int | None = None, **extra
    ) -> SamplingParams:
        """Raises ValueError (SamplingParams' own checks) for values the types let through."""
        knobs = dict(
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            logit_bias=logit_bias_ids(self.logit_bias, vocab_size),
        )
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            speculative=self.speculative,
            cache_salt=self.cache_salt,
            **({"logprobs": logprobs} if logprobs is not None else {}),
            **knobs,
            **{k: v for k, v in extra.items() if v is not None},
        )


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
    prompt: Text | list[Text] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # The legacy API's: the prompt comes back before the completion, with its tokens' logprobs when
    # `logprobs` is set (the first None); with `max_tokens: 0`, only the prompt (lm-eval's scoring).
    echo: bool = False
    max_tokens: int | None = Field(None, ge=0)

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


class ImageURL(_Body):
    url: str  # a data URL (data:image/png;base64,...), or http(s) with --fetch-image-urls (admission.py)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the processor sizes every image


class ImageURLPart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


ChatPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]


def refuse_parts(content, known: tuple[str, ...], what: str = "content part"):
    """`content` unchanged, or a ValueError naming the first part type not in `known` (a part
    the server does not implement is refused by name, not by the union's parse error)."""
    if isinstance(content, list):
        for i, p in enumerate(content):
            t = p.get("type") if isinstance(p, dict) else None
            if isinstance(t, str) and t not in known:
                raise ValueError(
                    f"{what} {i} has type {t!r}, which this server does not take (it takes {', '.join(known)})"
                )
    return content


def image_part(url: str, where: str) -> dict:
    """A template message's image part: the chat template sees `{"type": "image"}`, the
    admission path takes `url` (named `where` in its errors) out before rendering it."""
    return {"type": "image", "url": url, "where": where}


def check_message_content(role: str, content, has_tool_calls: bool = False) -> None:
    """The one rule for a message's content: present and not an empty list of parts (an assistant
    message that carries tool calls may have none)."""
    if content is None and has_tool_calls and role == "assistant":
        return
    if content is None:
        raise ValueError(f"a {role} message needs content")
    if isinstance(content, list) and not content:
        raise ValueError(f"a {role} message's content is an empty list of parts")


class FunctionCall(_Body):
    name: str
    arguments: str  # a JSON object, as text


class ChatToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ChatPart] | None = None
    name: Text | None = None
    tool_calls: list[ChatToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None  # a tool's result: the call it answers

    @model_validator(mode="before")
    @classmethod
    def _parts(cls, data):
        if isinstance(data, dict):
            refuse_parts(data.get("content"), ("text", "image_url"))
        return data

    @model_validator(mode="after")
    def _content(self):
        check_message_content(self.role, self.content, has_tool_calls=bool(self.tool_calls))
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content or ""

    def template_content(self, where: str) -> str | list[dict]:
        """The content as a chat template reads it: the text, or with images its parts in order."""
        if not isinstance(self.content, list) or all(isinstance(p, TextPart) for p in self.content):
            return self.text()
        return [
            {"type": "text", "text": p.text} if isinstance(p, TextPart) else image_part(p.image_url.url, f"{where}.{i}")
            for i, p in enumerate(self.content)
        ]


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


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
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        """Top alternatives per token when logprobs are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None
