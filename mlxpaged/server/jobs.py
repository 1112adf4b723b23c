"""What every route shares: the server's state, the engine requests behind one HTTP request
(`Job`: queueing, admission errors, aborts, reading outputs and streaming them), and the small
conversions from bodies to engine parameters and from engine failures to error objects.

The OpenAI routes (app.py), the Anthropic and Responses routes and their turns import it; it
imports none of them.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.guided import GrammarTooSlow
from ..errors import MlxPagedError, StepError
from .engine_loop import ClientTooSlow, EngineDown, EngineLoop, Sink
from .errors import APIError
from .limits import Capacity, Limits
from .metrics import Metrics
from .openai_format import ChoiceStream, envelope, stop_borders, usage


class ErrorResponse(JSONResponse):
    """An error object, ASCII-escaped: a message quoting client text with a lone surrogate still encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


YIELD_EVERY = 8  # stream chunks between two yields to the event loop


@dataclass
class ServerState:
    engine_loop: EngineLoop
    metrics: Metrics
    model_id: str
    model_aliases: frozenset[str]
    max_queue: int
    limits: Limits
    capacity: Capacity
    tokenize_pool: ThreadPoolExecutor  # tokenizing and chat templates run here, never on the event loop
    responses_store: int = 0  # --responses-store: Responses kept for previous_response_id (0: stateless)
    markers: object = None  # tools.CallMarkers: how the forcing grammar writes a call span's markers
    tool_format: object = None  # tools.ToolFormat of the checkpoint, or None: tool calls are served as text
    think: object = None  # reasoning.ThinkMarkers of a thinking model, else None
    grammars: object = None  # guided_request.GrammarGate: grammars compile there, off the engine thread

    @property
    def context(self) -> int | None:
        return self.capacity.context

    @property
    def vocab_size(self) -> int:
        return self.capacity.vocab_size

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_aliases:
        raise APIError(
            404,
            f"unknown model '{model}': this server serves '{state.model_id}'",
            param="model",
            code="model_not_found",
        )


def server_error(item: BaseException) -> APIError:
    if isinstance(item, StepError) and isinstance(item.cause, GrammarTooSlow):
        return APIError(400, str(item.cause), code="grammar_too_slow")
    if isinstance(item, StepError):
        return APIError(500, f"{item}", code="engine_step_failed")
    if isinstance(item, ClientTooSlow):
        return APIError(408, str(item), code="client_too_slow")
    return APIError(503 if isinstance(item, EngineDown) else 500, str(item))


def sse_data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Job:
    """The engine requests behind one HTTP request: one per prompt, ids `{resp_id}-{i}`."""

    def __init__(self, state: ServerState, resp_id: str, rids: list[str], sink: Sink, params):
        self.state, self.resp_id, self.rids, self.sink, self.params = state, resp_id, rids, sink, params
        self.final: dict = {}
        self.prompts: list[list[int]] = []  # set by `start`

    @classmethod
    async def start(
        cls, state: ServerState, prefix: str, prompts: list[list[int]], params, guided_param: str | None = None
    ) -> Job:
        """`guided_param`: the request field a grammar the engine cannot compile is blamed on."""
        el = state.engine_loop
        waiting = el.snapshot.get("requests_waiting", 0) + el.pending
        if waiting + len(prompts) > state.max_queue:
            raise APIError(
                503,
                f"server busy: {waiting} requests waiting (--max-queue {state.max_queue}); retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        held = None  # the grammar, compiled off the engine thread and held until the engine took it (GrammarGate)
        if params.guided is not None and state.grammars is not None:
            held = await state.grammars.compile(params.guided, guided_param)
        resp_id = f"{prefix}-{uuid.uuid4().hex}"
        sink = Sink(asyncio.get_running_loop())
        rids = [f"{resp_id}-{i}" for i in range(len(prompts))]
        futs = [el.submit(ids, params, rid, sink) for ids, rid in zip(prompts, rids)]
        try:
            for f in futs:
                await asyncio.wrap_future(f)
            del held
        except BaseException as e:
            for rid in rids:
                el.abort(rid)
            if isinstance(e, ValueError) and params.guided is not None and str(e).startswith("unsupported"):
                raise APIError(400, f"{guided_param}: {e}", param=guided_param) from None
            if isinstance(e, (MlxPagedError, ValueError)):
                param = "prompt" if str(e).startswith("prompt") else ("n" if params.n > 1 else "max_tokens")
                raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
            if isinstance(e, EngineDown):
                raise APIError(503, str(e)) from None
            raise
        job = cls(state, resp_id, rids, sink, params)
        job.prompts = prompts
        return job

    def index(self, rid: str, sample: int) -> int:
        return self.rids.index(rid) * self.params.n + sample

    def _abort_unfinished(self) -> None:
        for rid in self.rids:
            if rid not in self.final:
                self.state.engine_loop.abort(rid)

    async def collect(self, request: Request) -> list:
        """Every request's final output, in prompt order; a client gone while waiting aborts them."""
        try:
            while len(self.final) < len(self.rids):
                items = await self.sink.get(timeout=1.0)
                if not items:
                    if await request.is_disconnected():
                        raise APIError(499, "client disconnected") from None
                    continue
                for rid, item in items:
                    if isinstance(item, BaseException):
                        self.final[rid] = None
                        raise server_error(item)
                    if item.finished:
                        self.final[rid] = item
        finally:
            self._abort_unfinished()
        return [self.final[r] for r in self.rids]

    def stream(self, request: Request, kind: str, model: str, make_choice, include_usage: bool) -> StreamingResponse:
        return JobStream(self, self._events(kind, model, make_choice, include_usage))

    async def borders(self) -> list[list[int]]:
        """The stops' KMP tables, once for all samples and off the loop (64 stops of 1,500 characters: 0.1 s)."""
        return await self.state.off_loop(stop_borders, self.params.stop) if self.params.stop else []

    async def _events(self, kind: str, model: str, make_choice, include_usage: bool):
        streams: dict[tuple[str, int], ChoiceStream] = {}
        extra = {"usage": None} if include_usage else {}
        sent = 0
        try:
            borders = await self.borders()
            failed = False
            while len(self.final) < len(self.rids) and not failed:
                for rid, item in await self.sink.get():
                    if isinstance(item, BaseException):
                        self.final[rid] = None
                        yield sse_data(server_error(item).body())
                        failed = True
                        break
                    for c in item.outputs:
                        st = streams.setdefault((rid, c.index), ChoiceStream(self.params.stop, borders))
                        d = st.advance(c)
                        choice = make_choice(self.index(rid, c.index), *d, st) if d is not None else None
                        if choice is not None:  # None: the route holds the delta back (a tool call in progress)
                            yield sse_data(envelope(self.resp_id, kind, model, choices=[choice], **extra))
                            sent += 1
                            if sent % YIELD_EVERY == 0:  # many choices or a backlog: let other requests run
                                await asyncio.sleep(0)
                    if item.finished:
                        self.final[rid] = item
            if not failed:
                if include_usage:
                    yield sse_data(
                        envelope(self.resp_id, kind, model, choices=[], usage=usage(list(self.final.values())))
                    )
            yield "data: [DONE]\n\n"
        finally:
            self._abort_unfinished()


class JobStream(StreamingResponse):
    """A job's server-sent events. Invariant: however the response ends (its events all sent, a
    failure, a client gone, or an event that cannot be encoded before the generator ever ran its
    own `finally`), the job's unfinished engine requests are aborted."""

    def __init__(self, job: Job, events):
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job._abort_unfinished()
