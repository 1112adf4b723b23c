"""One assistant turn for the Anthropic and Responses routes: submit it, then read it as events.

Both routes see a turn the same way: content text, `ToolCall`s (when tools were offered) and
one closing `TurnEnd`. Each renders them in its own protocol. Streamed text is held back the
way `ChoiceStream` holds it (a tail that may grow into a stop string), and tool-call spans the
way `ToolCallStream` does, so the streamed events equal the whole turn's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import Request

from .errors import APIError
from .jobs import server_error
from .openai_format import ChoiceStream
from .reasoning import split_reasoning, thinking_of
from .tools import ToolCall, ToolCallStream, check_forcible, parse_tool_calls


@dataclass
class Thinking:
    text: str  # a piece of the model's reasoning


@dataclass
class TurnEnd:
    finish_reason: str  # "stop" (EOS, a stop string), "length" or "tool_calls"
    stop_sequence: str | None  # the stop string that ended the turn, if one did
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def _end(out, c, calls: int) -> TurnEnd:
    finish = c.finish_reason or "length"
    if finish == "stop" and calls:
        finish = "tool_calls"
    stop = c.stop_reason if finish == "stop" and isinstance(c.stop_reason, str) else None  # the engine's record
    return TurnEnd(finish, stop, len(out.prompt_token_ids), len(c.token_ids), out.num_cached_tokens)


async def whole_turn(state, job, request: Request, parse) -> tuple[str | None, list[ToolCall], TurnEnd, str]:
    """(content, calls, end, reasoning) of a finished turn."""
    out = (await job.collect(request))[0]
    c = out.outputs[0]
    reasoning, text = split_reasoning(thinking_of(state, job.prompts[0]), c.text)
    content, calls = parse_tool_calls(text, parse, state.tool_format) if parse else (text, [])
    return content, calls, _end(out, c, len(calls)), reasoning


async def turn_events(state, job, parse):
    """Yields `Thinking` pieces, `str` deltas, `ToolCall`s and, last, a `TurnEnd`; a failed step raises APIError.
    Closing the generator early (a client gone) aborts the engine request."""
    tools = ToolCallStream(parse, state.tool_format) if parse else None
    think = thinking_of(state, job.prompts[0])
    try:
        text = ChoiceStream(job.params.stop, await job.borders())
        async for rid, item in _items(job):
            if isinstance(item, BaseException):
                job.final[rid] = None
                raise server_error(item)
            c = item.outputs[0]
            d = text.advance(c)
            if d is not None:
                delta, _, finish = d
                reasoning, delta = split_reasoning(think, delta, finish is not None)
                if reasoning:
                    yield Thinking(reasoning)
                if tools is None:
                    if delta:
                        yield delta
                else:
                    for e in tools.feed(delta) + (tools.finish() if finish else []):
                        yield e
            if item.finished:
                job.final[rid] = item
                yield _end(item, c, tools.num_calls if tools else 0)
                return
    finally:
        job._abort_unfinished()


async def _items(job):
    """(request id, newest output or exception), as the job's engine request reports them: the one
    place that reads the job's sink (outputs are cumulative: a skipped one loses nothing)."""
    while True:
        for item in await job.sink.get():
            yield item


def turn_parse(state, plan):
    """The names a turn's output is parsed for calls with (None: served as text), after refusing a
    forced call the checkpoint's format cannot be forced in."""
    check_forcible(state.tool_format, plan)
    return plan.parse if state.tool_format else None


def add_format(plan, guided, param: str, conflict: str) -> None:
    """A structured-output format joins a tool plan, unless the plan already forces a call."""
    if guided is None:
        return
    if plan.guided is not None:
        raise APIError(400, f"{param}: cannot be combined with {conflict} (both constrain the output)", param=param)
    plan.guided, plan.param = guided, param


def sse(event: str, data: dict) -> str:
    """One server-sent event with its name (Anthropic's and Responses' streams name every event)."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
