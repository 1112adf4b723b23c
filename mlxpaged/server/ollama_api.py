"""Ollama's API (`/api/...`), one more translation onto the one admission path and event stream.

Routes: `GET /api/version`, `GET /api/tags`, `POST /api/show`, `GET /api/ps`, `POST /api/chat`,
`POST /api/generate`, `POST /api/embed` and the older `POST /api/embeddings` (embeddings_api.py:
the same pooled requests as `/v1/embeddings`; `truncate: true` and any option are refused). A chat
or generate body becomes an `Ask` (admission.py): the same checks, limits and tokenizing as every
other route, and its answer is read from the same events (`turns.turn_events`),
written as Ollama's objects: streamed as NDJSON lines (`stream` defaults to true, as Ollama's
does), or whole. The last object has `done: true`, `done_reason` ("stop", "length"), the token
counts (`prompt_eval_count`, `eval_count`) and the durations in nanoseconds.

Fields map as follows: `options` to the sampling fields (`num_predict` -> max_tokens, with -1 or
unset the chat route's default and -2 what the context leaves; `temperature`, `top_p`, `top_k`,
`min_p`, `seed`, `stop`, `repeat_penalty` -> repetition_penalty, `presence_penalty`,
`frequency_penalty`; `num_ctx` refuses a prompt longer than it, as this server never truncates
one); `format` ("json" or a JSON schema) to the grammar; `tools` to the template and the
tool-call parser (`function.arguments` are objects both ways); `think` to the template's thinking
switch, the reasoning coming back as `thinking`. `keep_alive` is checked and accepted: the one
model stays loaded whatever it says. `images` (base64, on a chat message or a generate body) go
before the message's text as image parts, through the admission path's image checks and limits
like every route's (a text-only model refuses them in the same words); a raw generate prompt takes
none (no template places them). A field or option not listed here is refused by name, and so are
`suffix`, `template` and `context`.

Errors are Ollama's `{"error": message}` with the HTTP status; one that ends a stream after it
began is its last line.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling_params import SamplingParams
from ..version import __version__
from .admission import Ask, admit
from .bodies import check_json, read_body
from .embeddings_api import embed
from .errors import APIError
from .guided_request import format_guided, tool_plan
from .jobs import ErrorResponse, JobStream
from .openai_api import DEFAULT_CHAT_MAX_TOKENS
from .prompts import thinking_kwargs
from .protocol import image_part
from .tools import ToolCall
from .turns import Thinking, TurnEnd, add_format, drain, turn_events, turn_parse

NEVER = "9999-12-31T23:59:59Z"  # /api/ps's expires_at: the one model is never unloaded
# Go's time.Duration text ("5m", "1h30m", "-1s") or a bare number of seconds ("-1", "0")
DURATION = re.compile(r"^-?(?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+$|^-?\d+(?:\.\d+)?$")
# OpenAI field names in admission's errors -> this API's
NAMES = {"max_tokens": "options.num_predict", "stop": "options.stop", "num_ctx": "options.num_ctx"}


class OllamaError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}

    @classmethod
    def of(cls, e: APIError) -> OllamaError:
        return cls(e.status, e.message, e.headers)


# -- request bodies -------------------------------------------------------------------------------
class Strict(BaseModel):
    """Strict types, and an unknown field is refused by name (Ollama's clients send only its fields)."""

    model_config = ConfigDict(strict=True, extra="forbid")


class Options(Strict):
    num_predict: int | None = Field(None, ge=-2)
    num_ctx: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)


class CallFunction(Strict):
    name: str
    arguments: dict[str, Any]
    index: int | None = None


class CallIn(Strict):
    function: CallFunction
    id: str | None = None  # Open WebUI sends OpenAI's id and index along
    index: int | None = None
    type: Literal["function"] | None = None


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[CallIn] | None = None
    tool_name: str | None = None  # a tool result: the tool that ran
    tool_call_id: str | None = None  # Open WebUI's: the call a tool result answers
    thinking: str | None = None  # an earlier turn's reasoning: not rendered (templates drop it too)


class ToolFunction(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(Strict):
    type: Literal["function"] = "function"
    function: ToolFunction


class _Turn(Strict):
    model: str = Field(min_length=1)
    stream: bool = True
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: int | float | str | None = None
    think: bool | Literal["high", "medium", "low"] | None = None


class ChatBody(_Turn):
    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None


class GenerateBody(_Turn):
    prompt: str | None = None
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None
    suffix: str | None = None  # fill-in-the-middle: refused unless empty
    template: str | None = None  # refused unless empty: the checkpoint's template is used
    context: list[int] | None = None  # refused unless empty


class EmbedBody(Strict):
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool | None = None
    options: Options | None = None
    keep_alive: int | float | str | None = None
    dimensions: int | None = Field(None, ge=1)


class EmbeddingsBody(Strict):
    model: str = Field(min_length=1)
    prompt: str
    options: Options | None = None
    keep_alive: int | float | str | None = None


class NameBody(Strict):
    model: str | None = None
    name: str | None = None  # the older clients' field
    verbose: bool = False

    def which(self) -> str:
        if not (self.model or self.name):
            raise OllamaError(400, "model: required")
        return self.model or self.name


def _unimplemented(err: dict, loc: str) -> str | None:
    if err["type"] == "extra_forbidden":
        what = "option" if err["loc"][0] == "options" else "field"
        return f"{loc}: this server does not implement the {what} '{err['loc'][-1]}'"
    return None


async def _body(request: Request, model):
    return await read_body(request, model, lambda msg: OllamaError(400, msg), _unimplemented, check_json)


def check_keep_alive(value) -> None:
    """Ollama's forms: seconds (a number, or its text) or a Go duration ("5m", "1h30m", "-1")."""
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return
    if not DURATION.match(value.strip()):
        raise OllamaError(400, f"keep_alive: '{value}' is not a duration (seconds, or e.g. '5m', '1h30m', '-1')")


# -- names, cards and the pieces of a turn --------------------------------------------------------
def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def card_for(catalog, model: str):
    """The card `model` names; Ollama's default tag (`name:latest`) names `name` too."""
    card = catalog.find(model) or (catalog.find(model[: -len(":latest")]) if model.endswith(":latest") else None)
    if card is None:
        names = ", ".join(f"'{c.id}'" for c in catalog.cards())
        raise OllamaError(404, f"model '{model}' not found: this server serves {names}")
    return card


def parameter_size(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.{1 if unit == 'B' else 2}f}{unit}"
    return str(n)


def details(card) -> dict:
    family = card.info.family or "unknown"
    return {
        "parent_model": "",
        "format": card.info.source,
        "family": family,
        "families": [family],
        "parameter_size": parameter_size(card.parameters),
        "quantization_level": card.quantization,
    }


def iso(dt: datetime) -> str:
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def call_object(call: ToolCall, index: int) -> dict:
    return {"function": {"index": index, "name": call.name, "arguments": call.input}}


def with_images(text: str, images: list[str] | None, where: str) -> str | list[dict]:
    """A message's content as the template reads it: `text`, or its images (base64, as Ollama's
    clients send them) then its text, as parts the admission path takes the images from."""
    if not images:
        return text
    parts = [image_part(f"data:image;base64,{b64}", f"{where}.{k}") for k, b64 in enumerate(images)]
    return parts + ([{"type": "text", "text": text}] if text else [])


def template_messages(messages: list[Message]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if m.images and m.role != "user":
            raise OllamaError(400, f"messages.{i}.images: images belong in a user message")
        msg: dict = {"role": m.role, "content": with_images(m.content, m.images, f"messages.{i}.images")}
        if m.tool_calls:
            if m.role != "assistant":
                raise OllamaError(400, f"messages.{i}.tool_calls: only an assistant message makes tool calls")
            msg["tool_calls"] = [
                {
                    "id": c.id or f"call_{i}_{k}",
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for k, c in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            if m.tool_name:
                msg["name"] = m.tool_name
        out.append(msg)
    return out


def sampling(options: Options | None, stops: list[str]):
    """(the `SamplingParams` maker, the max_tokens asked for or None, whether -2 asked for the
    whole context) of `options`; Ollama's unset knobs are this server's defaults."""
    o = options or Options()
    if o.num_predict == 0:
        raise OllamaError(400, "options.num_predict: 0 asks for no tokens; give a positive count, or -1")
    knobs = {
        "temperature": o.temperature,
        "top_p": o.top_p,
        "top_k": o.top_k,
        "min_p": o.min_p,
        "seed": o.seed,
        "repetition_penalty": o.repeat_penalty,
        "presence_penalty": o.presence_penalty,
        "frequency_penalty": o.frequency_penalty,
    }
    knobs = {k: v for k, v in knobs.items() if v is not None}
    asked = o.num_predict if o.num_predict and o.num_predict > 0 else None
    return (lambda guided: lambda n: SamplingParams(max_tokens=n, stop=stops or None, guided=guided, **knobs)), asked


def think_on(state, think, model: str) -> bool | None:
    if think is None:
        return None
    if think is not False and state.think is None:
        raise OllamaError(400, f"think: '{model}' does not support thinking")
    return think is not False


class Timing:
    """Ollama's durations (ns): the whole request, the prompt (until the first output) and the output."""

    def __init__(self):
        self.start = self.first = time.perf_counter_ns()
        self.seen = False

    def mark(self) -> None:
        if not self.seen:
            self.first, self.seen = time.perf_counter_ns(), True

    def done(self, end: TurnEnd) -> dict:
        t = time.perf_counter_ns()
        first = self.first if self.seen else t
        return {
            "total_duration": t - self.start,
            "load_duration": 0,  # the model is loaded when the server starts
            "prompt_eval_count": end.prompt_tokens,
            "prompt_eval_duration": first - self.start,
            "eval_count": end.completion_tokens,
            "eval_duration": t - first,
        }


def done_reason(end: TurnEnd) -> str:
    return "length" if end.finish_reason == "length" else "stop"  # Ollama says "stop" after tool calls too


def line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


class NdjsonStream(JobStream):
    """A job's NDJSON lines (Ollama's stream), with `JobStream`'s invariant: however it ends, the
    job's unfinished engine requests are aborted."""

    def __init__(self, job, lines):
        StreamingResponse.__init__(self, lines, media_type="application/x-ndjson")
        self.job = job


async def _pieces(state, job, parse, timing: Timing):
    """The turn's events, timing the first one."""
    async for e in turn_events(state, job, parse):
        if not isinstance(e, TurnEnd):
            timing.mark()
        yield e


async def _whole(state, job, parse, timing: Timing, request: Request):
    """(text, thinking, calls, end) of the finished turn: its events collected by `drain`, the one
    path every route's whole answer takes (a client gone while waiting aborts it)."""
    try:
        events = await drain(request, _pieces(state, job, parse, timing))
    except APIError as e:
        raise OllamaError.of(e) from None
    text = [e for e in events if isinstance(e, str)]
    thinking = [e.text for e in events if isinstance(e, Thinking)]
    calls = [e for e in events if isinstance(e, ToolCall)]
    end = next((e for e in events if isinstance(e, TurnEnd)), None)
    return "".join(text), "".join(thinking), calls, end


async def _stream(state, job, parse, timing: Timing, head: dict, field: str):
    """NDJSON lines: one per piece of the answer (`message` for chat, `response` for generate),
    then the `done` line; a failure after the first line is the last line, an error object."""
    calls = 0

    def piece(text: str = "", thinking: str | None = None, tool_calls: list | None = None) -> dict:
        if field == "message":
            msg = {"role": "assistant", "content": text}
            if thinking:
                msg["thinking"] = thinking
            if tool_calls:
                msg["tool_calls"] = tool_calls
            return {**head(), "message": msg, "done": False}
        return {**head(), "response": text, **({"thinking": thinking} if thinking else {}), "done": False}

    try:
        async for e in _pieces(state, job, parse, timing):
            if isinstance(e, str):
                yield line(piece(e))
            elif isinstance(e, Thinking):
                yield line(piece(thinking=e.text))
            elif isinstance(e, ToolCall):
                yield line(piece(tool_calls=[call_object(e, calls)]))
                calls += 1
            elif isinstance(e, TurnEnd):
                last = piece()
                last.update(done=True, done_reason=done_reason(e), **timing.done(e))
                yield line(last)
    except APIError as err:
        yield line({"error": err.message})


# -- routes ---------------------------------------------------------------------------------------
def register_ollama(app: FastAPI, state, catalog) -> None:
    """The routes and their error handler (Ollama's error object)."""

    @app.exception_handler(OllamaError)
    async def _ollama_error(request, exc: OllamaError):
        return ErrorResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)

    @app.get("/api/version")
    async def version():
        return {"version": __version__}

    @app.get("/api/tags")
    async def tags():
        return {
            "models": [
                {
                    "name": c.id,
                    "model": c.id,
                    "modified_at": iso(c.modified),
                    "size": c.info.size_bytes,
                    "digest": c.digest,
                    "details": details(c),
                }
                for c in catalog.cards()
            ]
        }

    @app.get("/api/ps")
    async def ps():
        import mlx.core as mx

        on_gpu = mx.default_device() == mx.gpu
        return {
            "models": [
                {
                    "name": c.id,
                    "model": c.id,
                    "size": c.memory_bytes,
                    "digest": c.digest,
                    "details": details(c),
                    "expires_at": NEVER,
                    "size_vram": c.memory_bytes if on_gpu else 0,  # Apple silicon: the GPU's memory is the RAM
                    "context_length": c.context,
                }
                for c in catalog.cards()
            ]
        }

    @app.post("/api/show")
    async def show(request: Request):
        body = await _body(request, NameBody)
        c = card_for(catalog, body.which())
        family = c.info.family or "unknown"
        capabilities = ["completion"] + (["tools"] if state.tool_format else []) + (["thinking"] if state.think else [])
        if state.engine_loop.engine.loaded.processor is not None:  # a vision model: it takes `images`
            capabilities.append("vision")
        if state.pooling is not None and state.pooling.embedding_only:  # it generates nothing (embeddings_api.py)
            capabilities = ["embedding"]
        return {
            "modelfile": "",
            "parameters": "",
            "template": c.chat_template or "",
            "details": details(c),
            "model_info": {
                "general.architecture": family,
                "general.parameter_count": c.parameters,
                f"{family}.context_length": c.context,
            },
            "capabilities": capabilities,
            "modified_at": iso(c.modified),
        }

    async def embedded(request, body, inputs: list, dimensions: int | None, names: dict):
        """(embeddings, prompt tokens, nanoseconds) of `inputs` (embeddings_api.py)."""
        check_keep_alive(body.keep_alive)
        set_options = [k for k, v in (body.options.model_dump() if body.options else {}).items() if v is not None]
        if set_options:
            raise OllamaError(400, f"options.{set_options[0]}: embeddings take no options")
        card = card_for(catalog, body.model)
        t0 = time.perf_counter_ns()
        try:
            values, tokens = await embed(request, state, card.id, inputs, dimensions, names)
        except APIError as e:
            raise OllamaError.of(e) from None
        return values, tokens, time.perf_counter_ns() - t0

    @app.post("/api/embed")
    async def embed_route(request: Request):
        body = await _body(request, EmbedBody)
        if body.truncate:
            raise OllamaError(
                400, "truncate: this server never truncates an input (a longer one is refused); send false"
            )
        inputs = [body.input] if isinstance(body.input, str) else body.input
        values, tokens, ns = await embedded(
            request, body, inputs, body.dimensions, {"prompt": "input", "prompts": "inputs"}
        )
        return {
            "model": body.model,
            "embeddings": values,
            "total_duration": ns,
            "load_duration": 0,
            "prompt_eval_count": tokens,
        }

    @app.post("/api/embeddings")
    async def embeddings_route(request: Request):  # the older route: one prompt
        body = await _body(request, EmbeddingsBody)
        values, _, _ = await embedded(request, body, [body.prompt], None, {})
        return {"embedding": values[0]}

    def loading(body, model: str) -> dict:
        """Ollama's answer to a body with nothing to say: it (un)loads the model; here it stays loaded."""
        reason = "unload" if body.keep_alive in (0, "0", "0s", "0m") else "load"
        return {"model": model, "created_at": now(), "done": True, "done_reason": reason}

    async def run(request, body, ask: Ask, parse, field: str):
        timing = Timing()
        try:
            job, _ = await admit(state, ask)
        except APIError as e:
            raise OllamaError.of(e) from None

        def head() -> dict:
            return {"model": body.model, "created_at": now()}

        if body.stream:
            return NdjsonStream(job, _stream(state, job, parse, timing, head, field))
        text, thinking, calls, end = await _whole(state, job, parse, timing, request)
        out = head()
        if field == "message":
            msg = {"role": "assistant", "content": text}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = [call_object(c, k) for k, c in enumerate(calls)]
            out["message"] = msg
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        return {**out, "done": True, "done_reason": done_reason(end), **timing.done(end)}

    def common(body):
        """(card, stops, params maker, max_tokens, template kwargs) shared by chat and generate."""
        check_keep_alive(body.keep_alive)
        card = card_for(catalog, body.model)
        stops = list(body.options.stop or []) if body.options else []
        make, asked = sampling(body.options, stops)
        default = (card.context or DEFAULT_CHAT_MAX_TOKENS) if body.options and body.options.num_predict == -2 else None
        return card, stops, make, asked, default, thinking_kwargs(state, think_on(state, body.think, body.model))

    def format_of(body):
        if body.format in (None, ""):
            return None
        try:
            if body.format == "json":
                return format_guided("json_object", None, "format")
            return format_guided("json_schema", body.format, "format")
        except APIError as e:
            raise OllamaError.of(e) from None

    @app.post("/api/chat")
    async def chat(request: Request):
        body = await _body(request, ChatBody)
        card, stops, make, asked, default, template_kwargs = common(body)
        if not body.messages:
            return {**loading(body, body.model), "message": {"role": "assistant", "content": ""}}
        messages = template_messages(body.messages)
        functions = [
            {"name": t.function.name, "description": t.function.description, "parameters": t.function.parameters}
            for t in body.tools or []
        ]
        try:
            plan = tool_plan(functions, "auto" if functions else "none", markers=state.markers)
            add_format(plan, format_of(body), "format", "tools")
            parse = turn_parse(state, plan)
        except APIError as e:
            raise OllamaError.of(e) from None
        ask = Ask(
            "ollama",
            card.id,
            make(plan.guided),
            default or DEFAULT_CHAT_MAX_TOKENS,
            messages=messages,
            tools=plan.tools,
            stops=stops,
            max_tokens=asked,
            guided_param=plan.param,
            names=NAMES,
            template_kwargs=template_kwargs,
            num_ctx=body.options.num_ctx if body.options else None,
        )
        return await run(request, body, ask, parse, "message")

    @app.post("/api/generate")
    async def generate(request: Request):
        body = await _body(request, GenerateBody)
        for name in ("suffix", "template"):
            if getattr(body, name):
                raise OllamaError(400, f"{name}: this server does not implement '{name}'; leave it out")
        if body.context:
            raise OllamaError(400, "context: this server does not implement 'context'; send the turns to /api/chat")
        card, stops, make, asked, default, template_kwargs = common(body)
        if not body.prompt:
            return {**loading(body, body.model), "response": ""}
        guided = format_of(body)
        num_ctx = body.options.num_ctx if body.options else None
        kw: dict = dict(
            stops=stops, max_tokens=asked, guided_param="format" if guided else None, names=NAMES, num_ctx=num_ctx
        )
        if body.raw:  # the prompt as it is, no template
            if body.images:
                raise OllamaError(400, "images: a raw prompt takes no images (no template places them); leave raw out")
            if body.system:
                raise OllamaError(400, "system: a raw prompt takes no system prompt (no template is applied)")
            if template_kwargs:
                raise OllamaError(400, "think: a raw prompt has no template to switch thinking in")
            ask = Ask("ollama", card.id, make(guided), default or DEFAULT_CHAT_MAX_TOKENS, prompts=[body.prompt], **kw)
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
                {"role": "user", "content": with_images(body.prompt, body.images, "images")}
            ]
            ask = Ask(
                "ollama",
                card.id,
                make(guided),
                default or DEFAULT_CHAT_MAX_TOKENS,
                messages=messages,
                template_kwargs=template_kwargs,
                **kw,
            )
        return await run(request, body, ask, None, "response")
