"""The FastAPI app: OpenAI routes over an `EngineLoop`, every failure as one OpenAI error object.

Before any route, `Guard` (middleware.py) checks draining, the API key and the body size, and turns
an unhandled exception into a 500 error object. A route validates its body, checks the limits that
need no tokenizing (limits.py), tokenizes on the tokenizer thread (never on the event loop), submits
one engine request per prompt (each with the body's `n` samples) and waits for the engine to accept
them, so a request that cannot fit in the pool is a 400 before any stream starts. It then reads the
newest output of each of its requests from its `Sink`. Whatever ends a route early (a disconnect, a
cancelled stream, an error) aborts the engine requests it still owns, in a `finally`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import MlxPagedError, StepError
from .anthropic_api import register_anthropic
from .connections import AcceptErrorLog
from .engine_loop import ClientTooSlow, EngineDown, EngineLoop, Sink
from .errors import APIError, error_body
from .limits import Capacity, Limits, check_chars, check_request, default_max_tokens, max_token_chars
from .metrics import CONTENT_TYPE, Metrics
from .guided_request import chat_plan
from .middleware import Guard
from .prompts import check_context, encode_messages, encode_prompt
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import ChoiceStream, TokenText, chat_logprobs, completion_logprobs, envelope, stop_borders, usage
from .responses_api import register_responses
from .tools import ToolCallStream, chat_message, stream_tool_delta

DEFAULT_CHAT_MAX_TOKENS = 1024  # when a chat body gives neither max_tokens nor max_completion_tokens
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
YIELD_EVERY = 8  # stream chunks between two yields to the event loop
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


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

    @property
    def context(self) -> int | None:
        return self.capacity.context

    @property
    def vocab_size(self) -> int:
        return self.capacity.vocab_size

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)


def build_app(engine_loop: EngineLoop, metrics: Metrics, *, model_id: str, model_aliases=(), api_key: str | None = None,
              max_queue: int = 1024, limits: Limits | None = None, responses_store: int = 0) -> FastAPI:
    """Routes over a started `engine_loop`; the app's shutdown stops it."""
    engine = engine_loop.engine
    args = engine.loaded.model.args
    limits = limits or Limits()
    cap = Capacity(getattr(args, "max_position_embeddings", None), args.vocab_size, engine.num_blocks,
                   engine.config.block_size, max_token_chars(engine.tokenizer))
    # One tokenizer thread: HF tokenizers are not safe to call from several threads at once.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxpaged-tokenize")
    names = frozenset({model_id, *model_aliases})
    state = ServerState(engine_loop, metrics, model_id, names, max_queue, limits, cap, pool, responses_store)
    text_of = TokenText(engine.tokenizer)

    @asynccontextmanager
    async def lifespan(app):
        asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
        try:
            yield
        finally:  # after uvicorn's graceful shutdown: abort what is still running
            engine_loop.stop()
            pool.shutdown(wait=False, cancel_futures=True)

    docs = limits.enable_docs
    app = FastAPI(title="mlxpaged", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.server = state
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes,
                       open_paths=frozenset({"/health", *(DOCS_PATHS if docs else ())}),
                       draining=lambda: engine_loop.draining)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return ErrorResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return _validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return ErrorResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    v1 = APIRouter(prefix="/v1")

    @app.get("/health")
    async def health():
        if engine_loop.draining:  # load balancers stop sending here; running requests finish
            return JSONResponse({"status": "draining", "steps": engine_loop.steps}, status_code=503)
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
        texts = body.prompts()
        if not texts:
            raise APIError(400, "prompt is empty", param="prompt")
        check_request(limits, cap, body, len(texts), body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, max_queue)
        for p in texts:
            if isinstance(p, str):
                check_chars(cap, len(p), "prompt")
        prompts = await state.off_loop(lambda: [encode_prompt(engine.tokenizer, p, cap.vocab_size) for p in texts])
        max_tokens = body.max_tokens or default_max_tokens(cap, DEFAULT_COMPLETION_MAX_TOKENS,
                                                           max(map(len, prompts)), body.n)
        for ids in prompts:
            check_context(len(ids), max_tokens, cap.context)
        params = _params(body, max_tokens, body.logprobs, cap.vocab_size)
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
        requested = body.requested_max_tokens()
        check_request(limits, cap, body, 1, requested or 1, max_queue)
        check_chars(cap, sum(len(m["content"]) for m in messages), "messages")
        ids = await state.off_loop(encode_messages, engine.tokenizer, messages, plan.tools)
        max_tokens = requested or default_max_tokens(cap, DEFAULT_CHAT_MAX_TOKENS, len(ids), body.n)
        check_request(limits, cap, body, 1, max_tokens, max_queue)
        check_context(len(ids), max_tokens, cap.context)
        params = _params(body, max_tokens, body.logprobs_k(), cap.vocab_size, guided=plan.guided)
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
    errs = exc.errors() or [{"loc": (), "msg": "invalid request", "type": ""}]
    # Of a union's failed members, the one that says what is wrong with the value, not "wrong type".
    err = next((e for e in errs if e.get("type") in ("value_error", "unimplemented")), errs[0])
    # pydantic names validator wrappers in the path ("function-after[...]"): not a field, dropped
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and "[" not in str(x)]
    if err.get("type") == "json_invalid":
        msg, param = f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}", None
    elif err.get("type") == "missing" and not loc:
        msg, param = "the request needs a JSON object body", None
    elif err.get("type") == "unimplemented":  # a known OpenAI field this server does not implement
        field = err["ctx"]["field"]
        msg, param = f"{field}: this server does not implement '{field}'; leave it out", field
    else:
        # The top-level field is the param; deeper parts (list indices, union members) stay in the message.
        param = loc[0] if loc else None
        msg = f"{'.'.join(loc) if loc else 'body'}: {err['msg']}"
    return ErrorResponse(error_body(400, msg.replace("\n", " "), param=param), status_code=400)


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_aliases:
        raise APIError(404, f"unknown model '{model}': this server serves '{state.model_id}'", param="model",
                       code="model_not_found")


def _params(body, max_tokens: int, logprobs: int | None, vocab_size: int | None = None, **extra):
    try:
        return body.to_sampling_params(max_tokens, logprobs, vocab_size, **extra)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=str(e).split(" ", 1)[0] if " must " in str(e) else None) from None


def _server_error(item: BaseException) -> APIError:
    if isinstance(item, StepError):
        return APIError(500, f"{item}", code="engine_step_failed")
    if isinstance(item, ClientTooSlow):
        return APIError(408, str(item), code="client_too_slow")
    return APIError(503 if isinstance(item, EngineDown) else 500, str(item))


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Job:
    """The engine requests behind one HTTP request: one per prompt, ids `{resp_id}-{i}`."""

    def __init__(self, state: ServerState, resp_id: str, rids: list[str], sink: Sink, params):
        self.state, self.resp_id, self.rids, self.sink, self.params = state, resp_id, rids, sink, params
        self.final: dict = {}

    @classmethod
    async def start(cls, state: ServerState, prefix: str, prompts: list[list[int]], params,
                    guided_param: str | None = None) -> _Job:
        """`guided_param`: the request field a grammar the engine cannot compile is blamed on."""
        el = state.engine_loop
        waiting = el.snapshot.get("requests_waiting", 0) + el.pending
        if waiting + len(prompts) > state.max_queue:
            raise APIError(503, f"server busy: {waiting} requests waiting (--max-queue {state.max_queue}); retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        resp_id = f"{prefix}-{uuid.uuid4().hex}"
        sink = Sink(asyncio.get_running_loop())
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
        return cls(state, resp_id, rids, sink, params)

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
        # the stops' KMP tables, once for all samples and off the loop (64 stops of 1,500 characters: 0.1 s)
        borders = await self.state.off_loop(stop_borders, self.params.stop) if self.params.stop else []
        extra = {"usage": None} if include_usage else {}
        sent = 0
        try:
            failed = False
            while len(self.final) < len(self.rids) and not failed:
                for rid, item in await self.sink.get():
                    if isinstance(item, BaseException):
                        self.final[rid] = None
                        yield _sse(_server_error(item).body())
                        failed = True
                        break
                    for c in item.outputs:
                        st = streams.setdefault((rid, c.index), ChoiceStream(self.params.stop, borders))
                        d = st.advance(c)
                        choice = make_choice(self.index(rid, c.index), *d, st) if d is not None else None
                        if choice is not None:  # None: the route holds the delta back (a tool call in progress)
                            yield _sse(envelope(self.resp_id, kind, model, choices=[choice], **extra))
                            sent += 1
                            if sent % YIELD_EVERY == 0:  # many choices or a backlog: let other requests run
                                await asyncio.sleep(0)
                    if item.finished:
                        self.final[rid] = item
            if not failed:
                if include_usage:
                    yield _sse(envelope(self.resp_id, kind, model, choices=[], usage=usage(list(self.final.values()))))
            yield "data: [DONE]\n\n"
        finally:
            self._abort_unfinished()
