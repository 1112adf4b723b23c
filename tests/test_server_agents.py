"""Claude Code and Codex as they are, in one process.

The app runs in-process (FastAPI's TestClient, which the official anthropic and openai clients take
as their HTTP client) on a tiny random model carrying Qwen2.5's real tokenizer and template, with
a 3,000-token context so that Claude Code's 32,000 max_tokens is clamped to a few tokens. The two
CLIs' first requests are replayed from tests/data/ (written from their documented request shapes:
see each file's `_comment`).
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import anthropic
import openai
import pytest
from test_server_spine import write_tiny_with_tokenizer

from mlxpaged.server import admission, keepalive

DATA = Path(__file__).parent / "data"
CONTEXT = 3000  # the fixture model's positions: Claude Code's replayed prompt is ~2,950 tokens
CLAUDE_MODEL = "claude-sonnet-4-5-20250929"


def request(name: str) -> dict:
    body = json.loads((DATA / name).read_text())
    body.pop("_comment")
    return body


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    """(TestClient, server state, tokenizer): Claude Code's default model name served, `tiny` an alias."""
    from fastapi.testclient import TestClient

    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.llm_engine import LLMEngine
    from mlxpaged.loading.gguf import convert_gguf
    from mlxpaged.loading.loader import load
    from mlxpaged.loading.offline_model import ensure_offline_model
    from mlxpaged.server.app import build_app
    from mlxpaged.server.engine_loop import EngineLoop
    from mlxpaged.server.metrics import Metrics

    tok_dir = convert_gguf(ensure_offline_model())
    path = write_tiny_with_tokenizer(tmp_path_factory.mktemp("agents"), tok_dir)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    loaded = load(str(path), "float32")
    loop = EngineLoop(lambda: LLMEngine(loaded, EngineConfig.of(num_blocks=CONTEXT // 16 + 8)))
    loop.start()
    app = build_app(loop, Metrics(loop), model_id=CLAUDE_MODEL, model_aliases={"tiny"})  # as `serve` attaches it
    with TestClient(app) as c:
        yield c, app.state.server, loaded.tokenizer, tok_dir


def recorded_prompts(state, monkeypatch) -> list[list[int]]:
    seen: list[list[int]] = []
    submit = state.engine_loop.submit

    def recording(prompt, params, rid, sink):
        seen.append(list(prompt))
        return submit(prompt, params, rid, sink)

    monkeypatch.setattr(state.engine_loop, "submit", recording)
    return seen


def test_claude_codes_first_request_streams_through_the_anthropic_client(agents, monkeypatch, caplog):
    """System messages mid-conversation, 24 tools, thinking adaptive, output_config.effort and
    max_tokens 32,000 on a 3,000-token context: 200, Anthropic's event sequence to message_stop,
    max_tokens clamped to what the context leaves (said in the header and the access line)."""
    c, state, tok, _ = agents
    body = request("claude_code_first_request.json")
    seen = recorded_prompts(state, monkeypatch)
    client = anthropic.Anthropic(base_url=str(c.base_url), api_key="unused", http_client=c)
    caplog.set_level(logging.INFO, logger="mlxpaged.server")
    known = inspect.signature(client.messages.create).parameters  # the rest goes as sent, in extra_body
    extra = {k: body.pop(k) for k in list(body) if k not in known}
    with client.messages.create(**body, extra_body=extra) as stream:  # stream: true, as sent
        events = list(stream)
        clamped = stream.response.headers.get("x-mlxpaged-max-tokens-clamped")
    types = [e.type for e in events]
    end = next(e for e in events if e.type == "message_delta")
    n_prompt = len(seen[0])
    assert types[0] == "message_start" and types[-1] == "message_stop", types
    assert types.count("content_block_start") == types.count("content_block_stop") >= 1, types
    assert end.delta.stop_reason == "max_tokens" and events[0].message.usage.input_tokens == n_prompt
    assert clamped is not None and int(clamped) == CONTEXT - n_prompt == end.usage.output_tokens
    # The mid-conversation system message is a system turn where it stands, after the assistant's.
    text = tok.decode(seen[0])
    at = text.index("Let me look at the README.")
    assert text.index("<|im_start|>system\nThe user opened README.md") > at, text[-800:]
    assert all(f'"name": "{t["name"]}"' in text for t in body["tools"])
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("POST /v1/messages ")]
    assert line and f"200 prompt={n_prompt} output={CONTEXT - n_prompt}" in line[-1], line
    assert f"max_tokens_clamped={CONTEXT - n_prompt}" in line[-1]


def test_codexs_first_request_streams_through_the_openai_client(agents, monkeypatch, caplog):
    """A namespace tool (its functions offered), a hosted web_search (not offered, one log line),
    reasoning.summary auto, include, store false, prompt_cache_key, client_metadata: 200 and
    Responses' event sequence to its end, read through the openai client."""
    c, state, tok, _ = agents
    body = request("codex_first_request.json")
    seen = recorded_prompts(state, monkeypatch)
    client = openai.OpenAI(base_url=str(c.base_url) + "/v1", api_key="unused", http_client=c)
    caplog.set_level(logging.INFO, logger="mlxpaged.server")
    body.pop("stream")
    monkeypatch.setattr(admission, "default_max_tokens", lambda *a: 8)  # no max_output_tokens sent: a short turn
    extra = {"client_metadata": body.pop("client_metadata")}
    with client.responses.stream(**body, extra_body=extra) as s:
        events = list(s)
    types, final = [e.type for e in events], events[-1].response
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"], types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert final.usage.input_tokens == len(seen[0]) and final.store is False
    text = tok.decode(seen[0])
    for name in ("shell_command", "apply_patch", "spawn_agent", "wait_agent"):
        assert f'"name": "{name}"' in text
    assert "web_search" not in text and "multi_agent_v1" not in text
    assert any("hosted tools not offered" in r.getMessage() and "web_search" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 2048}, {"type": "disabled"}])
def test_thinking_and_effort_are_accepted_on_a_model_without_reasoning(agents, thinking):
    c, _, _, _ = agents
    body = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "thinking": thinking}
    r = c.post("/v1/messages", json={**body, "output_config": {"effort": "low"}})
    assert r.status_code == 200 and r.json()["content"][0]["type"] == "text", r.text
    r = c.post("/v1/messages", json={**body, "output_config": {"effort": "extreme"}})
    assert r.status_code == 400 and "effort" in r.json()["error"]["message"], r.text
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 3, "reasoning": {"effort": "high", "summary": "auto"}}
    r = c.post("/v1/responses", json=body)
    assert r.status_code == 200 and r.json()["reasoning"] == {"effort": "high", "summary": "auto"}, r.text


def test_an_unknown_tool_type_is_refused_by_name(agents):
    c, _, _, _ = agents
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 3, "tools": [{"type": "teleport"}]}
    r = c.post("/v1/responses", json=body)
    assert r.status_code == 400 and "'teleport'" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route", ["chat", "completions", "messages", "responses"])
def test_max_tokens_past_the_context_is_clamped_on_every_route(agents, route):
    """The prompt fits, max_tokens does not: clamped to the context's rest, never a 400; a prompt
    that does not fit is still a 400."""
    c, state, tok, _ = agents
    ask = 4 * CONTEXT
    msgs = [{"role": "user", "content": "hi"}]
    path, body = {
        "chat": ("/v1/chat/completions", {"messages": msgs, "max_tokens": ask}),
        "completions": ("/v1/completions", {"prompt": [9] * (CONTEXT - 3), "max_tokens": ask}),
        "messages": ("/v1/messages", {"messages": msgs, "max_tokens": ask}),
        "responses": ("/v1/responses", {"input": msgs, "max_output_tokens": ask}),
    }[route]
    if route != "completions":  # a long prompt: a few tokens left
        msgs[0]["content"] = " ".join(["hello"] * (CONTEXT - 40))
    r = c.post(path, json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    left = int(r.headers["x-mlxpaged-max-tokens-clamped"])
    j = r.json()
    usage = j.get("usage") or {}
    # Anthropic's input_tokens leave out the cached tokens (cache_read_input_tokens)
    n_prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0))
    n_out = usage.get("completion_tokens", usage.get("output_tokens"))
    assert 0 < left == CONTEXT - n_prompt and n_out <= left, (left, usage)
    if route == "completions":  # one token more than the context: still a 400
        r = c.post(path, json={"model": "tiny", "prompt": [9] * CONTEXT, "max_tokens": 4})
        assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route", ["chat", "messages", "responses"])
def test_a_silent_stream_is_kept_alive(agents, monkeypatch, route):
    """While the engine prefills (slowed by a hook), the stream sends beats: Anthropic's `ping`
    events on /v1/messages, `: keep-alive` comments on the OpenAI routes; the clients ignore them."""
    import time

    c, state, _, _ = agents
    monkeypatch.setattr(keepalive, "INTERVAL", 0.05)
    engine = state.engine_loop.engine
    step = engine.step
    slowed = []

    def slow_step():
        if not slowed:  # once: the first step of this request (its prefill)
            slowed.append(1)
            time.sleep(0.4)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    msgs = [{"role": "user", "content": "hi"}]
    path, body, beat = {
        "chat": ("/v1/chat/completions", {"messages": msgs, "max_tokens": 3}, ": keep-alive\n\n"),
        "messages": ("/v1/messages", {"messages": msgs, "max_tokens": 3}, 'event: ping\ndata: {"type": "ping"}\n\n'),
        "responses": ("/v1/responses", {"input": msgs, "max_output_tokens": 3}, ": keep-alive\n\n"),
    }[route]
    r = c.post(path, json={"model": "tiny", "stream": True, **body})
    assert r.status_code == 200 and slowed, r.text
    assert r.text.count(beat) >= 2, r.text[:600]
    events = [e for e in r.text.replace(beat, "").split("\n\n") if e]  # the beats sit between whole events
    datas = [ln[6:] for e in events for ln in e.splitlines() if ln.startswith("data: ")]
    assert len(datas) == len(events) and all(d == "[DONE]" or json.loads(d) for d in datas), events
    # The official clients read the same stream, beats and all.
    if route == "messages":
        slowed.clear()
        client = anthropic.Anthropic(base_url=str(c.base_url), api_key="unused", http_client=c)
        with client.messages.stream(model="tiny", **body) as s:
            assert s.get_final_message().stop_reason in ("max_tokens", "end_turn")
    elif route == "chat":
        slowed.clear()
        client = openai.OpenAI(base_url=str(c.base_url) + "/v1", api_key="unused", http_client=c)
        chunks = list(client.chat.completions.create(model="tiny", stream=True, **body))
        assert chunks and chunks[-1].choices[0].finish_reason is not None


def test_access_log_lines_and_4xx_reasons(agents, caplog):
    c, _, _, _ = agents
    caplog.set_level(logging.INFO, logger="mlxpaged.server")
    r = c.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]} | {"max_tokens": 2},
    )
    assert r.status_code == 200
    n_prompt, n_out = r.json()["usage"]["prompt_tokens"], r.json()["usage"]["completion_tokens"]
    r = c.post("/v1/messages", json={"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400
    assert c.get("/health").status_code == 200  # a probe: DEBUG only
    lines = [r.getMessage() for r in caplog.records if r.name == "mlxpaged.server" and r.levelno >= logging.INFO]
    assert not any(ln.startswith("GET /health") for ln in lines), lines
    assert any(ln.startswith(f"POST /v1/chat/completions 200 prompt={n_prompt} output={n_out} ") for ln in lines), lines
    assert any(ln.startswith("POST /v1/messages 404 ") and "unknown model 'nope'" in ln for ln in lines), lines
    assert any(ln.startswith("POST /v1/completions 400 ") and "max_tokens" in ln for ln in lines), lines


def metric(c, name: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_count_computed_and_cached_prompt_tokens(agents):
    """The same prompt twice: the second is served from the prefix cache (its full blocks), as
    its own usage says; the counters grow by each request's computed and cached tokens."""
    c, _, _, _ = agents
    before = metric(c, "mlxpaged_prompt_tokens_computed_total"), metric(c, "mlxpaged_prompt_tokens_cached_total")
    body = {"model": "tiny", "prompt": list(range(100, 180)), "max_tokens": 1}
    first = c.post("/v1/completions", json=body).json()["usage"]
    second = c.post("/v1/completions", json=body).json()["usage"]
    cached = (second.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached >= 64, second  # four full blocks of 16
    after = metric(c, "mlxpaged_prompt_tokens_computed_total"), metric(c, "mlxpaged_prompt_tokens_cached_total")
    assert after[1] - before[1] >= cached
    assert after[0] - before[0] >= first["prompt_tokens"] + second["prompt_tokens"] - cached


def test_models_gives_the_context_and_the_start_time(agents):
    import time

    c, _, _, _ = agents
    data = openai.OpenAI(base_url=str(c.base_url) + "/v1", api_key="unused", http_client=c).models.list().data
    assert [m.id for m in data] == [CLAUDE_MODEL]
    assert data[0].model_extra["max_model_len"] == CONTEXT
    assert time.time() - 3600 < data[0].created <= time.time()


IM_START, ENDOFTEXT, TOOL_CALL = 151644, 151643, 151657  # Qwen2.5's ids: two special tokens, one not


@pytest.mark.parametrize(
    "tail, bias",
    [((), {IM_START: 100}), ((), {ENDOFTEXT: 100}), ((TOOL_CALL,), {}), ((), {})],
    ids=["im_start", "endoftext", "tool_call", "words"],
)
def test_special_tokens_never_reach_the_text(agents, monkeypatch, tail, bias):
    """Greedy, the tiny model repeats its last token; biased, it samples a special one: the ids keep
    them, the text does not, and the text equals the `tokenizers` library's own decoding of the ids
    with skip_special_tokens (the reference). `<tool_call>`, an added token but not special, is text."""
    from tokenizers import Tokenizer

    c, state, tok, tok_dir = agents
    ref = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    outputs = []
    submit = state.engine_loop.submit

    def recording(prompt, params, rid, sink):
        put = sink.put
        # each delta's ids as it was put: the sink folds an unread delta into the next in place
        sink.put = lambda r, item: (
            outputs.append([t for c in item.outputs if c.index == 0 for t in c.token_ids]),
            put(r, item),
        )[1]
        return submit(prompt, params, rid, sink)

    monkeypatch.setattr(state.engine_loop, "submit", recording)
    prompt = tok.encode("The KV cache", add_special_tokens=False) + list(tail)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body["logit_bias"] = {str(k): v for k, v in bias.items()}
    text = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
    ids = [t for delta in outputs for t in delta]  # deltas, in order
    assert len(ids) == 6 and (not bias or set(ids) == set(bias)), ids  # the case under test happened
    want = ref.decode(ids, skip_special_tokens=True)
    # mlx-lm's streaming detokenizer drops the text's first leading space, as in its own generate
    assert text == (want[1:] if want.startswith(" ") else want), (text, want, ids)
    assert "<|im_start|>" not in text and "<|endoftext|>" not in text
    assert ("<tool_call>" in text) == (TOOL_CALL in ids) and (text != "") == (
        IM_START not in ids and ENDOFTEXT not in ids
    )


# Qwen3's switch, reduced: with thinking off the generation prompt holds an empty think block.
THINK_SWITCH = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.mark.parametrize(
    "route, field, off",
    [
        ("messages", {"thinking": {"type": "disabled"}}, True),
        ("messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, False),
        ("messages", {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}}, None),
        ("responses", {"reasoning": {"effort": "minimal"}}, True),
        ("responses", {"reasoning": {"effort": "high", "summary": "auto"}}, False),
        ("responses", {"reasoning": {"summary": "auto"}}, None),
    ],
)
def test_thinking_switches_a_reasoning_models_template(agents, monkeypatch, route, field, off):
    """On a reasoning model whose template reads `enable_thinking`, the prompt is the template's
    own rendering (mlx-lm's apply_chat_template, the reference) with enable_thinking false / true /
    left out (None: mlx-lm's default)."""
    from mlxpaged.server import reasoning

    c, state, tok, _ = agents
    # The tokenizer made a reasoning one: the markers, and where the prompt's think block stands
    monkeypatch.setattr(state, "think", reasoning.ThinkMarkers("<think>", "</think>"))
    monkeypatch.setattr(reasoning, "opens_thinking", lambda tokenizer, prompt: False)
    monkeypatch.setattr(tok._tokenizer, "chat_template", THINK_SWITCH)
    seen = recorded_prompts(state, monkeypatch)
    msgs = [{"role": "user", "content": "hi"}]
    if route == "messages":
        r = c.post("/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": msgs, **field})
    else:
        r = c.post("/v1/responses", json={"model": "tiny", "max_output_tokens": 2, "input": msgs, **field})
    assert r.status_code == 200, r.text
    kw = {} if off is None else {"enable_thinking": not off}
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw)  # mlx-lm's
    assert off is None or ("</think>" in want) == off
    assert seen[0] == tok.encode(want, add_special_tokens=False)


STRICT_SYSTEM = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System role must be first') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_late_system_message_is_folded_where_the_template_refuses_it(agents, monkeypatch):
    """A template that takes one system turn, first (as many do): Claude Code's late system
    message joins the first one, in order, instead of a 400."""
    c, state, tok, _ = agents
    monkeypatch.setattr(tok._tokenizer, "chat_template", STRICT_SYSTEM)
    seen = recorded_prompts(state, monkeypatch)
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "system", "content": "Late."},
        {"role": "user", "content": "bye"},
    ]
    r = c.post("/v1/messages", json={"model": "tiny", "max_tokens": 2, "system": "First.", "messages": msgs})
    assert r.status_code == 200, r.text
    folded = [{"role": "system", "content": "First.\n\nLate."}, *[m for m in msgs if m["role"] != "system"]]
    want = tok.apply_chat_template(folded, add_generation_prompt=True, tokenize=False)
    assert seen[0] == tok.encode(want, add_special_tokens=False)


def test_tokenize_and_detokenize_as_vllm_serves_them(agents):
    """lm-eval's remote tokenizer and token-counting scripts: `/tokenize` gives the ids the
    `tokenizers` library gives (the reference), `/detokenize` its text back; bad input is the
    route's 4xx naming the field."""
    from tokenizers import Tokenizer

    c, state, tok, tok_dir = agents
    ref = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    text = "def f(x):\n    return x  # héllo 🙂<|im_start|>"
    r = c.post("/tokenize", json={"model": "tiny", "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == ref.encode(text).ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == CONTEXT
    r = c.post("/detokenize", json={"model": "tiny", "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == ref.decode(body["tokens"], skip_special_tokens=False) == text
    ids = [1, 2, 3]
    assert c.post("/tokenize", json={"model": "tiny", "prompt": ids}).json()["tokens"] == ids
    vocab = state.capacity.vocab_size
    for path, bad, field in (
        ("/detokenize", {"model": "tiny", "tokens": [vocab]}, "tokens"),
        ("/tokenize", {"model": "tiny", "prompt": [vocab]}, "prompt"),
        ("/tokenize", {"model": "tiny", "prompt": ""}, "prompt"),
        ("/tokenize", {"model": "tiny", "prompt": 5}, "prompt"),
        ("/tokenize", {"model": "tiny"}, "prompt"),
        ("/tokenize", {"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ):
        r = c.post(path, json=bad)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (path, bad, r.text)
    assert c.post("/tokenize", json={"model": "nope", "prompt": "hi"}).status_code == 404
