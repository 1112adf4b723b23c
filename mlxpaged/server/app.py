"""The FastAPI app: OpenAI routes over an `EngineLoop`, every failure as one OpenAI error object.

A route validates and encodes its body, submits one engine request per prompt (each with the
body's `n` samples) and waits for the engine to accept them, so a request that cannot fit in
the pool is a 400 before any stream starts. It then reads its outputs from its own asyncio
queue. Whatever ends a route early (a disconnect, a cancelled stream, an error) aborts the
engine requests it still owns, in a `finally`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import MlxPagedError, StepError
from .anthropic_api import register_anthropic
from .engine_loop import EngineDown, EngineLoop, Sink
from .errors import APIError, error_body
from .metrics import CONTENT_TYPE, Metrics
from .guided_request import chat_plan
from .prompts import check_context, encode_messages, encode_prompt
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import ChoiceStream, TokenText, chat_logprobs, completion_logprobs, envelope, usage
from .responses_api import register_responses
from .tools import ToolCallStream, chat_message, stream_tool_delta

DEFAULT_CHAT_MAX_TOKENS = 1024  # when a chat body gives neither max_tokens nor max_completion_tokens
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ServerState:
    engine_loop: EngineLoop
    metrics: Metrics
    model_id: str
    model_aliases: frozenset[str]
    api_key: str | None
    max_queue: int
    context: int | None
    vocab_size: int
    responses_store: int = 0  # --responses-store: Responses kept for previous_response_id (0: stateless)


def build_app(engine_loop: EngineLoop, metrics: Metrics, *, model_id: str, model_aliases=(), api_key: str | None = None,
              max_queue: int = 1024, responses_store: int = 0) -> FastAPI:
    """Routes over a started `engine_loop`; the app's shutdown stops it."""
    engine = engine_loop.engine
    args = engine.loaded.model.args
    state = ServerState(engine_loop, metrics, model_id, frozenset({model_id, *model_aliases}), api_key, max_queue,
                        getattr(args, "max_position_embeddings", None), args.vocab_size, responses_store)
    text_of = TokenText(engine.tokenizer)

    @asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:  # after uvicorn's graceful shutdown: abort what is still running
            engine_loop.stop()

    app = FastAPI(title="mlxpaged", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return _validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    def authorize(request: Request) -> None:
        if state.api_key:
            given = request.headers.get("authorization", "")
            if given != f"Bearer {state.api_key}":
                raise APIError(401, f"{'missing' if not given else 'wrong'} API key: send 'Authorization: Bearer KEY'",
                               code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @app.get("/health")
    async def health():
        return {"status": "ok", "steps": engine_loop.steps}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": 0,
                                            "owned_by": "mlxpaged"}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(state, body.model)
        prompts = [encode_prompt(engine.tokenizer, p, state.vocab_size) for p in body.prompts()]
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        max_tokens = body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        for ids in prompts:
            check_context(len(ids), max_tokens, state.context)
        params = _params(body, max_tokens, body.logprobs, state.vocab_size)
        job = await _Job.start(state, "cmpl", prompts, params)

        def choice(index, text, lps, finish, stream: ChoiceStream):
            lp = completion_logprobs(lps, text_of) if lps is not None else None
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

        if body.stream:
            return job.stream(request, "text_completion", state.model_id, choice, body.include_usage)
        outs = await job.collect(request)
        choices = [choice(job.index(o.request_id, c.index), c.text, getattr(c, "logprobs", None), c.finish_reason, None)
                   for o in outs for c in o.outputs]
        return envelope(job.resp_id, "text_completion", state.model_id, choices=choices, usage=usage(outs))

    @v1.post("/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        _check_model(state, body.model)
        messages, plan = chat_plan(body)  # tools, tool_choice and response_format (guided_request.py)
        ids = encode_messages(engine.tokenizer, messages, plan.tools)
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:
            max_tokens = max(1, min(DEFAULT_CHAT_MAX_TOKENS, (state.context or 1 << 30) - len(ids)))
        check_context(len(ids), max_tokens, state.context)
        params = _params(body, max_tokens, body.logprobs_k(), state.vocab_size, guided=plan.guided)
        job = await _Job.start(state, "chatcmpl", [ids], params, plan.param)

        def chunk_choice(index, text, lps, finish, stream: ChoiceStream):
            delta = {"content": text}
            if plan.parse:  # content the tool-call parser lets through, and the calls it completed
                if not hasattr(stream, "tools"):
                    stream.tools = ToolCallStream(plan.parse)
                delta, finish = stream_tool_delta(stream.tools, text, finish)
                if not delta and not finish and not lps:
                    return None
            if not stream.started:
                delta = {"role": "assistant", **delta}
                stream.started = True
            lp = chat_logprobs(lps, text_of) if lps is not None else None
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

        if body.stream:
            return job.stream(request, "chat.completion.chunk", state.model_id, chunk_choice, body.include_usage)
        outs = await job.collect(request)
        choices = [{"index": c.index, "message": msg,
                    "logprobs": chat_logprobs(c.logprobs, text_of) if getattr(c, "logprobs", None) is not None else None,
                    "finish_reason": finish}
                   for o in outs for c in o.outputs
                   for msg, finish in [chat_message(c.text, c.finish_reason, plan.parse)]]  # tools.py: parsed calls
        return envelope(job.resp_id, "chat.completion", state.model_id, choices=choices, usage=usage(outs))

    register_responses(v1, state, text_of)
    app.include_router(v1)
    register_anthropic(app, state)
    return app


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        msg, param = f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}", None
    elif err.get("type") == "missing" and not loc:
        msg, param = "the request needs a JSON object body", None
    else:
        # The top-level field is the param; deeper parts (list indices, union members) stay in the message.
        param = loc[0] if loc else None
        msg = f"{'.'.join(loc) if loc else 'body'}: {err['msg']}"
    return JSONResponse(error_body(400, msg, param=param), status_code=400)


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_aliases:
        raise APIError(400, f"unknown model '{model}': this server serves '{state.model_id}'", param="model",
                       code="model_not_found")


def _params(body, max_tokens: int, logprobs: int | None, vocab_size: int | None = None, **extra):
    try:
        return body.to_sampling_params(max_tokens, logprobs, vocab_size, **extra)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=str(e).split(" ", 1)[0] if " must " in str(e) else None) from None


def _server_error(item: BaseException) -> APIError:
    if isinstance(item, StepError):
        return APIError(500, f"{item}", code="engine_step_failed")
    return APIError(503 if isinstance(item, EngineDown) else 500, str(item))


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Job:
    """The engine requests behind one HTTP request: one per prompt, ids `{resp_id}-{i}`."""

    def __init__(self, state: ServerState, resp_id: str, rids: list[str], queue: asyncio.Queue, params):
        self.state, self.resp_id, self.rids, self.queue, self.params = state, resp_id, rids, queue, params
        self.final: dict = {}

    @classmethod
    async def start(cls, state: ServerState, prefix: str, prompts: list[list[int]], params,
                    guided_param: str | None = None) -> "_Job":
        """`guided_param`: the request field a grammar the engine cannot compile is blamed on."""
        el = state.engine_loop
        waiting = el.snapshot.get("requests_waiting", 0) + el.pending
        if waiting + len(prompts) > state.max_queue:
            raise APIError(503, f"server busy: {waiting} requests waiting (--max-queue {state.max_queue}); retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        resp_id = f"{prefix}-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        sink = Sink(asyncio.get_running_loop(), queue)
        rids = [f"{resp_id}-{i}" for i in range(len(prompts))]
        futs = [el.submit(ids, params, rid, sink) for ids, rid in zip(prompts, rids)]
        try:
            for f in futs:
                await asyncio.wrap_future(f)
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
        return cls(state, resp_id, rids, queue, params)

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
                try:
                    rid, item = await asyncio.wait_for(self.queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise APIError(499, "client disconnected") from None
                    continue
                if isinstance(item, BaseException):
                    self.final[rid] = None
                    raise _server_error(item)
                if item.finished:
                    self.final[rid] = item
        finally:
            self._abort_unfinished()
        return [self.final[r] for r in self.rids]

    def stream(self, request: Request, kind: str, model: str, make_choice, include_usage: bool) -> StreamingResponse:
        return StreamingResponse(self._events(kind, model, make_choice, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self, kind: str, model: str, make_choice, include_usage: bool):
        streams: dict[tuple[str, int], ChoiceStream] = {}
        extra = {"usage": None} if include_usage else {}
        try:
            while len(self.final) < len(self.rids):
                rid, item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.final[rid] = None
                    yield _sse(_server_error(item).body())
                    break
                for c in item.outputs:
                    st = streams.setdefault((rid, c.index), ChoiceStream(self.params.stop))
                    d = st.advance(c)
                    choice = make_choice(self.index(rid, c.index), *d, st) if d is not None else None
                    if choice is not None:  # None: the route holds the delta back (a tool call in progress)
                        yield _sse(envelope(self.resp_id, kind, model, choices=[choice], **extra))
                if item.finished:
                    self.final[rid] = item
            else:
                if include_usage:
                    yield _sse(envelope(self.resp_id, kind, model, choices=[], usage=usage(list(self.final.values()))))
            yield "data: [DONE]\n\n"
        finally:
            self._abort_unfinished()
