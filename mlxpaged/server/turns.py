"""The one event stream of every route, and the helpers of the Anthropic and Responses turns.

`job_events` reads a job's delta outputs (the engine already holds back what may grow into a stop
string) and turns each into events: `str` answer text, `Thinking` reasoning text (split at the
checkpoint's think markers), `ToolCall`s (when tools were offered; `ToolCallStream` holds back a
span until it closes), `Logprobs` of the delta's tokens and, once per sample, a `TurnEnd` (finish
reason, stop sequence, usage). Each route renders them into its own wire format: OpenAI chunks
(openai_api.py), Anthropic events (anthropic_api.py), Responses events (responses_api.py),
Ollama's lines (ollama_api.py). A route's non-streamed answer is these same events collected
(`drain`) and added up as a client adds up the stream, so a streamed and a whole answer pass
through one reasoning split and one tool-call parser.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from fastapi import Request

from .errors import APIError
from .reasoning import reasoning_tokens, split_reasoning, thinking_of
from .tools import ToolCallStream, check_forcible

YIELD_EVERY = 8  # event lists between two yields to the event loop


@dataclass
class Thinking:
    text: str  # a piece of the model's reasoning


@dataclass
class Logprobs:
    items: list  # the `TokenLogprob`s of one delta's tokens


@dataclass
class TurnEnd:
    finish_reason: str  # "stop" (EOS, a stop string), "length" or "tool_calls"
    stop_sequence: str | None  # the stop string that ended the turn, if one did
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int = 0  # of completion_tokens, those inside the think block


def turn_end(state, prompt: list[int], out, c, calls: int) -> TurnEnd:
    """The end of sample `c` of the total output `out` (`calls`: tool calls it made)."""
    finish = c.finish_reason or "length"
    if finish == "stop" and calls:
        finish = "tool_calls"
    stop = c.stop_reason if finish == "stop" and isinstance(c.stop_reason, str) else None  # the engine's record
    return TurnEnd(
        finish,
        stop,
        len(out.prompt_token_ids),
        len(c.token_ids),
        out.num_cached_tokens,
        reasoning_tokens(state, prompt, c.token_ids),
    )


class _Sample:
    """One sample's way from deltas to events: its reasoning split and its tool-call parser."""

    def __init__(self, state, prompt: list[int], parse, think: bool):
        self.think = thinking_of(state, prompt) if think else None
        self.tools = ToolCallStream(parse, state.tool_format) if parse else None

    def events(self, c) -> list:
        final = c.finish_reason is not None
        reasoning, text = split_reasoning(self.think, c.text, final)
        out: list = [Thinking(reasoning)] if reasoning else []
        if self.tools is None:
            out += [text] if text else []
        else:
            out += self.tools.feed(text) + (self.tools.finish() if final else [])
        if c.logprobs:
            out.append(Logprobs(c.logprobs))
        return out


async def job_events(state, job, parse=None, think: bool = True):
    """Yields `(choice index, events)` for each delta of each sample of the job that has any, the
    sample's `TurnEnd` last in its last list; a failed step raises APIError. `parse`: the function
    names a sample's calls are parsed for (None: text); `think`: split reasoning off (chat and the
    turns; not completions). Closing the generator early (a client gone) aborts the engine requests."""
    samples: dict[tuple[str, int], _Sample] = {}
    sent = 0
    try:
        while len(job.final) < len(job.rids):
            for rid, item in await job.sink.get():
                if isinstance(item, BaseException):
                    raise job.fail(rid, item)
                total = job.absorb(rid, item)
                prompt = job.prompts[job.rids.index(rid)]
                for c in item.outputs:
                    key = (rid, c.index)
                    if key not in samples:
                        samples[key] = _Sample(state, prompt, parse, think)
                    s = samples[key]
                    events = s.events(c)
                    if c.finish_reason is not None:
                        whole = next(x for x in total.outputs if x.index == c.index)
                        events.append(turn_end(state, prompt, total, whole, s.tools.num_calls if s.tools else 0))
                    if events:
                        yield job.index(rid, c.index), events
                        sent += 1
                        if sent % YIELD_EVERY == 0:  # many choices or a backlog: let other requests run
                            await asyncio.sleep(0)
    finally:
        job._abort_unfinished()


async def turn_events(state, job, parse):
    """One turn's events, flat: `Thinking`, `str`, `ToolCall` and, last, its `TurnEnd`."""
    async for _, events in job_events(state, job, parse):
        for e in events:
            if not isinstance(e, Logprobs):
                yield e


async def drain(request: Request, events) -> list:
    """Every item of the async iterator `events` (a job's events, or a route's rendering of them),
    in order: what a non-streamed answer is built from. A client gone while waiting closes the
    iterator, whose `finally` aborts the job's engine requests; a failed step raises APIError."""
    items: list = []

    async def run():
        async for x in events:
            items.append(x)

    task = asyncio.ensure_future(run())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=1.0)
            if not task.done() and await request.is_disconnected():
                raise APIError(499, "client disconnected")
        task.result()
    finally:
        if not task.done():
            task.cancel()  # closes the event stream: its `finally` aborts the engine requests
    return items


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
