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
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .anthropic_api import register_anthropic
from .connections import AcceptErrorLog
from .engine_loop import EngineLoop
from .errors import APIError, error_body
from .guided_request import chat_plan
from .jobs import Job, ServerState, check_model, sampling_params
from .limits import Capacity, Limits, check_chars, check_request, default_max_tokens, max_token_chars
from .metrics import CONTENT_TYPE, Metrics
from .middleware import Guard
from .prompts import check_context, encode_messages, encode_prompt
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import ChoiceStream, TokenText, chat_logprobs, completion_logprobs, envelope, usage
from .responses_api import register_responses
from .tools import ToolCallStream, chat_message, stream_tool_delta
from .web import OPEN_PATHS as WEB_PATHS
from .web import register_web

DEFAULT_CHAT_MAX_TOKENS = 1024  # when a chat body gives neither max_tokens nor max_completion_tokens
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class ErrorResponse(JSONResponse):
    """An error object, ASCII-escaped: a message quoting client text with a lone surrogate still encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def build_app(
    engine_loop: EngineLoop,
    metrics: Metrics,
    *,
    model_id: str,
    model_aliases=(),
    api_key: str | None = None,
    max_queue: int = 1024,
    limits: Limits | None = None,
    responses_store: int = 0,
    web: bool = True,
) -> FastAPI:
    """Routes over a started `engine_loop`; the app's shutdown stops it."""
    engine = engine_loop.engine
    args = engine.loaded.model.args
    limits = limits or Limits()
    cap = Capacity(
        getattr(args, "max_position_embeddings", None),
        args.vocab_size,
        engine.num_blocks,
        engine.config.block_size,
        max_token_chars(engine.tokenizer),
    )
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
    app = FastAPI(
        title="mlxpaged",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.server = state
    app.add_middleware(
        Guard,
        api_key=api_key,
        max_body_bytes=limits.max_body_bytes,
        open_paths=frozenset({"/health", *(DOCS_PATHS if docs else ()), *(WEB_PATHS if web else ())}),
        draining=lambda: engine_loop.draining,
    )

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
        return {
            "object": "list",
            "data": [{"id": state.model_id, "object": "model", "created": 0, "owned_by": "mlxpaged"}],
        }

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(state, body.model)
        texts = body.prompts()
        if not texts:
            raise APIError(400, "prompt is empty", param="prompt")
        check_request(limits, cap, body, len(texts), body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, max_queue)
        for p in texts:
            if isinstance(p, str):
                check_chars(cap, len(p), "prompt")
        prompts = await state.off_loop(lambda: [encode_prompt(engine.tokenizer, p, cap.vocab_size) for p in texts])
        max_tokens = body.max_tokens or default_max_tokens(
            cap, DEFAULT_COMPLETION_MAX_TOKENS, max(map(len, prompts)), body.n
        )
        for ids in prompts:
            check_context(len(ids), max_tokens, cap.context)
        params = sampling_params(body, max_tokens, body.logprobs, cap.vocab_size)
        job = await Job.start(state, "cmpl", prompts, params)

        def choice(index, text, lps, finish, stream: ChoiceStream):
            lp = completion_logprobs(lps, text_of) if lps is not None else None
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

        if body.stream:
            return job.stream(request, "text_completion", state.model_id, choice, body.include_usage)
        outs = await job.collect(request)
        choices = [
            choice(job.index(o.request_id, c.index), c.text, getattr(c, "logprobs", None), c.finish_reason, None)
            for o in outs
            for c in o.outputs
        ]
        return envelope(job.resp_id, "text_completion", state.model_id, choices=choices, usage=usage(outs))

    @v1.post("/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(state, body.model)
        messages, plan = chat_plan(body)  # tools, tool_choice and response_format (guided_request.py)
        requested = body.requested_max_tokens()
        check_request(limits, cap, body, 1, requested or 1, max_queue)
        check_chars(cap, sum(len(m["content"]) for m in messages), "messages")
        ids = await state.off_loop(encode_messages, engine.tokenizer, messages, plan.tools)
        max_tokens = requested or default_max_tokens(cap, DEFAULT_CHAT_MAX_TOKENS, len(ids), body.n)
        check_request(limits, cap, body, 1, max_tokens, max_queue)
        check_context(len(ids), max_tokens, cap.context)
        params = sampling_params(body, max_tokens, body.logprobs_k(), cap.vocab_size, guided=plan.guided)
        job = await Job.start(state, "chatcmpl", [ids], params, plan.param)

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
        choices = [
            {
                "index": c.index,
                "message": msg,
                "logprobs": chat_logprobs(c.logprobs, text_of) if getattr(c, "logprobs", None) is not None else None,
                "finish_reason": finish,
            }
            for o in outs
            for c in o.outputs
            for msg, finish in [chat_message(c.text, c.finish_reason, plan.parse)]
        ]  # tools.py: parsed calls
        return envelope(job.resp_id, "chat.completion", state.model_id, choices=choices, usage=usage(outs))

    register_responses(v1, state, text_of)
    app.include_router(v1)
    register_anthropic(app, state)
    if web:  # the page and its cache view (web.py); --no-web leaves them out
        register_web(app, engine_loop)
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
