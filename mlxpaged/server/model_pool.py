"""Several models in one server: each loaded when a request names it, unloaded when idle.

`ModelPool` owns the served models (`Served`: its names and checkpoint, and while loaded its own
`EngineLoop`, engine thread, KV pool and routes). A request reaches a model through `ModelRouter`,
an ASGI middleware: it reads the body's `model` (Ollama's `/api/show`: `name` too), has the pool
`acquire` that model (loading it if needed) and hands the request to the model's own app (the
routes `build_app` makes for one model), then `release`s it when the response has ended, streams
included. The listing routes (`/v1/models`, `/api/tags`, `/api/ps`, `/health`, `/metrics`, the web
page) are the server's own.

Invariants:
- A model is unloaded only while no request holds it (`in_flight == 0`): an eviction or a
  keep-alive expiry picks idle models only, and a request for a model being unloaded waits for the
  unload, then loads it again.
- Loads run one at a time, in a worker thread (never on the event loop); before a load, and after
  it with the model's measured size, the least recently used idle models are unloaded until the
  loaded models' bytes (weights plus each KV pool's cap) fit `max_bytes` and their count fits
  `max_loaded`. A load never waits on a request of another model: each model has its own engine
  thread, so one model's prefill never holds up another's steps.
- A model that fails to load answers its requests with the reason (500) and stays unloaded; the
  others keep serving. The next request naming it tries again.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from .middleware import error_bytes

log = logging.getLogger("mlxpaged.server")
DEFAULT_KEEP_ALIVE = 300.0  # seconds, as Ollama's OLLAMA_KEEP_ALIVE
DEFAULT_MAX_LOADED = 3  # as Ollama's OLLAMA_MAX_LOADED_MODELS (per GPU)
DEFAULT_MEMORY_FRACTION = 0.75
BIG_BODY = 1 << 20  # bodies above this are parsed off the event loop
UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def total_memory() -> int:
    import os

    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_budget(text: str | None) -> int:
    """`--max-memory`: a fraction of the RAM (a number up to 1: 0.75) or an amount ("12GB", "500MiB")."""
    if text is None:
        return int(DEFAULT_MEMORY_FRACTION * total_memory())
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"--max-memory: '{text}' is neither a fraction of the RAM (0.75) nor an amount (12GB, 500MiB)")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not unit:
        if not 0 < value <= 1:
            raise ValueError(
                f"--max-memory: {text} is not a fraction of the RAM in (0, 1]; give a unit for an amount (12GB)"
            )
        return int(value * total_memory())
    if value <= 0:
        raise ValueError(f"--max-memory: {text} is not a positive amount")
    return int(value * UNITS[unit])


def duration_seconds(value) -> float | None:
    """Ollama's `keep_alive`: seconds (a number or its text) or a Go duration ("5m", "1h30m");
    negative: forever (math.inf). None for a value that is not a duration (the route refuses it)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = DURATION_PART.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                return None
            seconds = sign * sum(float(n) * DURATION_UNITS[u] for n, u in parts)
    else:
        return None
    return math.inf if seconds < 0 else seconds


def served_name(model: str) -> str:
    """A checkpoint's folder or file name: a served name never shows this machine's paths. A hub
    repo id (not a local path) is its own name."""
    local = Path(model).expanduser()
    return local.resolve().name if local.exists() else model


@dataclass(frozen=True)
class ModelSpec:
    """One `--model` value: `NAME=PATH_OR_REPO`, or `PATH_OR_REPO` named by its folder (or repo id)."""

    name: str
    source: str

    @classmethod
    def parse(cls, value: str) -> ModelSpec:
        name, eq, source = value.partition("=")
        if eq and name and "/" not in name and not Path(value).expanduser().exists():
            if not source:
                raise ValueError(f"--model {value}: no checkpoint after '{name}='")
            return cls(name, source)
        return cls(served_name(value), value)


@dataclass
class Served:
    """One served model. Invariant: `loop` and `app` are set exactly while `state` is "loaded";
    `task` is the load or unload under way (None when none is)."""

    spec: ModelSpec
    names: frozenset[str]
    state: str = "unloaded"  # unloaded, loading, loaded, unloading
    loop: object = None  # its EngineLoop while loaded
    app: object = None  # its routes (build_app) while loaded
    card: object = None  # its ModelCard, kept from its first load
    nbytes: int = 0  # weights + KV pool cap, measured at its last load (0: never loaded)
    in_flight: int = 0
    last_used: float = 0.0
    expires: float = math.inf  # monotonic time its keep-alive ends (inf: never)
    timer: object = None  # the asyncio handle of that expiry
    task: asyncio.Task | None = None
    error: str | None = None  # why its last load failed

    @property
    def name(self) -> str:
        return self.spec.name


class ModelFailed(Exception):
    """A model could not be loaded (or cannot fit): its requests get `status` and this message."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code


class ModelPool:
    """The served models, loaded on demand under one memory budget and count cap (module doc)."""

    def __init__(
        self, specs: list[ModelSpec], build, close=None, *, max_bytes: int, max_loaded: int, keep_alive: float
    ):
        """`build(spec) -> (engine_loop, app, card, nbytes)` loads a model and makes its routes, its
        `ModelCard` and its footprint in bytes; `close(engine_loop, app)` ends them (`close_model`).
        Worker threads run both."""
        self.models: list[Served] = []
        seen: dict[str, str] = {}
        for spec in specs:
            names = frozenset({spec.name, spec.source})
            for n in names:
                if n in seen and seen[n] != spec.source:
                    raise ValueError(f"--model: the name '{n}' names two models ({seen[n]}, {spec.source})")
                seen[n] = spec.source
            self.models.append(Served(spec, names))
        self._build, self._close = build, close or close_model
        self.max_bytes, self.max_loaded, self.keep_alive = max_bytes, max_loaded, keep_alive
        self._load_lock: asyncio.Lock | None = None
        self._idle: asyncio.Condition | None = None
        self.draining = False

    @property
    def default(self) -> Served:
        return self.models[0]

    def find(self, name: str | None) -> Served | None:
        if name is None:
            return self.default
        for s in self.models:
            if name in s.names:
                return s
        if name.endswith(":latest"):  # Ollama's default tag
            return self.find(name[: -len(":latest")])
        return None

    def names(self) -> str:
        return ", ".join(f"'{s.name}'" for s in self.models)

    def loaded(self) -> list[Served]:
        return [s for s in self.models if s.state == "loaded"]

    @property
    def busy(self) -> bool:
        return any(s.in_flight or (s.loop is not None and s.loop.busy) for s in self.models)

    def _sync(self) -> None:
        if self._load_lock is None:  # made on the serving event loop
            self._load_lock, self._idle = asyncio.Lock(), asyncio.Condition()

    # -- start-up (before the event loop runs) --------------------------------------------------
    def load_now(self, served: Served) -> None:
        """Load a model on this thread (start-up: the first model, whose failure ends the server)."""
        self._loaded(served, *self._build(served.spec))

    def _loaded(self, served: Served, loop, app, card, nbytes: int) -> None:
        served.loop, served.app, served.state, served.error, served.card = loop, app, "loaded", None, card
        served.nbytes = nbytes
        served.last_used = time.monotonic()
        log.info("loaded model %s (%.3f GB with its KV pool)", served.name, served.nbytes / 1e9)

    # -- requests -------------------------------------------------------------------------------
    async def acquire(self, served: Served) -> Served:
        """`served`, loaded, held by one more request until `release`; `ModelFailed` if it cannot load."""
        self._sync()
        while True:
            if self.draining:
                raise ModelFailed(503, "the server is shutting down", "server_shutting_down")
            if served.state == "loaded":
                served.in_flight += 1
                served.last_used = time.monotonic()
                self._cancel_timer(served)
                return served
            if served.task is None:
                served.task = asyncio.get_running_loop().create_task(self._load(served))
            task = served.task
            try:
                await asyncio.shield(task)
            except ModelFailed:
                if served.state != "loaded":
                    raise

    def release(self, served: Served, keep_alive: float | None = None) -> None:
        """A request ended; an idle model's keep-alive (the request's, else the server's) starts now."""
        served.in_flight -= 1
        served.last_used = time.monotonic()
        if served.in_flight:
            return
        seconds = self.keep_alive if keep_alive is None else keep_alive
        self._cancel_timer(served)
        served.expires = served.last_used + seconds
        loop = asyncio.get_running_loop()
        if seconds <= 0:
            loop.call_soon(self._expire, served)
        elif seconds < math.inf:
            served.timer = loop.call_later(seconds, self._expire, served)
        loop.create_task(self._notify_idle())

    async def _notify_idle(self) -> None:
        async with self._idle:
            self._idle.notify_all()

    def _cancel_timer(self, served: Served) -> None:
        if served.timer is not None:
            served.timer.cancel()
            served.timer = None
        served.expires = math.inf

    def _expire(self, served: Served) -> None:
        served.timer = None
        if served.state == "loaded" and not served.in_flight and served.task is None:
            served.task = asyncio.get_running_loop().create_task(self._unload(served, "idle past its keep-alive"))

    # -- loading and unloading --------------------------------------------------------------------
    async def _load(self, served: Served) -> None:
        try:
            async with self._load_lock:
                need = served.nbytes or estimate(served.spec)
                if need > self.max_bytes:
                    raise ModelFailed(
                        503,
                        f"model '{served.name}' needs {need / 1e9:.3f} GB, more than the memory budget "
                        f"({self.max_bytes / 1e9:.3f} GB, --max-memory)",
                        "model_too_large",
                    )
                await self._make_room(need, served)
                served.state = "loading"
                log.info("loading model %s (%s)", served.name, served.spec.source)
                started = time.monotonic()
                try:
                    built = await asyncio.to_thread(self._build, served.spec)
                except BaseException as e:
                    served.state = "unloaded"
                    served.error = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
                    # a refused checkpoint says why in one line; anything else is a bug: its traceback
                    log.error(
                        "model %s failed to load: %s", served.name, served.error, exc_info=not isinstance(e, ValueError)
                    )
                    raise ModelFailed(
                        500, f"model '{served.name}' failed to load: {served.error}", "model_load_failed"
                    ) from None
                self._loaded(served, *built)
                log.info("model %s took %.1f s to load", served.name, time.monotonic() - started)
                await self._make_room(0, served)  # its measured size may be more than the estimate
        finally:
            served.task = None

    async def _make_room(self, need: int, keep: Served) -> None:
        """Unload the least recently used idle models until `need` more bytes (and one more model) fit."""
        while True:
            others = [s for s in self.loaded() if s is not keep]
            used = sum(s.nbytes for s in others)
            count = len(others) + 1
            if (
                used + need + (keep.nbytes if keep.state == "loaded" else 0) <= self.max_bytes
                and count <= self.max_loaded
            ):
                return
            idle = [s for s in others if not s.in_flight and s.task is None]
            if idle:
                victim = min(idle, key=lambda s: s.last_used)
                victim.task = asyncio.get_running_loop().create_task(
                    self._unload(victim, f"to make room for {keep.name}")
                )
                await victim.task
                continue
            if keep.state == "loaded":  # loaded already, over the budget while the others are busy
                log.warning("models over the memory budget until one of them is idle")
                return
            async with self._idle:  # every loaded model is answering: wait until one is idle
                await self._idle.wait()

    async def _unload(self, served: Served, why: str) -> None:
        try:
            served.state = "unloading"
            self._cancel_timer(served)
            loop, app = served.loop, served.app
            served.loop = served.app = None
            await asyncio.to_thread(self._close, loop, app)
            served.state = "unloaded"
            log.info("unloaded model %s (%s)", served.name, why)
        finally:
            served.task = None

    # -- shutdown ---------------------------------------------------------------------------------
    def drain(self, timeout: float) -> None:
        self.draining = True
        for s in self.models:
            if s.loop is not None:
                s.loop.drain(timeout)

    def stop(self) -> None:
        for s in self.models:
            if s.loop is not None:
                self._close(s.loop, s.app)
                s.loop = s.app = None
                s.state = "unloaded"


def close_model(loop, app) -> None:
    """End a model's engine thread and its app's threads (what its lifespan would do)."""
    loop.stop()
    state = app.state.server
    state.tokenize_pool.shutdown(wait=False, cancel_futures=True)
    if state.grammars is not None:
        state.grammars.close()
    del loop, app, state
    gc.collect()
    import mlx.core as mx

    mx.clear_cache()


def footprint(engine) -> int:
    """A loaded model's bytes: its weights and its KV pool at the most it may grow to."""
    from ..engine.encoder import EncoderEngine
    from .models_api import memory_bytes

    if isinstance(engine, EncoderEngine):  # no KV pool
        return memory_bytes(engine.loaded.model)
    bs = engine.config.cache.block_size
    kv = max(engine.max_blocks * engine.kv_cache.shape.bytes_per_block(bs), engine.kv_cache.nbytes)
    return memory_bytes(engine.loaded.model) + kv


def estimate(spec: ModelSpec) -> int:
    """A never-loaded model's bytes before loading it: its weight files' size (0 when not local)."""
    path = Path(spec.source).expanduser()
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return 0


# -- HTTP -----------------------------------------------------------------------------------------
def model_of(body: bytes, path: str) -> tuple[object, object]:
    """(the body's model name, its Ollama keep_alive); (None, None) for a body that is not a JSON object."""
    try:
        obj = json.loads(body) if body else None
    except (ValueError, RecursionError):
        return None, None
    if not isinstance(obj, dict):
        return None, None
    model = obj.get("model")
    if model is None and path == "/api/show":
        model = obj.get("name")
    return model, obj.get("keep_alive") if path.startswith("/api/") else None


class ModelRouter:
    """ASGI middleware: a request on a model's route goes to the app of the model its body names
    (the first model when it names none), loaded for it; the server's own routes stay here."""

    def __init__(self, app, *, pool: ModelPool, own_routes, model_routes):
        self.app, self.pool, self.own_routes, self.model_routes = app, pool, own_routes, model_routes

    def _for_model(self, scope) -> bool:
        from starlette.routing import Match

        if any(r.matches(scope)[0] != Match.NONE for r in self.own_routes()):
            return False
        return any(r.matches(scope)[0] != Match.NONE for r in self.model_routes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self._for_model(scope):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        body, first = b"", None
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            first = await receive()  # the guard read the whole body: one message
            body = first.get("body", b"")
        parse = (lambda: model_of(body, path)) if len(body) <= BIG_BODY else None
        name, keep = parse() if parse else await asyncio.to_thread(model_of, body, path)
        served = self.pool.find(name if isinstance(name, str) and name else None)
        if served is None:
            return await _error(
                send, 404, f"unknown model '{name}': this server serves {self.pool.names()}", "model_not_found", path
            )
        try:
            await self.pool.acquire(served)
        except ModelFailed as e:
            return await _error(send, e.status, str(e), e.code, path)
        replayed = first is None

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        try:
            await served.app(scope, replay, send)
        finally:
            self.pool.release(served, duration_seconds(keep))


async def _error(send, status: int, message: str, code: str, path: str) -> None:
    body = error_bytes(status, message, param="model" if status == 404 else None, code=code, path=path)
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


def iso_in(seconds: float) -> str:
    """An Ollama `expires_at` `seconds` from now."""
    from .ollama_api import NEVER

    if seconds == math.inf:
        return NEVER
    return datetime.fromtimestamp(time.time() + max(0.0, seconds), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
