"""The FastAPI app: OpenAI routes over an `EngineLoop`, every failure as one OpenAI error object.

Before any route, `BrowserGuard` (middleware.py) refuses a foreign `Host` or `Origin` (CORS, off by
default, answers the allowed origins), then `Guard` checks draining, the API key, the body size and
its JSON content type, and turns an unhandled exception into a 500 error object. A route validates
its body, checks the limits that need no tokenizing (limits.py), tokenizes on the tokenizer thread
(never on the event loop), submits one engine request per prompt (each with the body's `n` samples)
and waits for the engine to accept them, so a request that cannot fit in the pool is a 400 before
any stream starts. It then reads the newest output of each of its requests from its `Sink`. Whatever
ends a route early (a disconnect, a cancelled stream, an error) aborts the engine requests it still
owns, in a `finally`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.encoder import EncoderEngine
from .anthropic_api import register_anthropic
from .connections import AcceptErrorLog
from .embeddings_api import register_embeddings
from .engine_loop import EngineLoop
from .errors import APIError, error_body
from .guided_request import GrammarGate
from .jobs import ErrorResponse, ServerState
from .limits import Capacity, Limits, max_token_chars
from .metrics import CONTENT_TYPE, Metrics
from .middleware import AccessLog, BrowserGuard, Browsers, Guard, error_bytes
from .models_api import register_models, served_catalog
from .ollama_api import register_ollama
from .openai_api import register_openai
from .openai_format import TokenText
from .reasoning import ThinkMarkers
from .responses_api import register_responses
from .tokenize_api import register_tokenize
from .tools import CallMarkers, ToolFormat
from .web import OPEN_PATHS as WEB_PATHS
from .web import register_web

log = logging.getLogger("mlxpaged.server")
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


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
    browsers: Browsers | None = None,
    max_web_viewers: int = 8,
    guarded: bool = True,
) -> FastAPI:
    """Routes over a started `engine_loop`; the app's shutdown stops it. `browsers`: the Host and
    Origin policy (`serve` passes `Browsers.of` its bound address and flags; the default answers
    any Host, as in-process test clients need, and no other origin). `guarded=False`: one model's
    routes inside a server of several (`build_pool_app`), whose own guards run first."""
    engine = engine_loop.engine
    encoder = isinstance(engine, EncoderEngine)  # it generates nothing: no tools, thinking, grammars or cache view
    limits = limits or Limits()
    browsers = browsers or Browsers()
    if encoder:  # no KV pool: an input's positions are its only bound (one "block" a token)
        ctx = engine.loaded.context
        cap = Capacity(ctx, engine.loaded.config["vocab_size"], ctx, 1, max_token_chars(engine.tokenizer))
    else:
        args = engine.loaded.model.args
        cap = Capacity(
            getattr(args, "max_position_embeddings", None),
            args.vocab_size,
            engine.max_blocks,
            engine.config.cache.block_size,
            max_token_chars(engine.tokenizer),
        )
    # One tokenizer thread: HF tokenizers are not safe to call from several threads at once.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxpaged-tokenize")
    names = frozenset({model_id, *model_aliases})
    markers, tool_format = (
        (None, None) if encoder else (CallMarkers.of(engine.tokenizer), ToolFormat.of(engine.tokenizer))
    )
    if tool_format is None and not encoder:
        log.warning("tool calls: mlx-lm has no tool-call parser for this checkpoint; they are served as text")
    elif tool_format is not None and not tool_format.forcible:
        log.warning("tool calls: mlx-lm's '%s' parser; tool_choice required or named is refused", tool_format.name)
    state = ServerState(
        engine_loop, metrics, model_id, names, max_queue, limits, cap, pool, responses_store, markers, tool_format
    )
    if not encoder:
        state.think = ThinkMarkers.of(engine.tokenizer)
        state.grammars = GrammarGate(engine.grammar_compiler)  # builds llguidance's tokenizer now, on its thread
    text_of = TokenText(engine.tokenizer)

    def stop():
        engine_loop.stop()
        pool.shutdown(wait=False, cancel_futures=True)
        if state.grammars is not None:
            state.grammars.close()

    app = _fastapi(limits, stop)
    app.state.server = state
    if guarded:
        _guard(app, api_key, limits, browsers, web, lambda: engine_loop.draining)
    _error_handlers(app)
    started = int(time.time())

    v1 = APIRouter(prefix="/v1")

    @app.get("/health")
    async def health():
        if engine_loop.draining:  # load balancers stop sending here; running requests finish
            return JSONResponse({"status": "draining", "steps": engine_loop.steps}, status_code=503)
        return {"status": "ok", "steps": engine_loop.steps}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    register_embeddings(v1, state, engine.loaded.path, engine.loaded.config)  # and /v1/rerank; sets state.pooling
    catalog = served_catalog(state, started)  # the served models (models_api.py)
    register_models(v1, catalog)
    register_openai(v1, state, text_of)
    register_responses(v1, state, text_of)
    app.include_router(v1)
    register_anthropic(app, state)
    register_ollama(app, state, catalog)  # Ollama's /api/... (ollama_api.py)
    register_tokenize(app, state)  # at the root, as vLLM serves them
    if web and not encoder:  # the page and its cache view (web.py); --no-web leaves them out
        register_web(app, engine_loop, max_viewers=max_web_viewers)
    return app


def _guard(app: FastAPI, api_key, limits: Limits, browsers: Browsers, web: bool, draining) -> None:
    """The middlewares every request passes, outermost last: access log, Host/Origin, CORS, Guard."""
    docs = limits.enable_docs
    app.add_middleware(
        Guard,
        api_key=api_key,
        max_body_bytes=limits.max_body_bytes,
        open_paths=frozenset({"/health", *(DOCS_PATHS if docs else ()), *(WEB_PATHS if web else ())}),
        draining=draining,
    )
    if browsers.cors:  # inside BrowserGuard: only allowed origins get here; preflights need no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=browsers.cors,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
            expose_headers=["x-mlxpaged-max-tokens-clamped", "retry-after"],
            max_age=600,
        )
    app.add_middleware(BrowserGuard, browsers=browsers)
    app.add_middleware(AccessLog)  # added last: outermost, so it sees the guards' refusals too


def _fastapi(limits: Limits, stop) -> FastAPI:
    """A FastAPI app with /docs only when asked for, whose lifespan calls `stop` after uvicorn's
    graceful shutdown (to abort what is still running)."""

    @asynccontextmanager
    async def lifespan(app):
        asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
        try:
            yield
        finally:
            stop()

    docs = limits.enable_docs
    return FastAPI(
        title="mlxpaged",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return ErrorResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return _validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):  # 404, 405: in the error shape of the path's protocol
        body = error_bytes(exc.status_code, str(exc.detail), path=request.url.path)
        return Response(body, status_code=exc.status_code, media_type="application/json", headers=exc.headers)


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


def build_pool_app(
    pool,
    metrics: Metrics,
    *,
    api_key: str | None = None,
    limits: Limits | None = None,
    web: bool = True,
    browsers: Browsers | None = None,
    max_web_viewers: int = 8,
) -> FastAPI:
    """A server of several models (model_pool.py): its guards, its listing routes over every served
    model, and `ModelRouter`, which hands every other route to the app of the model a request names.
    The pool's first model is loaded; the web page's cache view and /metrics' gauges show it."""
    from .model_pool import ModelRouter, iso_in
    from .ollama_api import details, iso

    limits = limits or Limits()
    browsers = browsers or Browsers()
    first = pool.default
    started = int(time.time())

    app = _fastapi(limits, pool.stop)
    # innermost, after the guards: a route of this app is served here, another of a model's goes to that model
    app.add_middleware(
        ModelRouter, pool=pool, own_routes=lambda: app.router.routes, model_routes=first.app.router.routes
    )
    _guard(app, api_key, limits, browsers, web, lambda: pool.draining)
    _error_handlers(app)

    def described(s) -> dict:
        if s.card is not None:
            return s.card.openai()
        from ..loading.catalog import describe

        path = Path(s.spec.source).expanduser()
        context = describe(path).context if path.is_dir() else None
        return {"id": s.name, "object": "model", "created": started, "owned_by": "mlxpaged", "max_model_len": context}

    @app.get("/health")
    async def health():
        steps = sum(s.loop.steps for s in pool.loaded())
        if pool.draining:
            return JSONResponse({"status": "draining", "steps": steps}, status_code=503)
        return {"status": "ok", "steps": steps}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [described(s) for s in pool.models]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        s = pool.find(model_id)
        if s is None:
            raise APIError(
                404,
                f"unknown model '{model_id}': this server serves {pool.names()}",
                param="model",
                code="model_not_found",
            )
        return described(s)

    @app.get("/api/version")
    async def version():
        from ..version import __version__

        return {"version": __version__}

    @app.get("/api/tags")
    async def tags():
        out = []
        for s in pool.models:
            entry = {"name": s.name, "model": s.name}
            if s.card is not None:
                c = s.card
                entry |= {
                    "modified_at": iso(c.modified),
                    "size": c.info.size_bytes,
                    "digest": c.digest,
                    "details": details(c),
                }
            out.append(entry)
        return {"models": out}

    @app.get("/api/ps")
    async def ps():
        import mlx.core as mx

        on_gpu = mx.default_device() == mx.gpu
        now = time.monotonic()
        return {
            "models": [
                {
                    "name": s.name,
                    "model": s.name,
                    "size": s.nbytes,
                    "digest": s.card.digest,
                    "details": details(s.card),
                    "expires_at": iso_in(s.expires - now),
                    "size_vram": s.nbytes if on_gpu else 0,  # Apple silicon: the GPU's memory is the RAM
                    "context_length": s.card.context,
                }
                for s in pool.loaded()
            ]
        }

    if web and not isinstance(first.loop.engine, EncoderEngine):  # the page chats with the first model
        register_web(app, first.loop, max_viewers=max_web_viewers)
    return app
