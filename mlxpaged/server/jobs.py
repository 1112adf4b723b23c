"""What every route shares: the server's state, the engine requests behind one HTTP request
(`Job`: queueing, admission errors, aborts, reading the engine's delta outputs and adding them
up), and the small conversions from engine failures to error objects.

Every route, streamed or not, reads its job through `turns.job_events`; this module imports no
route and no renderer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.guided import GrammarTooSlow
from ..errors import AdapterRefused, MlxPagedError, StepError
from .engine_loop import ClientTooSlow, EngineDown, EngineLoop, Sink
from .errors import APIError
from .limits import Capacity, Limits
from .metrics import Metrics


class ErrorResponse(JSONResponse):
    """An error object, ASCII-escaped: a message quoting client text with a lone surrogate still encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


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
    pooling: object = None  # embeddings_api.PoolingSpec: what the checkpoint says about its embeddings

    @property
    def context(self) -> int | None:
        return self.capacity.context

    @property
    def vocab_size(self) -> int:
        return self.capacity.vocab_size

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)


def check_model(state: ServerState, model: str | None) -> None:
    from .adapters import split_model  # "BASE:ADAPTER" names BASE (its adapter is checked at admission)

    model = split_model(state, model)[0]
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


class Job:
    """The engine requests behind one HTTP request: one per prompt, ids `{resp_id}-{i}`."""

    def __init__(self, state: ServerState, resp_id: str, rids: list[str], sink: Sink, params):
        self.state, self.resp_id, self.rids, self.sink, self.params = state, resp_id, rids, sink, params
        self.totals: dict = {}  # request id -> its delta outputs so far, added up (`RequestOutput.add`)
        self.final: dict = {}  # request id -> its total once finished (None: it failed)
        self.prompts: list[list[int]] = []  # set by `start`

    @classmethod
    async def start(
        cls,
        state: ServerState,
        prefix: str,
        prompts: list[list[int]],
        params,
        guided_param: str | None = None,
        images=None,
    ) -> Job:
        """`guided_param`: the request field a grammar the engine cannot compile is blamed on;
        `images`: the one prompt's processed images (engine/multimodal.py `ImageInputs`), or None."""
        el = state.engine_loop
        waiting = el.snapshot.get("requests_waiting", 0) + el.pending
        if waiting + len(prompts) > state.max_queue:
            raise APIError(
                503,
                f"server busy: {waiting} requests waiting (--max-queue {state.max_queue}); retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        params = dataclasses.replace(params, output_kind="delta")  # the engine hands out what is new, stops held back
        held = None  # the grammar, compiled off the engine thread and held until the engine took it (GrammarGate)
        if params.guided is not None and state.grammars is not None:
            held = await state.grammars.compile(params.guided, guided_param)
        resp_id = f"{prefix}-{uuid.uuid4().hex}"
        sink = Sink(asyncio.get_running_loop())
        rids = [f"{resp_id}-{i}" for i in range(len(prompts))]
        extra = {"images": images} if images is not None else {}  # only an image request passes them
        futs = [el.submit(ids, params, rid, sink, **extra) for ids, rid in zip(prompts, rids)]
        try:
            for f in futs:
                await asyncio.wrap_future(f)
            del held
        except BaseException as e:
            for rid in rids:
                el.abort(rid)
            if isinstance(e, ValueError) and params.guided is not None and str(e).startswith("unsupported"):
                raise APIError(400, f"{guided_param}: {e}", param=guided_param) from None
            if isinstance(e, AdapterRefused):  # a folder of --adapter-dir that does not fit the model
                raise APIError(400, str(e), code="adapter_not_served") from None
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

    def absorb(self, rid: str, item):
        """Add a delta output to its request's total; the total, final once `item.finished`."""
        total = self.totals.get(rid)
        if total is None:
            total = self.totals[rid] = dataclasses.replace(item, outputs=[])
        total.add(item)
        if item.finished:
            self.final[rid] = total
        return total

    def fail(self, rid: str, item: BaseException) -> APIError:
        self.final[rid] = None
        return server_error(item)

    def _abort_unfinished(self) -> None:
        for rid in self.rids:
            if rid not in self.final:
                self.state.engine_loop.abort(rid)


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
