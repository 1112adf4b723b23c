"""Grammars and keys under careless and hostile clients:
each reproducer, scaled to seconds, against one `mlxpaged serve` subprocess on the tiny model.

"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mlxpaged.testing.slowness import wall

from server_proc import Server

KEY = "clé-ü"  # non-ASCII: UTF-8 on the wire
AUTH = {"Authorization": b"Bearer " + KEY.encode("utf-8")}
UNSATISFIABLE = [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    s = Server(tiny_model_path, "--num-blocks", "512", "--responses-store", "4")
    yield s
    s.stop()


def post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def chat(schema: dict, **kw) -> dict:
    return {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 16,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        **kw,
    }


# -- 17: a non-ASCII key matches its UTF-8 bytes ---------------------------------------------------------
def test_non_ascii_key_is_compared_as_utf8_bytes(tiny_model_path):
    server = Server(tiny_model_path, "--num-blocks", "64", "--api-key", KEY)
    url = server.url + "/v1/models"
    try:
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers=AUTH).status_code == 200
        assert httpx.get(url, headers={"x-api-key": KEY.encode("utf-8")}).status_code == 200
        # its Latin-1 spelling is other bytes, hence another key
        assert httpx.get(url, headers={"Authorization": b"Bearer " + KEY.encode("latin-1")}).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer cle-u"}).status_code == 401
    finally:
        server.stop()


# -- 18: Anthropic paths answer 404/405 in Anthropic's shape; a huge id is not echoed ------------------------
def test_anthropic_404_and_405_use_anthropic_error_shape(server):
    r = httpx.get(server.url + "/v1/messages")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "Method Not Allowed"}}
    r = httpx.post(server.url + "/v1/messages/nope", json={})
    assert r.status_code == 404
    assert r.json() == {"type": "error", "error": {"type": "not_found_error", "message": "Not Found"}}
    r = httpx.get(server.url + "/v1/nope")  # elsewhere, OpenAI's object
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_huge_previous_response_id_is_not_echoed(server):
    rid = "resp_" + "x" * 1_000_000
    r = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "previous_response_id": rid})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert len(r.content) < 1000, len(r.content)


# -- 9: schemas that compile but accept nothing are a 400 on every route -------------------------------------
@pytest.mark.parametrize("schema", UNSATISFIABLE, ids=["self", "loop", "required-self"])
def test_schema_that_accepts_nothing_is_400_on_every_route(server, schema, tiny_model_path):
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    cases = [
        ("/v1/chat/completions", chat(schema), "response_format"),
        (
            "/v1/chat/completions",
            {**chat(schema), "response_format": None, "tools": tools, "tool_choice": "required"},
            "tools",
        ),
        (
            "/v1/messages",
            {
                "model": str(tiny_model_path),
                "max_tokens": 16,
                "messages": [{"role": "user", "content": "hi"}],
                "output_config": {"format": {"type": "json_schema", "schema": schema}},
            },
            None,
        ),
        (
            "/v1/messages",
            {
                "model": str(tiny_model_path),
                "max_tokens": 16,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "f", "input_schema": schema}],
                "tool_choice": {"type": "any"},
            },
            None,
        ),
        (
            "/v1/responses",
            {
                "input": "hi",
                "max_output_tokens": 16,
                "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
            },
            "text.format",
        ),
    ]
    for path, body, param in cases:
        r = post(server, path, body)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert "accepts no value" in err["message"], (path, err)
        if param is not None:
            assert err["param"] == param, (path, err)


# -- 5: grammars compile off the engine thread; oversized specs are refused before compiling -------------------
class Stream:
    """A plain streamed completion in a thread; `gaps` are the seconds between its chunks."""

    def __init__(self, server, tokens: int):
        self.server, self.tokens, self.gaps = server, tokens, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        body = {"prompt": "The KV cache", "max_tokens": self.tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.server.url + "/v1/completions", json=body, timeout=120) as r:
            last = None
            for line in r.iter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    if last is not None:
                        self.gaps.append(now - last)
                    last = now


def test_grammar_compiles_do_not_stall_decoding(server):
    # a 300,000-string enum: refused by size at once, before any compile
    t0 = time.monotonic()
    r = post(server, "/v1/chat/completions", chat({"enum": [f"s{i}" for i in range(300_000)]}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text[:300]
    assert "characters" in r.json()["error"]["message"] and time.monotonic() - t0 < wall(5)
    # six enums under the cap, each ~0.3 s to compile, sent at once while another client streams
    s = Stream(server, 600)
    while not s.gaps:
        time.sleep(0.05)
    schemas = [{"enum": [f"v{k}_{i}" for i in range(20_000)]} for k in range(6)]
    with ThreadPoolExecutor(6) as pool:
        rs = list(pool.map(lambda sc: post(server, "/v1/chat/completions", chat(sc, max_tokens=2)), schemas))
    assert [r.status_code for r in rs] == [200] * 6, [r.text[:200] for r in rs]
    s.thread.join(120)
    assert len(s.gaps) > 100
    assert max(s.gaps) < wall(1.0), sorted(s.gaps)[-5:]  # with compiles on the engine thread: one gap of ~2 s


# -- 6: a grammar too slow to enforce ends its request with a clear error --------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_slow_mask_grammar_ends_with_an_error(server, stream):
    schema = {"type": "string", "pattern": "^x{100000}$"}  # ~80 ms a mask even on a 384-token vocabulary
    t0 = time.monotonic()
    body = chat(schema, n=4, max_tokens=64, stream=stream)
    if not stream:
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
    else:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        err = events[-1]["error"]
    assert err["code"] == "grammar_too_slow" and "too slow" in err["message"], err
    assert time.monotonic() - t0 < wall(12)
    # the server goes on: the same route answers a plain request
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200


def test_grammar_gate_refuses_a_compile_past_its_time_limit():
    """The gate's time limit, in process: a compiler that takes 5 s against a limit of 0.2 s."""
    import asyncio

    from mlxpaged.engine.guided import GuidedDecoding
    from mlxpaged.server.errors import APIError
    from mlxpaged.server.guided_request import GrammarGate

    class Slow:
        def warm(self):
            pass

        def lookup(self, spec):
            return None

        def compile(self, spec):
            time.sleep(5)

    gate = GrammarGate(Slow(), timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(APIError) as e:
        asyncio.run(gate.compile(GuidedDecoding(json_object=True), "response_format"))
    assert e.value.status == 400 and "longer than 0.2 s to compile" in str(e.value.body()), e.value.body()
    assert time.monotonic() - t0 < min(wall(2), 4.5)  # the compile itself takes 5 s
    gate.close()


# -- 13: cache_salt isolates one client's prefix cache from another's cached_tokens ----------------------------
def test_cache_salt_isolates_cached_tokens(server):
    """A guess of another client's prompt shows up in `cached_tokens` unless that client salts it."""
    secret = "Payroll memo. Employee 4411 salary: 93,500 EUR. " * 8  # several full blocks

    def cached(salt=None):
        body = {"messages": [{"role": "user", "content": secret}], "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text[:300]
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("client-a") == 0  # the victim, salted
    assert cached() == 0 and cached("client-b") == 0  # the guesses of others see nothing
    assert cached("client-a") > 0  # the same salt shares, as before
    assert cached() > 0  # unsalted requests share with each other, as before
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "cache_salt": ""})
    assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"], r.text[:300]
