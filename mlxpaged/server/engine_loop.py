"""The one thread that owns an engine (a `Backend`: `LLMEngine`, or an encoder's `EncoderEngine`)
and drives `step()`; HTTP handlers talk to it by queue, and read their outputs from a `Sink` (one
output per request: unread deltas are added up, so a slow reader holds one and loses nothing).

Invariants:
- Only this thread calls the engine (`add_request`, `step`, `abort_request`, `metrics`), and it
  builds the engine itself: MLX streams are per thread, so arrays the engine creates lazily
  must belong to the thread that evaluates them.
- Submissions and aborts queued by any thread are applied between two steps, adds first, so a
  new request joins the batch at the next step and an abort frees its blocks before it.
- Every accepted request gets outputs on its sink until exactly one terminal item: a finished
  `RequestOutput`, or an exception (`StepError`, `EngineDown`, `ClientTooSlow`). An aborted
  request gets nothing more. A request whose reader stays behind for `stall_timeout` seconds is
  aborted here, its blocks freed, and gets `ClientTooSlow`.
- With nothing queued and nothing unfinished the thread sleeps on a condition; it never spins.
  Before it sleeps it empties MLX's buffer cache (and trims glibc's heap), so an idle server's resident memory returns
  to the weights plus the KV pool, however varied the shapes it served. A growing KV pool is trimmed
  (`LLMEngine.trim_pool`, which evicts cached blocks beyond its starting size) only once the engine
  has stayed idle for `idle_trim_s` seconds: an agent's next turn comes seconds after its last one,
  while its tool runs, and must find its conversation's blocks still cached.
- Tensor parallel (`group` given, rank 0): before each step, and at least every `HEARTBEAT` s
  when idle, the step's engine calls (drain aborts, adds, aborts) go to the other ranks with
  `broadcast_json`; they replay them in `follow`, so every rank's engine sees the same calls in
  the same order. A broken group (`RankFailure`) ends the process with one line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import dataclasses
import logging
import math
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

from ..engine.pooling import PoolingParams
from ..engine.sampling_params import SamplingParams
from ..errors import MlxPagedError, StepError

log = logging.getLogger("mlxpaged.server")
HEARTBEAT = 1.0  # seconds between two broadcasts of an idle tensor-parallel rank 0


def _trim_heap() -> None:
    """Return free heap pages to the OS (glibc keeps freed CPU buffers in its arenas otherwise)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS): nothing to do
        pass


class EngineDown(RuntimeError):
    """The server is shutting down, or the engine failed outside any one request."""


class ClientTooSlow(RuntimeError):
    """The client read nothing new for longer than the stall limit; its request was aborted."""


class Sink:
    """Where one HTTP request's outputs go: the newest `RequestOutput` (or exception) per request id.

    An unread output is folded into the newer one: a cumulative output is replaced, a delta
    (`RequestOutput.delta`, what the server asks for) is added to (`RequestOutput.add`). Either way
    a slow reader holds one output per request, not one per step, and loses nothing. A terminal
    item is never followed by another (the engine loop forgets the sink's request then).
    `put` and `behind_for` run on the engine thread, `get` on the sink's event loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._latest: dict[str, object] = {}
        self._behind_since: float | None = None  # when an unread output was first superseded
        self._ready = asyncio.Event()

    def put(self, rid: str, item) -> None:
        with self._lock:
            prev = self._latest.get(rid)
            if prev is not None and self._behind_since is None:
                self._behind_since = time.monotonic()
            if getattr(prev, "delta", False) and getattr(item, "delta", False):
                item = prev.add(item)
            self._latest[rid] = item
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the client's event loop is closed: nobody is listening
            pass

    def behind_for(self, now: float) -> float:
        """Seconds the reader has been at least one output behind without catching up (0 if it is not)."""
        with self._lock:
            return 0.0 if self._behind_since is None else now - self._behind_since

    async def get(self, timeout: float | None = None) -> list[tuple[str, object]]:
        """The newest item of every request that has one, waiting until there is at least one
        (or `timeout` seconds: then []). Cancelling it loses nothing: items are taken without an await."""
        while True:
            self._ready.clear()
            with self._lock:
                items, self._latest, self._behind_since = list(self._latest.items()), {}, None
            if items:
                return items
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return []


class Backend(Protocol):
    """What the engine loop, the routes and the admission path use of an engine: `LLMEngine` (the
    paged decoder engine) and `EncoderEngine` (an encoder run by mlx-embeddings: pooled requests
    only) both are one. `loaded` has the checkpoint's `path`, `config`, `model`, `dtype`."""

    tokenizer: object
    loaded: object

    def add_request(self, prompt: list[int], params, request_id: str) -> str: ...
    def step(self) -> list: ...  # the step's RequestOutputs
    def abort_request(self, request_id: str) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def metrics(self) -> dict: ...  # /metrics' gauges and counters
    def trim_pool(self) -> int: ...


@dataclass(frozen=True)
class EngineRequest:
    """One request as the engine takes it (`add_request`), and its explicit wire form: what rank 0
    of a tensor-parallel server sends the other ranks, which rebuild an equal request from it."""

    prompt: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding or a score (engine/pooling.py)
    request_id: str
    images: object = None  # a vision model's processed images (engine/multimodal.py); never on the wire

    def to_wire(self) -> list:
        return [list(self.prompt), self.params.to_wire(), self.request_id]

    @classmethod
    def from_wire(cls, wire: list) -> EngineRequest:
        prompt, params, rid = wire
        kind = PoolingParams if "pooling" in params else SamplingParams
        return cls(list(prompt), kind.from_wire(params), rid)


@dataclass
class _Timing:
    arrival: float
    last: dict[int, float] = field(default_factory=dict)  # sample index -> time of its last token
    tokens: dict[int, int] = field(default_factory=dict)  # sample index -> tokens seen


class EngineLoop:
    """Drives one `Backend`. `submit` and `abort` from any thread; `snapshot` is the engine's
    metrics after the last step.

    `observer`, if given, has `first_token(seconds)` and `inter_token(seconds)`: time to first
    token from `submit`, and the gap between two tokens of one sample (a step that yields k
    tokens of one sample counts as k gaps of 1/k each).
    """

    def __init__(
        self,
        make_engine,
        observer=None,
        group=None,
        stall_timeout: float | None = None,
        idle_trim_s: float = 0.0,
    ):
        self._make_engine = make_engine
        self.idle_trim_s = (
            idle_trim_s  # idle this long, a growing KV pool shrinks back (0: at once; serve's --kv-idle-trim)
        )
        self.stall_timeout = stall_timeout  # abort a request whose reader stays behind this long (seconds)
        self._group = group  # an mx.distributed group of > 1 ranks: this is rank 0 of a TP server
        self.engine = None
        self.observer = observer
        self._cv = threading.Condition()
        self._adds: list[tuple] = []
        self._aborts: list[str] = []
        self._stalled: set[str] = set()  # failed for a slow client; the engine abort is queued
        self._sinks: dict[str, Sink] = {}
        self._timing: dict[str, _Timing] = {}
        self._stopping = False
        self._drain_deadline: float | None = None  # set by `drain`: no new requests; abort the rest then
        self._thread = threading.Thread(target=self._run, name="mlxpaged-engine", daemon=True)
        self.steps = 0
        self.snapshot: dict = {}
        self.on_step = None  # (engine, idle) after each iteration, on this thread: the web page's cache view
        self._ready = threading.Event()
        self._start_error: BaseException | None = None

    # -- any thread -------------------------------------------------------------------------------
    def start(self) -> None:
        """Build the engine on the engine thread and start stepping; re-raises a failed build."""
        self._thread.start()
        while not self._ready.wait(0.2):  # a timed wait, so Ctrl-C reaches the main thread
            pass
        if self._start_error is not None:
            raise self._start_error

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything still running (its sinks get `EngineDown`) and end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def drain(self, timeout: float) -> None:
        """Refuse new requests; let running ones finish for `timeout` seconds, then abort them (`EngineDown`)."""
        with self._cv:
            if self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + timeout
            self._cv.notify()

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None or self._stopping

    @property
    def busy(self) -> bool:
        """Requests submitted and not yet finished, failed or aborted."""
        return bool(self._adds or self._sinks)

    @property
    def pending(self) -> int:
        """Submissions not yet handed to the engine."""
        return len(self._adds)

    def submit(
        self, prompt: list[int], params: SamplingParams, rid: str, sink: Sink, images=None
    ) -> concurrent.futures.Future:
        """Queue a request; the future resolves to `rid` once the engine accepted it, or to its
        error. `images`: its processed images (the vision tower runs on the engine thread)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._group is not None and params.seed is None:  # every rank must draw the same samples
            params = dataclasses.replace(params, seed=random.getrandbits(31))
        req = EngineRequest(list(prompt), params, rid, images)
        with self._cv:
            if self._stopping or self._drain_deadline is not None:
                fut.set_exception(EngineDown("the server is shutting down"))
                return fut
            self._adds.append((req, sink, fut, time.perf_counter()))
            self._cv.notify()
        return fut

    def abort(self, rid: str) -> None:
        with self._cv:
            self._aborts.append(rid)
            self._cv.notify()

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._make_engine()
            self.snapshot = self._metrics()
        except BaseException as e:
            self._start_error = e
            return
        finally:
            self._ready.set()
        try:
            self._loop()
        except Exception as e:
            if self._group is None:
                raise
            _die(str(e))  # RankFailure, or a step that failed on this rank only: the ranks cannot go on

    def _loop(self) -> None:
        tp = self._group is not None
        trim_at = None  # when an idle engine's growing KV pool shrinks back; math.inf once it has
        while True:
            if not (self._adds or self._aborts or self.engine.has_unfinished_requests()):
                now = time.monotonic()
                if trim_at is None:  # going idle
                    trim_at = now + self.idle_trim_s
                if now >= trim_at:  # idle long enough: the pool shrinks back (kv_cache.growable_pool)
                    self.engine.trim_pool()
                    trim_at = math.inf
                mx.clear_cache()  # going idle: give freed buffers back (cheap; the next step refills what it needs)
                _trim_heap()
                self.snapshot = self._metrics()
                if self.on_step is not None:
                    self.on_step(self.engine, True)
            else:
                trim_at = None
            with self._cv:
                while not (self._stopping or self._adds or self._aborts or self.engine.has_unfinished_requests()):
                    wait = HEARTBEAT if tp else None if self._drain_deadline is None else 0.5
                    if trim_at is not None and trim_at < math.inf:  # wake to trim, if nothing comes first
                        left = max(0.0, trim_at - time.monotonic())
                        wait = left if wait is None else min(wait, left)
                    self._cv.wait(wait)
                    if tp:
                        break  # an empty broadcast: the other ranks know rank 0 is alive
                    if trim_at is not None and time.monotonic() >= trim_at:
                        break  # the trim is due
                if self._stopping:
                    if tp:
                        self._broadcast([], [], [], stop=True)
                    break
                drained = []
                if self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
                    drained = list(self._sinks)
                    self._abort_all("the server is shutting down")
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            if tp:
                self._broadcast(drained, adds, aborts)
            for item in adds:
                self._add(*item)
            for rid in aborts:
                self._abort(rid)
            if self.engine.has_unfinished_requests():
                self._step()
            self.snapshot = self._metrics()
            if self.on_step is not None:
                self.on_step(self.engine, False)
        self._shutdown()

    def _broadcast(self, drained: list[str], adds: list[tuple], aborts: list[str], stop: bool = False) -> None:
        """This iteration's engine calls, to the other ranks (`follow` replays them in this order)."""
        from ..engine.builder import broadcast_json

        broadcast_json(
            self._group,
            {
                "drained": drained,
                "aborts": list(aborts),
                "stop": stop,
                "adds": [req.to_wire() for req, *_ in adds],
            },
        )

    def _add(self, req: EngineRequest, sink, fut, arrival) -> None:
        rid = req.request_id
        try:
            extra = {"images": req.images} if req.images is not None else {}  # (a tensor-parallel engine takes none)
            self.engine.add_request(req.prompt, req.params, request_id=rid, **extra)
        except Exception as e:  # MlxPagedError / ValueError: the request's own fault
            fut.set_exception(e)
            return
        self._sinks[rid] = sink
        self._timing[rid] = _Timing(arrival)
        fut.set_result(rid)

    def _abort(self, rid: str) -> None:
        if self._sinks.pop(rid, None) is not None or rid in self._stalled:
            self._stalled.discard(rid)
            self._timing.pop(rid, None)
            self.engine.abort_request(rid)

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except StepError as e:  # the engine already aborted these and freed their blocks
            log.error("%s", e)
            for rid in e.request_ids:
                self._fail(rid, e)
            return
        except Exception as e:  # a bug outside any one request: fail all, keep the engine usable
            if self._group is not None:
                raise  # a tensor-parallel step that failed broke the group (RankFailure): _run ends the process
            log.exception("engine step failed")
            self._abort_all(f"engine failure: {type(e).__name__}: {e}")
            return
        self.steps += 1
        now = time.perf_counter()
        for out in outs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            self._observe(out, now)
            limit = self.stall_timeout
            if not out.finished and limit is not None and sink.behind_for(time.monotonic()) > limit:
                log.warning("aborting request %s: its client read nothing new for %.0f s", out.request_id, limit)
                self._fail(
                    out.request_id,
                    ClientTooSlow(
                        f"the client stayed behind the stream for more than {limit:g} s (--stream-stall-timeout)"
                    ),
                )
                # aborted before the next step, through the queue, so tensor-parallel ranks see the same abort
                self._stalled.add(out.request_id)
                self.abort(out.request_id)
                continue
            sink.put(out.request_id, out)
            if out.finished:
                del self._sinks[out.request_id]
                self._timing.pop(out.request_id, None)

    def _observe(self, out, now: float) -> None:
        t = self._timing.get(out.request_id)
        if t is None or self.observer is None:
            return
        for c in out.outputs:
            k = len(c.token_ids) - (0 if out.delta else t.tokens.get(c.index, 0))
            if k <= 0:
                continue
            if c.index in t.last:
                for _ in range(k):
                    self.observer.inter_token((now - t.last[c.index]) / k)
            elif not t.last:  # the request's first token (its n samples share one prefill)
                self.observer.first_token(now - t.arrival)
            t.last[c.index] = now
            t.tokens[c.index] = t.tokens.get(c.index, 0) + k

    def _fail(self, rid: str, exc: BaseException) -> None:
        sink = self._sinks.pop(rid, None)
        self._timing.pop(rid, None)
        if sink is not None:
            sink.put(rid, exc)

    def _shutdown(self) -> None:
        with self._cv:
            adds, self._adds = self._adds, []
        for *_, fut, _arrival in adds:
            fut.set_exception(EngineDown("the server is shutting down"))
        self._abort_all("the server is shutting down")
        self.snapshot = self._metrics()

    def _abort_all(self, why: str) -> None:
        for rid in list(self._sinks):
            self.engine.abort_request(rid)
            self._fail(rid, EngineDown(why))

    def _metrics(self) -> dict:
        m = dict(self.engine.metrics())
        m["sinks_held"] = len(self._sinks)
        m["mlx_active_memory_bytes"] = mx.get_active_memory()
        m["mlx_peak_memory_bytes"] = mx.get_peak_memory()
        m["mlx_cache_memory_bytes"] = mx.get_cache_memory()
        return m


def _die(msg: str) -> None:
    """A tensor-parallel group that lost a rank cannot serve: one line, non-zero exit."""
    sys.stderr.write(f"error: {msg}\n")
    sys.stderr.flush()
    os._exit(1)


def follow(engine, group) -> None:
    """Ranks other than 0 of a tensor-parallel server: replay rank 0's engine calls, step for step,
    until rank 0 stops. No HTTP here; outputs are dropped (rank 0 answers the clients)."""
    from ..engine.builder import RankFailure, broadcast_json

    try:
        while True:
            engine.watchdog.arm("waiting for rank 0's next step")  # rank 0 sends at least every HEARTBEAT s
            msg = broadcast_json(group)
            engine.watchdog.disarm()
            if msg["stop"]:
                return
            for rid in msg["drained"]:
                engine.abort_request(rid)
            for wire in msg["adds"]:
                req = EngineRequest.from_wire(wire)  # failing here is a bug: it ends this rank, loudly
                try:
                    engine.add_request(req.prompt, req.params, request_id=req.request_id)
                except (MlxPagedError, ValueError) as e:  # the request's own fault: rank 0 refused it too
                    log.debug("request %s refused on this rank too: %s", req.request_id, e)
            for rid in msg["aborts"]:
                engine.abort_request(rid)
            if engine.has_unfinished_requests():
                engine.step()
    except RankFailure as e:
        _die(str(e))
    except Exception as e:  # the ranks would fall out of step: end, saying why
        _die(f"tensor-parallel rank failed: {type(e).__name__}: {e}")
