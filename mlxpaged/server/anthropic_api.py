"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A body becomes chat messages for the checkpoint's template: `system` (a string or text blocks)
is the system turn (less Claude Code's `x-anthropic-billing-header:` block, which is not for the
model and, changing per request, would defeat the prefix cache); `tool_use` blocks become the
assistant's `tool_calls`; `tool_result` blocks become `role: "tool"` messages; a `role: "system"`
message inside `messages` (Claude Code sends them) is a system turn where it stands. `tool_choice`
maps to the chat route's: auto -> auto, any -> required, tool -> a named function, none -> none
(all in `guided_request.tool_plan`). A non-streamed message is the stream's events added up
(`message_of`), as the SDK's `get_final_message()` adds them.

`thinking` (adaptive, enabled with its budget, disabled) and `output_config.effort` are accepted.
A model without reasoning answers without thinking; a reasoning model's template gets
`enable_thinking` (false for disabled, true for enabled, its default for adaptive) where the
template reads it. A budget is not enforced apart from `max_tokens`, which bounds both.

`cache_salt` (top-level, as on the OpenAI routes, or `metadata.cache_salt`, where Anthropic
clients can set it) keeps the request's cached blocks to requests of the same salt. `usage` counts
as Anthropic does: `cache_read_input_tokens` the prompt tokens taken from the prefix cache,
`input_tokens` the rest (computed); a stream's `message_start` counts the whole prompt as input,
its `message_delta` carries the final counts. Top-level fields the body does not declare are
refused by name, but for `context_management` and `service_tier` (Claude Code sends the first),
which change nothing here.

Errors on these routes are Anthropic's object, `{"type": "error", "error": {"type", "message"}}`,
and `x-api-key` authenticates as `Authorization: Bearer` does.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, FastAPI, Request
from pydantic import Field, model_validator

from ..engine.sampling_params import SamplingParams
from .admission import Ask, admit
from .admission import count_tokens as admission_count
from .bodies import Body, CheckedBody, read_body
from .errors import APIError
from .guided_request import format_guided, tool_plan
from .jobs import ErrorResponse, JobStream
from .keepalive import PING, keepalive
from .middleware import anthropic_error_body
from .prompts import thinking_kwargs
from .protocol import image_part, refuse_parts
from .turns import Thinking, TurnEnd, add_format, drain, sse, turn_events, turn_parse


class AnthropicError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}

    @classmethod
    def of(cls, e: APIError) -> AnthropicError:
        return cls(e.status, e.message, e.headers)

    def body(self) -> dict:
        return anthropic_error_body(self.status, self.message)


# -- request bodies -------------------------------------------------------------------------------
class TextBlock(Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class Base64Source(Body):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(Body):
    type: Literal["url"]
    url: str  # a data URL, or an http(s) one fetched with --fetch-image-urls (admission.py)


class ImageBlock(Body):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]
    cache_control: dict | None = None  # accepted: every prompt prefix is cached

    def part(self, where: str) -> dict:
        src = self.source
        url = f"data:{src.media_type};base64,{src.data}" if isinstance(src, Base64Source) else src.url
        return image_part(url, where)


ResultBlock = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        body = (
            self.content
            if isinstance(self.content, str) or self.content is None
            else "".join(b.text for b in self.content if isinstance(b, TextBlock))
        )
        return f"Error: {body or ''}" if self.is_error else (body or "")

    def template_content(self, where: str) -> str | list[dict]:
        """The result as a chat template reads it: the text, or with images (Claude Code's
        screenshots) its blocks in order."""
        if not isinstance(self.content, list) or not any(isinstance(b, ImageBlock) for b in self.content):
            return self.text()
        head = [{"type": "text", "text": "Error: "}] if self.is_error else []
        return head + [
            {"type": "text", "text": b.text} if isinstance(b, TextBlock) else b.part(f"{where}.{i}")
            for i, b in enumerate(self.content)
        ]


class ThinkingBlock(Body):
    """A thinking model's earlier reasoning, sent back by the client: not rendered (templates drop
    past reasoning too)."""

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(Body):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    @model_validator(mode="before")
    @classmethod
    def _blocks(cls, data):
        if isinstance(data, dict):
            known = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")
            refuse_parts(data.get("content"), known, "content block")
            for b in data.get("content") if isinstance(data.get("content"), list) else ():
                if isinstance(b, dict) and b.get("type") == "tool_result":
                    refuse_parts(b.get("content"), ("text", "image"), "tool_result block")
        return data


class ThinkingConfig(Body):
    type: Literal["adaptive", "enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)  # bounded by max_tokens only (see the module's docstring)


class Tool(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class JsonFormat(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    format: JsonFormat | None = None
    effort: Literal["low", "medium", "high", "max"] | None = None  # accepted: thinking follows `thinking`


class Metadata(Body):
    user_id: str | None = None  # accepted and ignored
    cache_salt: str | None = None  # mlxpaged's: as the top-level field, where Anthropic clients can set it


class CountTokensRequest(CheckedBody):
    IGNORED = frozenset({"context_management", "service_tier"})  # change nothing here

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None  # structured output: format json_schema
    cache_salt: str | None = None  # prefix-cache isolation (a count shares nothing: accepted)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    speculative: bool = True  # mlxpaged's extension: false opts this request out of speculative decoding

    def salt(self) -> str | None:
        """The request's cache salt, from the body or its metadata (a 400 when they differ)."""
        inner = self.metadata.cache_salt if self.metadata else None
        if inner is not None and self.cache_salt is not None and inner != self.cache_salt:
            raise AnthropicError(400, "cache_salt: the body's and metadata.cache_salt differ; send one")
        return self.cache_salt if self.cache_salt is not None else inner


def _unimplemented(err: dict, loc: str) -> str | None:
    if err["type"] == "unimplemented":  # a top-level field the body does not declare (bodies.py)
        field = err["ctx"]["field"]
        return f"{field}: this server does not implement '{field}'; leave it out"
    return None


async def _body(request: Request, model):
    return await read_body(request, model, lambda msg: AnthropicError(400, msg), _unimplemented)


# -- body -> template messages and tool plan --------------------------------------------------------
BILLING = "x-anthropic-billing-header:"  # Claude Code's first system block: billing, not for the model


def template_messages(body: CountTokensRequest) -> list[dict]:
    out = []
    system = body.system
    if isinstance(system, list):
        # Claude Code's billing line changes with each request in some versions (`cch=...`): left in,
        # it would make every turn's prompt differ from its first tokens, so nothing is ever taken
        # from the prefix cache (vLLM, SGLang and Ollama drop it too).
        system = "\n".join(b.text for b in system if not b.text.startswith(BILLING))
    if system:
        out.append({"role": "system", "content": system})
    for j, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts = [b.text for b in m.content if isinstance(b, TextBlock)]
        where = f"messages.{j}.content"
        if m.role != "user" and any(isinstance(b, ImageBlock) for b in m.content):
            raise AnthropicError(400, f"{where}: image blocks belong in a user message or a tool_result")
        if m.role == "system":
            if len(texts) != len(m.content):
                raise AnthropicError(400, "messages: a system message takes text blocks only")
            out.append({"role": "system", "content": "\n".join(texts)})
            continue
        if m.role == "assistant":
            if any(isinstance(b, ToolResultBlock) for b in m.content):
                raise AnthropicError(400, "messages: tool_result blocks belong in a user message")
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                for b in m.content
                if isinstance(b, ToolUseBlock)
            ]
            msg = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        if any(isinstance(b, ToolUseBlock) for b in m.content):
            raise AnthropicError(400, "messages: tool_use blocks belong in an assistant message")
        # The template wants tool results right after the call, then the user's words.
        out += [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.template_content(f"{where}.{i}.content")}
            for i, b in enumerate(m.content)
            if isinstance(b, ToolResultBlock)
        ]
        said = [(i, b) for i, b in enumerate(m.content) if isinstance(b, (TextBlock, ImageBlock))]
        if any(isinstance(b, ImageBlock) for _, b in said):  # the user's words and images, in order
            parts = [
                {"type": "text", "text": b.text} if isinstance(b, TextBlock) else b.part(f"{where}.{i}")
                for i, b in said
            ]
            out.append({"role": "user", "content": parts})
        elif texts or not any(isinstance(b, ToolResultBlock) for b in m.content):
            out.append({"role": "user", "content": "".join(texts)})
    return out


def thinking_on(body: CountTokensRequest) -> bool | None:
    """Thinking on (True), off (False) or as the template's default (None)."""
    kind = body.thinking.type if body.thinking else "adaptive"
    return {"enabled": True, "disabled": False}.get(kind)


def plan_of(body: CountTokensRequest, markers=None):
    functions = [{"name": t.name, "description": t.description, "parameters": t.input_schema} for t in body.tools or []]
    tc = body.tool_choice
    kind = tc.type if tc else ("auto" if functions else "none")
    if kind == "tool" and not tc.name:
        raise AnthropicError(400, "tool_choice.name: required when tool_choice.type is 'tool'")
    choice = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[kind]
    parallel = not (tc and tc.disable_parallel_tool_use)
    try:
        return tool_plan(functions, choice, tc.name if tc else None, parallel=parallel, markers=markers)
    except APIError as e:
        raise AnthropicError.of(e) from None


# -- responses ------------------------------------------------------------------------------------
def stop_reason(end: TurnEnd) -> str:
    return {"tool_calls": "tool_use", "length": "max_tokens"}.get(
        end.finish_reason, "stop_sequence" if end.stop_sequence is not None else "end_turn"
    )


def usage(end: TurnEnd) -> dict:
    """Anthropic's usage: the prompt's tokens taken from the prefix cache are `cache_read_input_tokens`,
    `input_tokens` only those computed (cache writes are not billed here: none are counted)."""
    return {
        "input_tokens": end.prompt_tokens - end.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": end.cached_tokens,
        "output_tokens": end.completion_tokens,
    }


def tool_use_block(call) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name, "input": call.input}


def thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}  # no signature: nothing is verified here


def register_anthropic(app: FastAPI, state) -> None:
    """The routes and their error handler; the OpenAI routes keep OpenAI's error object."""

    @app.exception_handler(AnthropicError)
    async def _anthropic_error(request, exc: AnthropicError):
        return ErrorResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    # The API key is checked by the Guard middleware before the body is read (in Anthropic's error shape here).
    router = APIRouter(prefix="/v1")

    def ask(body, max_tokens: int = 1):
        """The body as an `Ask` (admission.py); `plan.guided` set from `output_config` too."""
        plan = plan_of(body, state.markers)
        oc = getattr(body, "output_config", None)
        if oc is not None and oc.format is not None:
            try:
                guided = format_guided("json_schema", oc.format.schema_, "output_config.format")
                add_format(plan, guided, "output_config.format", "tool_choice any or tool")
            except APIError as e:
                raise AnthropicError.of(e) from None
        stops = list(getattr(body, "stop_sequences", None) or [])

        knobs = {}  # count_tokens has no sampling fields
        if isinstance(body, MessagesRequest):
            top_p = body.top_p if body.top_p is not None else 1.0
            knobs = dict(temperature=body.temperature, top_p=top_p, top_k=body.top_k or 0, stop=stops)
            knobs.update(speculative=body.speculative, guided=plan.guided, cache_salt=body.salt())
        a = Ask(
            "msg",
            body.model,
            lambda n: SamplingParams(max_tokens=n, **knobs),
            max_tokens,
            messages=template_messages(body),
            tools=plan.tools,
            stops=stops,
            max_tokens=max_tokens,
            guided_param=plan.param,
            names={"stop": "stop_sequences"},
            template_kwargs=thinking_kwargs(state, thinking_on(body)),
        )
        return a, plan

    @router.post("/messages/count_tokens")
    async def count_tokens(request: Request):
        a, _ = ask(await _body(request, CountTokensRequest))
        try:
            return {"input_tokens": await admission_count(state, a)}
        except APIError as e:
            raise AnthropicError.of(e) from None

    @router.post("/messages")
    async def messages(request: Request):
        body = await _body(request, MessagesRequest)
        a, plan = ask(body, body.max_tokens)
        try:
            parse = turn_parse(state, plan)
            job, prompts = await admit(state, a)
        except APIError as e:
            raise AnthropicError.of(e) from None
        ids = prompts[0]
        msg_id = "msg_" + job.resp_id.split("-", 1)[1][:24]
        head = {"id": msg_id, "type": "message", "role": "assistant", "model": state.model_id}
        if body.stream:
            return JobStream(job, keepalive(_stream(state, job, parse, head, len(ids)), PING))
        try:
            return message_of(await drain(request, _events(state, job, parse, head, len(ids))))
        except APIError as e:
            raise AnthropicError.of(e) from None

    app.include_router(router)


def message_of(events: list) -> dict:
    """The message the stream's events add up to, as the SDK's `get_final_message()` adds them:
    the non-streamed answer."""
    msg: dict = {}
    inputs: dict[int, str] = {}  # a tool_use block's input_json_delta text
    for name, data in events:
        if name == "message_start":
            msg = {**data["message"], "content": []}
        elif name == "content_block_start":
            msg["content"].append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = msg["content"][data["index"]], data["delta"]
            if delta["type"] == "input_json_delta":
                inputs[data["index"]] = inputs.get(data["index"], "") + delta["partial_json"]
            else:
                key = {"text_delta": "text", "thinking_delta": "thinking"}[delta["type"]]
                block[key] += delta[key]
        elif name == "content_block_stop" and data["index"] in inputs:
            msg["content"][data["index"]]["input"] = json.loads(inputs[data["index"]])
        elif name == "message_delta":
            msg.update(data["delta"])
            msg["usage"] = data["usage"]
    return msg


async def _stream(state, job, parse, head: dict, n_prompt: int):
    """`_events` as server-sent events; a failure mid-stream is an `error` event."""
    try:
        async for name, data in _events(state, job, parse, head, n_prompt):
            yield sse(name, data)
    except APIError as err:
        yield sse("error", AnthropicError.of(err).body())


async def _events(state, job, parse, head: dict, n_prompt: int):
    """Anthropic's event sequence, as (name, data): message_start, then per block
    content_block_start, deltas and content_block_stop, then message_delta (stop_reason, usage)
    and message_stop. A failed step raises APIError."""
    index = -1
    text_open = think_open = answered = False  # answered: a text or tool_use block was opened
    yield (
        "message_start",
        {
            "type": "message_start",
            "message": {
                **head,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": n_prompt, "output_tokens": 0},
            },
        },
    )
    async for e in turn_events(state, job, parse):
        if isinstance(e, Thinking):  # the model's reasoning: a thinking block before the answer
            if text_open:
                yield ("content_block_stop", {"type": "content_block_stop", "index": index})
                text_open = False
            if not think_open:
                index, think_open = index + 1, True
                block = {"type": "content_block_start", "index": index, "content_block": thinking_block("")}
                yield ("content_block_start", block)
            delta = {"type": "thinking_delta", "thinking": e.text}
            yield ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
            continue
        if think_open:
            yield ("content_block_stop", {"type": "content_block_stop", "index": index})
            think_open = False
        if isinstance(e, str):
            if not text_open:
                index, text_open, answered = index + 1, True, True
                yield (
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
                )
            yield (
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": e}},
            )
        elif isinstance(e, TurnEnd):
            if not answered:  # an empty answer still has one (empty) text block, as the whole message does
                index, text_open = index + 1, True
                yield (
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
                )
            if text_open:
                yield ("content_block_stop", {"type": "content_block_stop", "index": index})
            yield (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason(e), "stop_sequence": e.stop_sequence},
                    "usage": usage(e),
                },
            )
            yield ("message_stop", {"type": "message_stop"})
        else:  # a complete tool call: one tool_use block, its input as one input_json_delta
            if text_open:
                yield ("content_block_stop", {"type": "content_block_stop", "index": index})
                text_open = False
            index, answered = index + 1, True
            block = tool_use_block(e)
            yield (
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
            )
            yield (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": e.arguments},
                },
            )
            yield ("content_block_stop", {"type": "content_block_stop", "index": index})
