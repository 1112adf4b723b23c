"""OpenAI's Responses API: `POST /v1/responses`.

`input` (a string, or items: messages, `function_call`, `function_call_output`) becomes chat
messages for the checkpoint's template, `instructions` its system turn. Output items are a
`message` with `output_text` and one `function_call` item per call. Errors are OpenAI's error
object, as on the chat routes.

Stateless by default. With `--responses-store N` the server keeps the last N responses (their
conversation: input and output, not the instructions, as OpenAI does) in an LRU, and
`previous_response_id` continues one; otherwise `previous_response_id` is a 400 naming the limit.
The LRU is bounded by the memory of its text too (`--responses-store-bytes`): a conversation is
its whole history, and a run of spaces is one token of many characters.

`cache_salt` (as on chat and completions) keeps the request's cached blocks to requests of the
same salt.

Codex's requests as it sends them: a `namespace` tool is its functions, offered as such; a hosted
tool (`web_search`, `file_search`, ...) runs on OpenAI's side, so it is accepted, never offered to
the model, and logged once; `reasoning.effort` switches a reasoning model's thinking as
anthropic_api.py does (`none`/`minimal`: off), and `reasoning.summary` is accepted (the
reasoning item carries the reasoning itself). `include`, `prompt_cache_key`, `client_metadata`,
`service_tier`, `safety_identifier` and `stream_options` change nothing here and are ignored;
any other top-level field the body does not declare is refused by name.
"""

from __future__ import annotations

import copy
import logging
import sys
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from ..engine.sampling_params import SamplingParams
from .admission import Ask, admit
from .bodies import Body, CheckedBody
from .errors import APIError
from .guided_request import format_guided, tool_plan
from .jobs import JobStream
from .keepalive import keepalive
from .limits import Limits
from .prompts import thinking_kwargs
from .protocol import image_part, refuse_parts
from .tools import template_tool_calls
from .turns import Thinking, TurnEnd, add_format, drain, sse, turn_events, turn_parse

log = logging.getLogger("mlxpaged.server")
# When a body gives no max_output_tokens (Codex never does), the answer may run to what the
# context leaves, as vLLM's does: a coding agent's answer does not fit the chat route's 1,024.
# A model with no known context gets the chat route's default.
FALLBACK_MAX_TOKENS = 1024


class ContentPart(Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputImagePart(Body):
    type: Literal["input_image"]
    image_url: str  # a data URL, or http(s) with --fetch-image-urls (admission.py)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the processor sizes every image


Part = Annotated[ContentPart | InputImagePart, Field(discriminator="type")]


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]

    @model_validator(mode="before")
    @classmethod
    def _parts(cls, data):
        if isinstance(data, dict):
            refuse_parts(data.get("content"), ("input_text", "output_text", "text", "input_image"))
        return data

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, ContentPart))

    def template_content(self, where: str) -> str | list[dict]:
        """The content as a chat template reads it: the text, or with images its parts in order."""
        if isinstance(self.content, str) or all(isinstance(p, ContentPart) for p in self.content):
            return self.text()
        return [
            {"type": "text", "text": p.text} if isinstance(p, ContentPart) else image_part(p.image_url, f"{where}.{i}")
            for i, p in enumerate(self.content)
        ]


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningInputItem(Body):
    """An earlier turn's reasoning sent back (Codex with `store: false`): not rendered."""

    type: Literal["reasoning"]


def _item_type(v) -> str:
    return (v.get("type") if isinstance(v, dict) else getattr(v, "type", None)) or "message"


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(Body):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(Body):
    """A group of functions under one name (Codex's `multi_agent_v1`): offered as its functions."""

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[FunctionTool]


# Tools OpenAI runs on its side: this server cannot, so the model is never offered them.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use_preview",
        "computer_use",
        "mcp",
        "local_shell",
    }
)


class HostedTool(Body):
    type: str

    @field_validator("type")
    @classmethod
    def _hosted(cls, v: str) -> str:
        if v not in HOSTED_TOOLS:
            raise ValueError(f"tool type '{v[:64]}' is not supported (function, namespace or a hosted tool)")
        return v


def _tool_type(v) -> str:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return t if t in ("function", "namespace") else "hosted"


AnyTool = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[HostedTool, Tag("hosted")],
    Discriminator(_tool_type),
]


class Reasoning(Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # its older name


class FunctionChoice(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(Body):
    format: TextFormat | None = None


class ResponsesRequest(CheckedBody):
    IGNORED = frozenset(
        {"include", "prompt_cache_key", "client_metadata", "service_tier", "safety_identifier", "stream_options"}
    )

    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    tools: list[AnyTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    text: TextConfig | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None  # accepted and ignored
    speculative: bool = True  # mlxpaged's extension: false opts this request out of speculative decoding
    cache_salt: str | None = None  # vLLM's: prefix-cache isolation (blocks shared only within one salt)
    reasoning: Reasoning | None = None
    # Fields this server does not implement: refused by name when set (see `refuse_unsupported`).
    background: bool | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    conversation: Any = None
    prompt: Any = None
    truncation: str | None = None  # "disabled" (OpenAI's default) only


def refuse_unsupported(body: ResponsesRequest) -> None:
    if body.truncation not in (None, "disabled"):
        raise APIError(400, f"truncation: only 'disabled' is supported, got {body.truncation!r}", param="truncation")
    for name in ("background", "max_tool_calls", "top_logprobs", "conversation", "prompt"):
        if getattr(body, name) not in (None, False):
            raise APIError(400, f"{name}: not supported by this server", param=name)


def text_bytes(value) -> int:
    """The memory of the strings in `value` (messages: dicts, lists and strings), as Python holds them."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += sys.getsizeof(v)
        elif isinstance(v, dict):
            stack += v.values()
        elif isinstance(v, (list, tuple)):
            stack += v
    return total


class ResponseStore:
    """The conversations of the last `capacity` responses, by id (least recently used out first),
    whose text takes at most `max_bytes` together (`text_bytes`; one larger is not kept).

    Invariant: a stored conversation never changes. `put` takes its own copy, `get` hands out a
    tuple, and `conversation` builds each request's messages without writing into it."""

    def __init__(self, capacity: int, max_bytes: int = Limits.responses_store_bytes):
        self.capacity, self.max_bytes = capacity, max_bytes
        self._items: OrderedDict[str, tuple[dict, ...]] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self.bytes = 0  # of the stored conversations, together

    def get(self, resp_id: str) -> tuple[dict, ...]:
        if self.capacity <= 0:
            raise APIError(
                400,
                "previous_response_id: this server keeps no responses (start it with "
                "--responses-store N to keep the last N)",
                param="previous_response_id",
            )
        if resp_id not in self._items:
            raise APIError(
                400,
                f"previous_response_id: response '{resp_id[:64]}{'...' if len(resp_id) > 64 else ''}' is not stored "
                f"(this server keeps the last {self.capacity} responses, --responses-store {self.capacity}, "
                f"and {self.max_bytes} bytes of their text, --responses-store-bytes)",
                param="previous_response_id",
            )
        self._items.move_to_end(resp_id)
        return self._items[resp_id]

    def put(self, resp_id: str, messages: list[dict]) -> None:
        if self.capacity <= 0:
            return
        size = text_bytes(messages)
        if size > self.max_bytes:
            log.info(
                "responses: %s not stored: its conversation's text takes %d bytes (--responses-store-bytes %d)",
                resp_id,
                size,
                self.max_bytes,
            )
            return
        self._items[resp_id], self._sizes[resp_id] = copy.deepcopy(tuple(messages)), size
        self.bytes += size
        while len(self._items) > self.capacity or self.bytes > self.max_bytes:
            old, _ = self._items.popitem(last=False)
            self.bytes -= self._sizes.pop(old)


def conversation(body: ResponsesRequest, history) -> list[dict]:
    """The template messages of `history` plus this body's input (instructions not included).
    `history`'s messages are read, never written: a call joining the last assistant turn makes a new turn."""
    out = list(history)
    if isinstance(body.input, str):
        return out + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": item.template_content(f"input.{i}.content")})
        elif isinstance(item, FunctionCallItem):
            try:
                call = template_tool_calls(
                    [{"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}]
                )[0]
            except ValueError as e:
                raise APIError(400, f"input.{i}: {e}", param="input") from None
            if out and out[-1]["role"] == "assistant":  # parallel calls, or calls after its text: one turn
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", ()), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def offered_functions(tools) -> list[dict]:
    """The functions the model is offered: function tools, and each namespace's functions, in order.
    Hosted tools are left out, with one log line naming them."""
    functions, hosted = [], []
    for t in tools or ():
        if isinstance(t, HostedTool):
            hosted.append(t.type)
            continue
        for f in t.tools if isinstance(t, NamespaceTool) else [t]:
            functions.append({"name": f.name, "description": f.description, "parameters": f.parameters})
    if hosted:
        log.info("responses: hosted tools not offered to the model (this server cannot run them): %s", hosted)
    return functions


def thinking_of_effort(reasoning: Reasoning | None) -> bool | None:
    """`none`/`minimal` effort: thinking off; any other: on; no effort: the template's default."""
    if reasoning is None or reasoning.effort is None:
        return None
    return reasoning.effort not in ("none", "minimal")


def _usage(end: TurnEnd) -> dict:
    return {
        "input_tokens": end.prompt_tokens,
        "input_tokens_details": {"cached_tokens": end.cached_tokens},
        "output_tokens": end.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": end.reasoning_tokens},
        "total_tokens": end.prompt_tokens + end.completion_tokens,
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else [],
    }


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": content}


def _call_item(call, status: str = "completed") -> dict:
    return {
        "id": "fc_" + call.id.removeprefix("call_"),
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
    }


def register_responses(router: APIRouter, state, text_of=None) -> None:
    """`POST /v1/responses` on the OpenAI router (its auth and error object)."""
    store = ResponseStore(state.responses_store, state.limits.responses_store_bytes)

    @router.post("/responses")
    async def responses(body: ResponsesRequest, request: Request):
        refuse_unsupported(body)
        history = store.get(body.previous_response_id) if body.previous_response_id else []
        convo = conversation(body, history)
        messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + convo
        functions = offered_functions(body.tools)
        tc = body.tool_choice
        choice = ("named" if isinstance(tc, FunctionChoice) else tc) or ("auto" if functions else "none")
        plan = tool_plan(
            functions,
            choice,
            tc.name if isinstance(tc, FunctionChoice) else None,
            parallel=body.parallel_tool_calls,
            markers=state.markers,
        )
        fmt = body.text.format if body.text else None
        if fmt is not None and fmt.type != "text":
            add_format(plan, format_guided(fmt.type, fmt.schema_, "text.format"), "text", f"tool_choice '{choice}'")

        knobs = dict(temperature=body.temperature, top_p=body.top_p, speculative=body.speculative, guided=plan.guided)
        knobs["cache_salt"] = body.cache_salt
        ask = Ask(
            "resp",
            body.model,
            lambda n: SamplingParams(max_tokens=n, **knobs),
            state.context or FALLBACK_MAX_TOKENS,  # lowered to what the context and the pool leave
            messages=messages,
            tools=plan.tools,
            max_tokens=body.max_output_tokens,
            guided_param=plan.param,
            names={"max_tokens": "max_output_tokens", "messages": "input"},
            template_kwargs=thinking_kwargs(state, thinking_of_effort(body.reasoning)),
        )
        parse = turn_parse(state, plan)
        job, _ = await admit(state, ask)
        resp_id = "resp_" + job.resp_id.split("-", 1)[1]
        created = int(time.time())

        def envelope(status: str, output: list, end: TurnEnd | None) -> dict:
            return {
                "id": resp_id,
                "object": "response",
                "created_at": created,
                "status": status,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens,
                "model": state.model_id,
                "output": output,
                "parallel_tool_calls": body.parallel_tool_calls,
                "previous_response_id": body.previous_response_id,
                "reasoning": {
                    "effort": body.reasoning.effort if body.reasoning else None,
                    "summary": (body.reasoning.summary or body.reasoning.generate_summary) if body.reasoning else None,
                },
                "store": body.store and store.capacity > 0,
                "temperature": body.temperature,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "tool_choice": tc.model_dump() if isinstance(tc, FunctionChoice) else (tc or "auto"),
                "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
                "top_p": body.top_p,
                "truncation": "disabled",
                "usage": _usage(end) if end else None,
                "user": body.user,
                "metadata": body.metadata or {},
            }

        def finish(content: str | None, calls: list, end: TurnEnd) -> str:
            """Store the turn; the response's status."""
            if body.store:
                turn = {"role": "assistant", "content": content or ""}
                if calls:
                    turn["tool_calls"] = template_tool_calls(
                        [{"id": c.id, "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
                    )
                store.put(resp_id, convo + [turn])
            return "incomplete" if end.finish_reason == "length" else "completed"

        if body.stream:
            return JobStream(job, keepalive(_stream(state, job, parse, envelope, finish)))
        events = await drain(request, _events(state, job, parse, envelope, finish))
        return events[-1][1]["response"]  # response.completed (or .incomplete) carries the whole response


async def _stream(state, job, parse, envelope, finish):
    """`_events` as server-sent events; a failure mid-stream is an `error` event."""
    seq = 0
    try:
        async for kind, data in _events(state, job, parse, envelope, finish):
            seq = data["sequence_number"] + 1
            yield sse(kind, data)
    except APIError as err:
        data = {"type": "error", "sequence_number": seq, "code": err.code, "message": err.message, "param": err.param}
        yield sse("error", data)


async def _events(state, job, parse, envelope, finish):
    """The documented event sequence, as (type, data): response.created, response.in_progress, then
    per output item output_item.added, its deltas (output_text.delta / function_call_arguments.delta)
    and *.done events, output_item.done; then response.completed (or response.incomplete), whose
    response is the whole one. A failed step raises APIError."""
    seq = 0
    output: list[dict] = []
    text_parts: list[str] = []
    open_msg: dict | None = None

    def event(kind: str, **data) -> tuple[str, dict]:
        nonlocal seq
        seq += 1
        return kind, {"type": kind, "sequence_number": seq - 1, **data}

    def open_message():
        output.append(_message_item(open_msg["id"], "", "in_progress"))
        common = {"item_id": open_msg["id"], "output_index": open_msg["index"], "content_index": 0}
        return [
            event("response.output_item.added", output_index=open_msg["index"], item=output[-1]),
            event("response.content_part.added", **common, part={"type": "output_text", "text": "", "annotations": []}),
        ]

    def close_message():
        item = _message_item(open_msg["id"], "".join(text_parts))
        output[open_msg["index"]] = item
        part = item["content"][0]
        common = {"item_id": item["id"], "output_index": open_msg["index"], "content_index": 0}
        return [
            event("response.output_text.done", **common, text=part["text"], logprobs=[]),
            event("response.content_part.done", **common, part=part),
            event("response.output_item.done", output_index=open_msg["index"], item=item),
        ]

    yield event("response.created", response=envelope("in_progress", [], None))
    yield event("response.in_progress", response=envelope("in_progress", [], None))
    content_all: list[str] = []
    calls = []
    think: dict | None = None  # the open reasoning item: id, index, text so far
    async for e in turn_events(state, job, parse):
        if isinstance(e, Thinking):  # the model's reasoning: a reasoning item before the answer
            if think is None:
                think = {"id": "rs_" + uuid.uuid4().hex[:24], "index": len(output), "text": []}
                output.append(_reasoning_item(think["id"], "", "in_progress"))
                yield event("response.output_item.added", output_index=think["index"], item=output[-1])
            think["text"].append(e.text)
            common = {"item_id": think["id"], "output_index": think["index"], "content_index": 0}
            yield event("response.reasoning_text.delta", **common, delta=e.text)
            continue
        if think is not None and think.get("open", True):
            think["open"] = False
            item = _reasoning_item(think["id"], "".join(think["text"]))
            output[think["index"]] = item
            common = {"item_id": think["id"], "output_index": think["index"], "content_index": 0}
            yield event("response.reasoning_text.done", **common, text=item["content"][0]["text"])
            yield event("response.output_item.done", output_index=think["index"], item=item)
        if isinstance(e, str):
            content_all.append(e)
            if open_msg is None:
                open_msg, text_parts = {"id": "msg_" + uuid.uuid4().hex[:24], "index": len(output)}, []
                for ev in open_message():
                    yield ev
            text_parts.append(e)
            yield event(
                "response.output_text.delta",
                item_id=open_msg["id"],
                output_index=open_msg["index"],
                content_index=0,
                delta=e,
                logprobs=[],
            )
        elif isinstance(e, TurnEnd):
            if open_msg is None and not calls:  # an empty turn: one empty message, as the whole response has
                open_msg, text_parts = {"id": "msg_" + uuid.uuid4().hex[:24], "index": len(output)}, []
                for ev in open_message():
                    yield ev
            if open_msg is not None:
                for ev in close_message():
                    yield ev
            status = finish("".join(content_all) or None, calls, e)
            yield event(f"response.{status}", response=envelope(status, output, e))
        else:
            if open_msg is not None:
                for ev in close_message():
                    yield ev
                open_msg = None
            calls.append(e)
            index = len(output)
            output.append(_call_item(e))
            added = _call_item(e, "in_progress")
            yield event("response.output_item.added", output_index=index, item=added)
            yield event(
                "response.function_call_arguments.delta", item_id=added["id"], output_index=index, delta=e.arguments
            )
            yield event(
                "response.function_call_arguments.done",
                item_id=added["id"],
                output_index=index,
                name=e.name,
                arguments=e.arguments,
            )
            yield event("response.output_item.done", output_index=index, item=output[index])
