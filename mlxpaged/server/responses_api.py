"""OpenAI's Responses API: `POST /v1/responses`.

`input` (a string, or items: messages, `function_call`, `function_call_output`) becomes chat
messages for the checkpoint's template, `instructions` its system turn. Output items are a
`message` with `output_text` and one `function_call` item per call. Errors are OpenAI's error
object, as on the chat routes.

Stateless by default. With `--responses-store N` the server keeps the last N responses (their
conversation: input and output, not the instructions, as OpenAI does) in an LRU, and
`previous_response_id` continues one; otherwise `previous_response_id` is a 400 naming the limit.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from .errors import APIError
from .guided_request import format_guided, tool_plan
from .jobs import check_model, sampling_params
from .prompts import check_context, encode_messages
from .tools import template_tool_calls
from .turns import TurnEnd, default_max_tokens, sse, start_turn, turn_events, whole_turn


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_type(v) -> str:
    return (v.get("type") if isinstance(v, dict) else getattr(v, "type", None)) or "message"


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
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
    # Fields this server does not implement: refused by name when set (see `refuse_unsupported`).
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    conversation: Any = None
    prompt: Any = None
    truncation: str | None = None  # "disabled" (OpenAI's default) only


def refuse_unsupported(body: ResponsesRequest) -> None:
    if body.reasoning and any(v is not None for v in body.reasoning.values()):
        raise APIError(400, "reasoning: this server runs no reasoning models", param="reasoning")
    if body.truncation not in (None, "disabled"):
        raise APIError(400, f"truncation: only 'disabled' is supported, got {body.truncation!r}", param="truncation")
    for name in ("background", "max_tool_calls", "top_logprobs", "conversation", "prompt"):
        if getattr(body, name) not in (None, False):
            raise APIError(400, f"{name}: not supported by this server", param=name)


class ResponseStore:
    """The conversations of the last `capacity` responses, by id (least recently used out first)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict]] = OrderedDict()

    def get(self, resp_id: str) -> list[dict]:
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
                f"(this server keeps the "
                f"last {self.capacity} responses, --responses-store {self.capacity})",
                param="previous_response_id",
            )
        self._items.move_to_end(resp_id)
        return self._items[resp_id]

    def put(self, resp_id: str, messages: list[dict]) -> None:
        if self.capacity <= 0:
            return
        self._items[resp_id] = messages
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


def conversation(body: ResponsesRequest, history: list[dict]) -> list[dict]:
    """The template messages of `history` plus this body's input (instructions not included)."""
    out = list(history)
    if isinstance(body.input, str):
        return out + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        if isinstance(item, MessageItem):
            out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            try:
                call = template_tool_calls(
                    [{"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}]
                )[0]
            except ValueError as e:
                raise APIError(400, f"input.{i}: {e}", param="input") from None
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:  # parallel calls: one turn
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant" and "tool_calls" not in out[-1]:
                out[-1]["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def _usage(end: TurnEnd) -> dict:
    return {
        "input_tokens": end.prompt_tokens,
        "input_tokens_details": {"cached_tokens": end.cached_tokens},
        "output_tokens": end.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
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
    engine = state.engine_loop.engine
    store = ResponseStore(state.responses_store)

    @router.post("/responses")
    async def responses(body: ResponsesRequest, request: Request):
        check_model(state, body.model)
        refuse_unsupported(body)
        history = store.get(body.previous_response_id) if body.previous_response_id else []
        convo = conversation(body, history)
        messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + convo
        functions = [
            {"name": t.name, "description": t.description, "parameters": t.parameters} for t in body.tools or []
        ]
        tc = body.tool_choice
        choice = ("named" if isinstance(tc, FunctionChoice) else tc) or ("auto" if functions else "none")
        plan = tool_plan(
            functions, choice, tc.name if isinstance(tc, FunctionChoice) else None, parallel=body.parallel_tool_calls
        )
        fmt = body.text.format if body.text else None
        if fmt is not None and fmt.type != "text":
            if plan.guided is not None:
                raise APIError(
                    400,
                    f"text.format: cannot be combined with tool_choice '{choice}' (both constrain the output)",
                    param="text",
                )
            plan.guided = format_guided(fmt.type, fmt.schema_, "text.format")
            plan.param = "text"
        ids = await state.off_loop(encode_messages, engine.tokenizer, messages, plan.tools)
        max_tokens = body.max_output_tokens or default_max_tokens(state, len(ids))
        try:
            check_context(len(ids), max_tokens, state.context)
        except APIError as e:  # the chat routes' words, in this API's field names
            if e.param == "max_tokens":
                e.param, e.message = "max_output_tokens", e.message.replace("max_tokens", "max_output_tokens")
            raise
        params = sampling_params(_Sampling(body), max_tokens, None, state.vocab_size, guided=plan.guided)
        job = await start_turn(state, "resp", ids, params, plan.param)
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
                "reasoning": {"effort": None, "summary": None},
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
            return StreamingResponse(
                _stream(state, job, plan.parse, envelope, finish),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        content, calls, end = await whole_turn(state, job, request, plan.parse)
        output = ([_message_item("msg_" + uuid.uuid4().hex[:24], content)] if content or not calls else []) + [
            _call_item(c) for c in calls
        ]
        return envelope(finish(content, calls, end), output, end)


class _Sampling:
    def __init__(self, body: ResponsesRequest):
        self.body = body

    def to_sampling_params(self, max_tokens, logprobs, vocab_size=None, **extra):
        from ..engine.sampling_params import SamplingParams

        return SamplingParams(
            temperature=self.body.temperature,
            top_p=self.body.top_p,
            max_tokens=max_tokens,
            speculative=self.body.speculative,
            **{k: v for k, v in extra.items() if v is not None},
        )


async def _stream(state, job, parse, envelope, finish):
    """The documented event sequence: response.created, response.in_progress, then per output item
    output_item.added, its deltas (output_text.delta / function_call_arguments.delta) and *.done
    events, output_item.done; then response.completed (or response.incomplete)."""
    seq = 0
    output: list[dict] = []
    text_parts: list[str] = []
    open_msg: dict | None = None

    def event(kind: str, **data) -> str:
        nonlocal seq
        seq += 1
        return sse(kind, {"type": kind, "sequence_number": seq - 1, **data})

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
    try:
        async for e in turn_events(state, job, parse):
            if isinstance(e, str):
                content_all.append(e)
                if open_msg is None:
                    open_msg = {"id": "msg_" + uuid.uuid4().hex[:24], "index": len(output)}
                    text_parts = []
                    output.append(_message_item(open_msg["id"], "", "in_progress"))
                    yield event("response.output_item.added", output_index=open_msg["index"], item=output[-1])
                    yield event(
                        "response.content_part.added",
                        item_id=open_msg["id"],
                        output_index=open_msg["index"],
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []},
                    )
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
                    open_msg = {"id": "msg_" + uuid.uuid4().hex[:24], "index": 0}
                    output.append(_message_item(open_msg["id"], "", "in_progress"))
                    yield event("response.output_item.added", output_index=0, item=output[-1])
                    yield event(
                        "response.content_part.added",
                        item_id=open_msg["id"],
                        output_index=0,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []},
                    )
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
    except APIError as err:
        yield event("error", code=err.code, message=err.message, param=err.param)
