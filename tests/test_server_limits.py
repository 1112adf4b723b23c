"""An answer's size, cache salts on every route, the Responses store's bytes and unknown fields:
each reproducer, scaled to seconds, against `mlxpaged serve` subprocesses on the tiny model.

- A large non-streamed answer (echo and logprobs of many choices) is built and encoded off the
  event loop: `/health` keeps answering while it is written. One estimated past
  `--max-answer-bytes` is a 400 on every route, before anything is generated.
- `cache_salt` on Messages (top-level or `metadata.cache_salt`) and Responses: an unsalted or
  differently salted guess of a salted prompt sees no cached tokens; the same salt does, and
  Messages' usage says so as Anthropic does (`cache_read_input_tokens`, `input_tokens` the rest).
- The Responses store drops its oldest conversations once their text passes
  `--responses-store-bytes`, well before `--responses-store` of them.
- A top-level field the server does not implement (`chat_template_kwargs`) is a 400 naming it on
  every route, as is mlx_lm.server's `adapters` where the route does not take it; the OpenAI
  routes take it, and an adapter the server was not given is a 404 naming it; the no-op fields
  real clients send are still taken.
"""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import openai
import pytest

from server_proc import Server

BIG_ANSWER = 64_000_000  # --max-answer-bytes of the shared server: the large answer below fits
STORE_BYTES = 6_000  # --responses-store-bytes: two stored conversations of ~2,000 characters
HEALTH_BOUND = 1.5  # seconds: the base commit stalled /health 3-6 s on the answer below, now ~0.1-0.5 s


@pytest.fixture(scope="module")
def server(tiny_model_path):
    s = Server(
        tiny_model_path,
        *("--num-blocks", "1024", "--max-num-seqs", "64", "--max-answer-bytes", str(BIG_ANSWER)),
        *("--responses-store", "8", "--responses-store-bytes", str(STORE_BYTES)),
    )
    yield s
    s.stop()


def model_id(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def post(server, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    if path.startswith("/v1/messages"):  # Anthropic's bodies name the model
        body = {"model": model_id(server), **body}
    return httpx.post(server.url + path, json=body, timeout=timeout)


# -- an answer's size: off the event loop, and capped before generating --------------------------
def test_health_answers_while_a_large_answer_is_written(server):
    """2 prompts of 1,000 token ids x n=24, echoed with 20 logprobs a token: an 18 MB answer from a
    small request. The base commit encoded it on the event loop (FastAPI's `jsonable_encoder`, then
    `json.dumps`): /health waited 3-6 s for it."""
    prompts = [[(i * 7 + j) % 300 + 10 for j in range(1000)] for i in range(2)]
    body = {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 20, "n": 24, "temperature": 0}
    done: dict = {}

    def big():  # the answer is parsed after the polls: parsing holds this process's GIL too
        done["r"] = post(server, "/v1/completions", body, timeout=300)

    t = threading.Thread(target=big)
    t.start()
    worst = polls = 0
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=60).status_code == 200
        worst, polls = max(worst, time.monotonic() - t0), polls + 1
        time.sleep(0.05)
    t.join()
    r = done["r"]
    assert r.status_code == 200 and len(r.content) > 10_000_000, r.text[:300]
    assert len(r.json()["choices"]) == 48
    assert polls > 5 and worst < HEALTH_BOUND, (worst, polls)


def test_an_answer_past_the_cap_is_refused_before_generating(server):
    """The same request with n=64 is estimated past --max-answer-bytes: a 400 naming the flag and
    the estimate, and not one prompt token computed."""
    computed = "mlxpaged_prompt_tokens_computed_total"
    before = server.metrics()[computed]
    prompts = [[(i * 11 + j) % 300 + 10 for j in range(1000)] for i in range(2)]
    r = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 20, "n": 64})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert "--max-answer-bytes" in err["message"] and f"at most {BIG_ANSWER}" in err["message"], err
    est = int(err["message"].split("about ")[1].split(" bytes")[0])
    assert est > BIG_ANSWER and err["param"] == "max_tokens", err
    assert server.metrics()[computed] == before


ROUTES = {  # route -> (a body past a 4,096-byte cap, the shape its error comes in)
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "n": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 400, "logprobs": 1},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1000},
}


def test_the_cap_is_in_the_one_admission_path(tiny_model_path):
    s = Server(tiny_model_path, "--num-blocks", "64", "--max-answer-bytes", "4096")
    try:
        for path, body in ROUTES.items():
            r = post(s, path, body)
            assert r.status_code == 400, (path, r.text[:300])
            j = r.json()
            msg = j["error"]["message"]
            assert "--max-answer-bytes" in msg and "at most 4096" in msg, (path, msg)
            if path == "/v1/messages":
                assert j["type"] == "error", j
            else:
                assert j["error"]["param"] == ("max_output_tokens" if "responses" in path else "max_tokens"), j
            small = {**body, **{k: 4 for k in ("max_tokens", "max_output_tokens") if k in body}}
            r = post(s, path, small)
            assert r.status_code == 200, (path, r.text[:300])
    finally:
        s.stop()


# -- cache_salt on Messages and Responses, seen through the official clients ---------------------
SYSTEM = "You are the payroll desk. Never reveal the PIN. " * 3


def guessed(server, secret: str, pin: str, guesses: list[str], salt: str) -> list[int]:
    """`cached_tokens` of each guess of `pin` in `secret` on chat, unsalted, then of the right one
    salted `salt`. A wrong guess first: every guess finds the text before the PIN cached by it."""
    chat_cached(server, secret.replace(pin, "----"))
    return [chat_cached(server, secret.replace(pin, g)) for g in guesses] + [chat_cached(server, secret, salt)]


def chat_cached(server, text: str, salt: str | None = None) -> int:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}], "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text[:300]
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("where", ["body", "metadata"])
def test_a_salted_messages_prompt_is_not_guessable_from_chat(server, where):
    """The victim talks to /v1/messages with a salt; the attacker guesses its PIN on chat from
    `cached_tokens`: every guess, right or wrong, sees the same (nothing past the shared system
    prompt's blocks would be salted: none at all). The victim's own second request hits, and its
    usage says so as Anthropic counts it."""
    pin = {"body": "7142", "metadata": "5309"}[where]
    secret = (
        f"Account holder: Ada Lovelace ({where}). The card PIN is {pin}. Please confirm the balance of the account."
    )
    c = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    model = model_id(server)
    salt = {"extra_body": {"cache_salt": "victim"}} if where == "body" else {}
    meta = {"user_id": "ada", "cache_salt": "victim"} if where == "metadata" else {"user_id": "ada"}
    kw = dict(model=model, max_tokens=1, system=SYSTEM, messages=[{"role": "user", "content": secret}])
    first = c.messages.create(**kw, metadata=meta, **salt)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert total == c.messages.count_tokens(**{k: v for k, v in kw.items() if k != "max_tokens"}).input_tokens

    seen = guessed(server, secret, pin, [pin, "0000", "1234", "9999"], f"attacker-{where}")
    assert seen[0] == seen[1] == seen[2] == seen[3], seen  # the right guess shows nothing more
    assert seen[4] == 0, seen

    again = c.messages.create(**kw, metadata=meta, **salt)
    u = again.usage
    assert u.cache_read_input_tokens > 48 and u.input_tokens == total - u.cache_read_input_tokens, u
    assert u.cache_creation_input_tokens == 0, u
    other = c.messages.create(**kw, metadata={"user_id": "eve"}, extra_body={"cache_salt": f"eve-{where}"})
    assert (other.usage.cache_read_input_tokens, other.usage.input_tokens) == (0, total), other.usage


def test_messages_salts_that_differ_are_refused(server):
    body = {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    r = post(server, "/v1/messages", {**body, "cache_salt": "a", "metadata": {"cache_salt": "b"}})
    assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"], r.text
    r = post(server, "/v1/messages", {**body, "cache_salt": ""})
    assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"], r.text


def test_a_salted_responses_prompt_is_not_guessable_from_chat(server):
    secret = "Account holder: Grace Hopper. The card PIN is 8086. Please confirm the balance of the account."
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    kw = dict(model=model_id(server), instructions=SYSTEM, input=secret, max_output_tokens=1, store=False)
    first = c.responses.create(**kw, extra_body={"cache_salt": "victim"})
    seen = guessed(server, secret, "8086", ["8086", "0000"], "attacker-responses")
    assert seen[0] == seen[1] and seen[2] == 0, seen
    again = c.responses.create(**kw, extra_body={"cache_salt": "victim"})
    assert again.usage.input_tokens_details.cached_tokens > 48, again.usage
    assert again.usage.input_tokens == first.usage.input_tokens
    other = c.responses.create(**kw, extra_body={"cache_salt": "someone-else"})
    assert other.usage.input_tokens_details.cached_tokens == 0, other.usage


# -- the Responses store, bounded by bytes --------------------------------------------------------
def test_the_responses_store_is_bounded_by_bytes(server):
    """Three conversations of ~2,000 characters under a 6,000-byte bound (and a count of 8): the
    first is dropped once the third is stored; the later ones continue."""
    ids = []
    for i in range(3):
        r = post(server, "/v1/responses", {"input": f"{i} " + "word " * 400, "max_output_tokens": 2})
        assert r.status_code == 200, r.text[:300]
        ids.append(r.json()["id"])
    r = post(server, "/v1/responses", {"input": "and?", "max_output_tokens": 2, "previous_response_id": ids[0]})
    assert r.status_code == 400 and "--responses-store-bytes" in r.json()["error"]["message"], r.text[:300]
    r = post(server, "/v1/responses", {"input": "and?", "max_output_tokens": 2, "previous_response_id": ids[2]})
    assert r.status_code == 200, r.text[:300]


def test_a_conversation_larger_than_the_store_is_not_kept():
    from mlxpaged.server.errors import APIError
    from mlxpaged.server.responses_api import ResponseStore, text_bytes

    store = ResponseStore(8, 10_000)
    small = [{"role": "user", "content": "x" * 1000}]
    store.put("a", small)
    store.put("big", [{"role": "user", "content": " " * 20_000}])  # alone past the bound: not kept
    assert store.get("a") == tuple(small) and store.bytes == text_bytes(small) < 10_000
    with pytest.raises(APIError, match="not stored"):
        store.get("big")


# -- fields the server does not implement, refused by name on every route ----------------------------
UNKNOWN = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/tokenize": {"prompt": "hi"},
}


@pytest.mark.parametrize("path", list(UNKNOWN))
def test_unknown_fields_are_refused_by_name_on_every_route(server, path):
    body = UNKNOWN[path]
    assert post(server, path, body).status_code == 200
    for field, value in (("adapters", "/path/to/lora"), ("chat_template_kwargs", {"enable_thinking": False})):
        r = post(server, path, {**body, field: value})
        if field == "adapters" and path in ("/v1/chat/completions", "/v1/completions"):  # taken: no such adapter
            assert r.status_code == 404 and "unknown adapter '/path/to/lora'" in r.json()["error"]["message"], r.text
            continue
        assert r.status_code == 400, (path, field, r.text[:300])
        j = r.json()
        msg = j["error"]["message"]
        assert msg.startswith(f"{field}: ") and f"'{field}'" in msg, (path, msg)
        if not path.startswith("/v1/messages"):
            assert j["error"]["param"] == field, j


def test_the_no_op_fields_real_clients_send_are_taken(server):
    hi = [{"role": "user", "content": "hi"}]
    ok = {
        "/v1/chat/completions": {"messages": hi, "max_tokens": 2, "metadata": {"a": "b"}, "store": False},
        "/v1/messages": {
            "messages": hi,
            "max_tokens": 2,
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "u"},
        },
        "/v1/responses": {"input": "hi", "max_output_tokens": 2, "include": [], "prompt_cache_key": "k"},
    }
    for path, body in ok.items():
        r = post(server, path, body)
        assert r.status_code == 200, (path, r.text[:300])
