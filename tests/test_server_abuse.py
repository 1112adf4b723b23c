"""`mlxpaged serve` under careless and hostile clients: each reproducer, scaled to seconds.

A server subprocess on the tiny model. Slow readers, huge bodies, idle sockets, file-descriptor
exhaustion, lone surrogates, keys, unimplemented fields, unadmittable requests and SIGTERM: every
one must end in a bounded process, a responsive `/health` and one OpenAI error object.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from mlxpaged.testing.slowness import wall

from server_proc import Server, free_port, in_process_app

BLOCKS = 2048  # 32,768 token slots: room for 32 samples of 700 tokens
STALL = 3.0  # --stream-stall-timeout of the shared server
HEADER_TIMEOUT = 1.0
MAX_BODY = 2_000_000
MAX_QUEUE = 64
MAX_REQUEST_TOKENS = 100_000
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(tiny_model_path):
    s = Server(
        tiny_model_path,
        "--num-blocks",
        str(BLOCKS),
        "--max-num-seqs",
        "64",
        "--header-timeout",
        str(HEADER_TIMEOUT),
        "--keep-alive-timeout",
        "1",
        "--stream-stall-timeout",
        str(STALL),
        "--max-body-bytes",
        str(MAX_BODY),
        "--max-stop-strings",
        "64",
        "--max-queue",
        str(MAX_QUEUE),
        "--max-request-tokens",
        str(MAX_REQUEST_TOKENS),
    )
    yield s
    s.stop()


def vmrss(pid: int) -> int:
    """Resident memory of a process in bytes, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def raw_request(path: str, body: bytes, headers: dict[str, str] | None = None, method: str = "POST") -> bytes:
    head = [
        f"{method} {path} HTTP/1.1",
        "Host: localhost",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the server closes `sock` within `within` seconds (a read returns EOF or a reset)."""
    sock.settimeout(within)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def assert_error(r: httpx.Response, status: int, param=None, code=None, words: str = "") -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS, err
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error"), err
    assert err["param"] == param and (code is None or err["code"] == code), err
    assert words in err["message"] and "\n" not in err["message"], err
    return err


class HealthProbe:
    """Polls /health from a thread; `worst` is the slowest answer (a timeout counts as its limit)."""

    def __init__(self, url: str):
        self.url, self.times, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=5) as h:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    h.get(self.url + "/health")
                except httpx.HTTPError:
                    pass
                self.times.append(time.monotonic() - t0)
                time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)

    @property
    def worst(self) -> float:
        return max(self.times)


# -- 1. a slow reader: bounded memory, and aborted once it stays behind ------------------------------
def test_slow_reader_memory_is_bounded_and_aborted(server, tiny_model_path):
    base = server.metrics()
    rss0 = vmrss(server.proc.pid)
    # 20 top logprobs make each token ~1.5 KB of SSE, so the kernel's socket buffers (up to 4 MB) fill in seconds
    # (16 x 700 tokens with 20 alternatives each stays under the default --max-answer-bytes)
    samples, max_tokens = 16, 700
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "The KV cache stores"}],
            "n": samples,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.8,
            "seed": 1,
            "logprobs": True,
            "top_logprobs": 20,
            "stream": True,
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes block
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(raw_request("/v1/chat/completions", body))
    peak, freed_at, t0 = rss0, None, time.monotonic()
    try:
        while time.monotonic() - t0 < wall(60):
            sock.settimeout(0.2)
            try:
                sock.recv(64)  # 64 bytes every 0.1 s: far slower than the samples are generated
            except TimeoutError:
                pass
            time.sleep(0.1)
            peak = max(peak, vmrss(server.proc.pid))
            m = server.metrics()
            started = m["mlxpaged_generation_tokens_total"] > base["mlxpaged_generation_tokens_total"]
            if m["mlxpaged_kv_blocks_used"] == 0 and started:
                freed_at = time.monotonic() - t0
                break
        generated = server.metrics()["mlxpaged_generation_tokens_total"] - base["mlxpaged_generation_tokens_total"]
    finally:
        sock.close()
    print(
        f"\nslow reader: RSS {rss0 / 1e6:.0f} -> peak {peak / 1e6:.0f} MB; blocks freed after "
        f"{freed_at} s with the client still connected; {generated:.0f} of {samples * max_tokens} tokens generated"
    )
    assert freed_at is not None, "the stalled request still holds its blocks"
    assert generated < samples * max_tokens, "the stalled request was not aborted: it ran to the end"
    assert peak - rss0 < 150e6, f"RSS grew by {(peak - rss0) / 1e6:.0f} MB for one slow reader"
    assert httpx.get(server.url + "/health", timeout=2).status_code == 200


# -- 2. CPU work stays off the event loop ---------------------------------------------------------------
def test_health_answers_while_heavy_requests_run(server, tiny_model_path):
    url = server.url + "/v1/completions"
    with HealthProbe(server.url) as probe, httpx.Client(timeout=120) as h:
        # under the body cap, but more characters than any prompt that fits could have: refused untokenized
        big = "hello world, " * (1_900_000 // 13)
        t0 = time.monotonic()
        assert_error(
            h.post(url, json={"prompt": big, "max_tokens": 1}), 400, "prompt", "context_length_exceeded", "characters"
        )
        assert time.monotonic() - t0 < wall(2)
        # over the body cap: 413 from Content-Length, and from a chunked body as it grows
        assert_error(h.post(url, content=b"x" * (MAX_BODY + 1)), 413, None, "request_too_large", "--max-body-bytes")
        chunks = (b"y" * 100_000 for _ in range(40))
        assert_error(h.post(url, content=chunks), 413, None, "request_too_large", "--max-body-bytes")
        # 1,000 stop strings of 1,500 characters: more than --max-stop-strings
        stops = [f"{i:04d}" + "z" * 1496 for i in range(1000)]
        assert_error(h.post(url, json={"prompt": "hi", "stop": stops}), 400, "stop", None, "--max-stop-strings")
        # 64 stop strings of 1,500 characters that keep almost matching, streamed to 16 samples
        text_stops = [("a" * 1499) + chr(ord("A") + i % 26) for i in range(64)]
        t0 = time.monotonic()
        with h.stream(
            "POST",
            url,
            json={
                "prompt": "aaaa aaaa",
                "n": 16,
                "max_tokens": 200,
                "ignore_eos": True,
                "temperature": 0.8,
                "seed": 2,
                "stop": text_stops,
                "stream": True,
            },
        ) as r:
            assert r.status_code == 200
            data = [ln for ln in r.iter_lines() if ln.startswith("data:")]
        took = time.monotonic() - t0
        assert data[-1] == "data: [DONE]" and '"error"' not in "".join(data)
        # a prompt that fits, tokenized on the tokenizer thread
        fits = "The KV cache stores keys. " * 1500
        assert h.post(url, json={"prompt": fits, "max_tokens": 1}).status_code in (200, 400)
    print(
        f"\nheavy requests: /health worst {probe.worst:.3f} s over {len(probe.times)} probes; "
        f"64 x 1,500-character stops over 16 samples streamed in {took:.1f} s"
    )
    assert probe.worst < 1.0


# -- 3. idle connections are closed; a full fd table recovers -------------------------------------------
def test_idle_connections_are_closed(server):
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(100)]
    trickle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
    for s in trickle:  # slowloris: headers that never end
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
    keep = socket.create_connection(("127.0.0.1", server.port))
    keep.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    keep.settimeout(5)
    assert b"200 OK" in keep.recv(4096)
    try:
        assert httpx.get(server.url + "/health", timeout=2).status_code == 200
        t0 = time.monotonic()
        closed = [closed_by_peer(s, HEADER_TIMEOUT + 3 - (time.monotonic() - t0)) for s in silent + trickle]
        assert all(closed), f"{closed.count(False)} of {len(closed)} idle connections still open"
        assert closed_by_peer(keep, 4), "an idle keep-alive connection stayed open"
    finally:
        for s in silent + trickle + [keep]:
            s.close()


HOLD_CONNECTIONS = """
import resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
socks = []
for _ in range(int(sys.argv[2])):
    try:
        socks.append(socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3))
    except OSError:
        break
print(len(socks), flush=True)
sys.stdin.read()  # hold them until the test closes our stdin
"""


def test_fd_exhaustion_recovers_and_logs_once(tiny_model_path):
    """More idle connections than the server has file descriptors (importing mlx_lm caps them at
    4,096): accept fails, is logged once per interval (not a traceback per attempt), and /health
    answers again once the idle ones are closed by the header timeout."""
    s = Server(tiny_model_path, "--num-blocks", "64", "--header-timeout", "2", "--max-connections", "100000")
    holders = []
    try:
        soft = int(next(ln.split()[3] for ln in open(f"/proc/{s.proc.pid}/limits") if ln.startswith("Max open files")))
        per = soft // 2 + 200  # two client processes (each has at most 4,096 descriptors too)
        holders = [
            subprocess.Popen(
                [sys.executable, "-c", HOLD_CONNECTIONS, str(s.port), str(per)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        opened = sum(int(h.stdout.readline()) for h in holders)
        t0 = time.monotonic()
        while "cannot accept" not in s.stderr() and time.monotonic() - t0 < wall(20):  # a loaded machine accepts slowly
            time.sleep(0.2)
        time.sleep(1.0)
        log = s.stderr()
        assert "cannot accept connections" in log, (opened, soft, log[-2000:])
        assert log.count("Traceback") == 0 and log.count("cannot accept") <= 2, log[-3000:]
        t0 = time.monotonic()
        while True:  # the idle connections are closed after --header-timeout: the server recovers
            try:
                if httpx.get(s.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t0 < wall(15), "the server did not recover from a full fd table"
        print(
            f"\nfd exhaustion: {opened} connections against {soft} descriptors; log {len(s.stderr())} bytes; "
            f"/health answered {time.monotonic() - t0:.1f} s later, the connections still held"
        )
        assert len(s.stderr()) < 5000
    finally:
        for h in holders:
            h.stdin.close()
            h.wait(10)
        s.stop()


# -- 4, 7, 8. every bad input: one error object with the right status ----------------------------------
HI = [{"role": "user", "content": "hi"}]
BAD = [
    # lone surrogates, in a prompt, the model name, chat content and a stop string
    ("/v1/completions", '{"prompt": "x\\ud800y"}', 400, "prompt", "surrogate"),
    ("/v1/completions", '{"prompt": "hi", "model": "x\\udc00"}', 400, "model", "surrogate"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800"}]}', 400, "messages", "surrogate"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"]}', 400, "stop", "surrogate"),
    # OpenAI's temperature range
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e300}, 400, "temperature", "temperature"),
    # known fields this server does not implement
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function"}]}, 400, "tools", "tools"),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}, 400, "tool_choice", "tool_choice"),
    (
        "/v1/chat/completions",
        {"messages": HI, "response_format": {"type": "yaml"}},
        400,
        "response_format",
        "response_format",
    ),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of", "best_of"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix", "suffix"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "stream": True}, 400, "echo", "echo"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 0}, 400, "prompt_logprobs", "prompt_logprobs"),
    # stop ids outside the vocabulary (the tiny model has 384 tokens)
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [384]}, 400, "stop_token_ids", "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids", "vocabulary"),
    # messages without content
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages", "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, 400, "messages", "content"),
    # requests that can never be admitted: 400 naming the limit, not a retryable 503
    ("/v1/completions", {"prompt": [[1, 2]] * 2000, "max_tokens": 1}, 400, "prompt", "--max-queue"),
    (
        "/v1/completions",
        {"prompt": ["hi"] * 10, "n": 64, "max_tokens": 1000},
        400,
        "max_tokens",
        "--max-request-tokens",
    ),
    ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 65}, 400, "stop", "--max-stop-strings"),
]


def test_bad_inputs_get_their_error_object(server, tiny_model_path):
    with httpx.Client(timeout=30) as h:
        for path, body, status, param, words in BAD:
            content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            r = h.post(server.url + path, content=content, headers={"content-type": "application/json"})
            assert_error(r, status, param, None, words)
            assert "retry-after" not in r.headers
            assert "TextEncodeInput" not in r.text
        # an unknown model: OpenAI's 404 model_not_found; the served name is the folder's, not its path
        err = assert_error(
            h.post(server.url + "/v1/completions", json={"prompt": "hi", "model": "gpt-9"}),
            404,
            "model",
            "model_not_found",
            "unknown model",
        )
        assert str(tiny_model_path.parent) not in err["message"]
        assert [m["id"] for m in h.get(server.url + "/v1/models").json()["data"]] == [tiny_model_path.name]
        # values that ask for nothing are accepted; a field the server does not know is refused by name
        for extra in (
            {"presence_penalty": 0},
            {"logit_bias": {}},
            {"echo": False},
            {"best_of": 1},
        ):
            r = h.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra})
            assert r.status_code == 200, (extra, r.text)
        r = h.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "some_vendor_field": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "some_vendor_field", r.text
        r = h.post(
            server.url + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "response_format": {"type": "text"},
            },
        )
        assert r.status_code == 200, r.text
        # docs are off by default
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert h.get(server.url + path).status_code == 404
    assert server.metrics()["mlxpaged_kv_blocks_used"] == 0


def test_tiny_temperature_is_greedy(server):
    """A positive temperature of 1e-38 divides logits into float32 infinities; it must act as greedy."""
    with httpx.Client(timeout=60) as h:

        def text(t):
            r = h.post(
                server.url + "/v1/completions",
                json={
                    "prompt": "The quick brown fox",
                    "max_tokens": 16,
                    "temperature": t,
                    "ignore_eos": True,
                    "seed": 5,
                },
            )
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        greedy = text(0)
        assert text(1e-38) == greedy and text(1e-6) == greedy


def test_chat_default_max_tokens_fits_the_pool(server):
    """No max_tokens, 64 samples: the default shrinks to what the pool holds instead of a 400."""
    body = {
        "messages": [{"role": "user", "content": "Write a haiku about memory."}],
        "n": 64,
        "stream": True,
        "temperature": 0.8,
        "seed": 3,
    }
    with httpx.Client(timeout=60) as h, h.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        first = next(ln for ln in r.iter_lines() if ln.startswith("data:"))
        assert '"error"' not in first


def test_default_max_tokens_is_the_largest_the_engine_admits(tiny_loaded):
    """`default_max_tokens` against the engine's own admission check: m is admitted, m + 1 is not."""
    from mlxpaged import SamplingParams
    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.llm_engine import LLMEngine
    from mlxpaged.errors import MlxPagedError
    from mlxpaged.server.limits import Capacity, default_max_tokens

    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=100))
    cap = Capacity(4096, 384, engine.max_blocks, engine.config.cache.block_size, 13)
    for num_prompt, n in [(10, 1), (10, 8), (100, 64), (17, 3), (600, 5)]:
        m = default_max_tokens(cap, 1024, num_prompt, n)
        rid = f"ok{num_prompt}-{n}"
        engine.add_request(list(range(5, 5 + num_prompt)), SamplingParams(n=n, max_tokens=m), request_id=rid)
        engine.abort_request(rid)
        if m < 1024:
            with pytest.raises(MlxPagedError, match="cannot fit"):
                engine.add_request(list(range(5, 5 + num_prompt)), SamplingParams(n=n, max_tokens=m + 1))


def test_unhandled_error_is_one_500_error_object(tiny_loaded, caplog):
    """An exception no handler takes: a JSON 500 in OpenAI's shape, its traceback logged once."""
    from fastapi.testclient import TestClient

    app, loop = in_process_app(tiny_loaded)

    def broken(*a, **kw):
        raise KeyError("a bug \ud800")

    loop.submit = broken
    with caplog.at_level(logging.ERROR), TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"prompt": "The KV cache", "max_tokens": 2})
        assert_error(r, 500, None, None, "KeyError")
        assert c.get("/health").status_code == 200
    logged = [rec for rec in caplog.records if rec.exc_info]
    assert len(logged) == 1 and "KeyError" in logged[0].exc_text


# -- 5. an empty key never disables authentication; a public bind without one warns ---------------------
@pytest.mark.parametrize("how", ["flag", "env", "blank"])
def test_empty_api_key_refuses_to_start(tiny_model_path, how):
    cmd = [sys.executable, "-m", "mlxpaged.cli", "serve", "--model", str(tiny_model_path), "--port", str(free_port())]
    env = dict(os.environ)
    if how == "flag":
        cmd += ["--api-key", ""]
    else:
        env["MLXPAGED_API_KEY"] = "" if how == "env" else "  "
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=wall(30), env=env)
    assert out.returncode != 0
    assert "API key is empty" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_public_bind_without_key_warns(tiny_model_path):
    s = Server(tiny_model_path, "--host", "0.0.0.0", "--num-blocks", "16")
    try:
        assert "without --api-key" in s.stderr()
    finally:
        s.stop()


# -- 6. the key is checked before the body; /metrics is protected; SIGTERM drains ----------------------
@pytest.fixture(scope="module")
def keyed(tiny_model_path):
    s = Server(
        tiny_model_path, "--num-blocks", "256", "--api-key", "sekret", "--enable-docs", "--shutdown-timeout", "3"
    )
    yield s
    s.stop()


def test_key_is_checked_before_the_body(keyed):
    # a 60 MB body announced but never sent: the 401 comes from the headers alone
    sock = socket.create_connection(("127.0.0.1", keyed.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: 60000000\r\n\r\n{"
    )
    sock.settimeout(2)
    try:
        head = sock.recv(4096)
    finally:
        sock.close()
    assert head.startswith(b"HTTP/1.1 401"), head
    with httpx.Client(timeout=10) as h:
        url = keyed.url + "/v1/completions"
        assert_error(h.post(url, content=b"{not json"), 401, None, "invalid_api_key", "missing")
        assert_error(
            h.post(url, json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"}),
            401,
            None,
            "invalid_api_key",
            "wrong",
        )
        for auth in (
            {"Authorization": "Bearer sekret"},
            {"Authorization": "bearer sekret"},
            {"Authorization": "BEARER  sekret"},
            {"x-api-key": "sekret"},
        ):
            assert h.get(keyed.url + "/v1/models", headers=auth).status_code == 200, auth
        assert_error(h.get(keyed.url + "/metrics"), 401, None, "invalid_api_key")
        assert h.get(keyed.url + "/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert h.get(keyed.url + "/health").json()["status"] == "ok"
        assert h.get(keyed.url + "/openapi.json").status_code == 200  # --enable-docs


def test_sigterm_drains_with_503_and_exits_0(keyed):
    auth = {"Authorization": "Bearer sekret"}
    h = httpx.Client(timeout=30, headers=auth)
    long = {"prompt": "The KV cache", "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
    first = h.send(h.build_request("POST", keyed.url + "/v1/completions", json=long), stream=True)
    lines = first.iter_lines()
    next(lines)
    keyed.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    while httpx.get(keyed.url + "/health", timeout=5).status_code != 503:  # until the server has the signal
        assert time.monotonic() - t0 < wall(10), "SIGTERM did not start a drain"
        time.sleep(0.02)
    assert_error(
        h.post(keyed.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
        503,
        None,
        "server_shutting_down",
        "shutting down",
    )
    health = httpx.get(keyed.url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    rest = [ln for ln in lines if ln.startswith("data:")]
    assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2]  # aborted after the 3 s drain
    rc, err = keyed.interrupt(timeout=20, sig=0)  # wait only: SIGTERM was sent
    assert rc == 0, err
    assert "Traceback" not in err and "stopped" in err


# -- the pieces behind the reproducers above, against plain references -------------------------------
def test_sink_keeps_only_the_newest_output_per_request():
    """Outputs are cumulative: a reader that fell behind gets the newest one per request, once."""
    import asyncio

    from mlxpaged.server.engine_loop import Sink

    async def run():
        sink = Sink(asyncio.get_running_loop())
        assert sink.behind_for(time.monotonic()) == 0.0
        for step in range(1000):  # from another thread, as the engine loop does
            await asyncio.to_thread(sink.put, "a", f"a{step}")
        sink.put("b", "b0")
        behind = sink.behind_for(time.monotonic())
        assert behind > 0.0  # an unread output was superseded
        assert sorted(await sink.get()) == [("a", "a999"), ("b", "b0")]
        assert sink.behind_for(time.monotonic()) == 0.0  # caught up
        assert await sink.get(timeout=0.05) == []
        sink.put("a", "a1000")
        assert sink.behind_for(time.monotonic()) == 0.0  # one unread output is not being behind
        assert await sink.get() == [("a", "a1000")]

    asyncio.run(run())
