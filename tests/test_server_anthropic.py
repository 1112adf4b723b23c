"""Anthropic's Messages API over real HTTP, driven by the official `anthropic` client.

References: `LLM.generate` in this process on the prompt the chat template writes (tokens and
text), the template itself through transformers (prompt lengths), jsonschema (forced calls).
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from mlxpaged import LLM, SamplingParams

from server_proc import Server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}}
]
GREEDY = {"temperature": 0.0}  # this client no longer sends temperature itself; the API still takes it


@pytest.fixture(scope="module")
def server(tiny_model_path):
    s = Server(tiny_model_path, "--num-blocks", "128")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(tiny_loaded):
    return LLM(tiny_loaded, num_blocks=256)


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def client(server, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def prompt_ids(tok, messages, tools=None) -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("stream", [False, True])
def test_text_matches_generate(server, llm, tok, tiny_model_path, stream):
    system = [{"type": "text", "text": "Blocks of sixteen"}, {"type": "text", "text": "tokens."}]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Write a Python function"}]}]
    ids = prompt_ids(
        tok,
        [
            {"role": "system", "content": "Blocks of sixteen\ntokens."},
            {"role": "user", "content": "Write a Python function"},
        ],
    )
    ref = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    kw = dict(model=str(tiny_model_path), max_tokens=12, system=system, messages=msgs, extra_body=GREEDY)
    if not stream:
        m = client(server).messages.create(**kw)
        assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == ref.text
        want = "max_tokens" if ref.finish_reason == "length" else "end_turn"
        assert (m.stop_reason, m.stop_sequence) == (want, None)
        assert (m.usage.input_tokens, m.usage.output_tokens) == (len(ids), len(ref.token_ids))
        return
    with httpx.Client(timeout=60) as h:  # the raw event sequence, as the protocol names it
        r = h.post(
            server.url + "/v1/messages",
            json={**{k: v for k, v in kw.items() if k != "extra_body"}, **GREEDY, "stream": True},
        )
        names = [ln[len("event: ") :] for ln in r.text.splitlines() if ln.startswith("event: ")]
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert set(names[2:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    with client(server).messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == ref.text == final.content[0].text
    assert final.usage.output_tokens == len(ref.token_ids)


def test_stop_sequence_is_reported(server, llm, tok, tiny_model_path):
    ids = prompt_ids(tok, [{"role": "user", "content": "Paged attention"}])
    full = llm.generate(ids, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0].text
    stop = full[10:13]
    for stream in (False, True):
        kw = dict(
            model=str(tiny_model_path),
            max_tokens=30,
            messages=[{"role": "user", "content": "Paged attention"}],
            stop_sequences=["\x00never", stop],
            extra_body=GREEDY,
        )
        if stream:
            with client(server).messages.stream(**kw) as s:
                text = "".join(s.text_stream)
                m = s.get_final_message()
        else:
            m = client(server).messages.create(**kw)
            text = m.content[0].text
        assert text == full[: full.index(stop)]
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)


def test_count_tokens_is_the_templates_length(server, tok, tiny_model_path):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    n = (
        client(server)
        .messages.count_tokens(model=str(tiny_model_path), messages=msgs, system="Be brief.", tools=TOOLS)
        .input_tokens
    )
    assert n == len(prompt_ids(tok, [{"role": "system", "content": "Be brief."}, *msgs], OPENAI_TOOLS))
    n = client(server).messages.count_tokens(model=str(tiny_model_path), messages=msgs).input_tokens
    assert n == len(prompt_ids(tok, msgs))


def test_tool_result_follow_up_goes_through_the_template(server, tok, tiny_model_path):
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    ref = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    c = client(server)
    n = c.messages.count_tokens(model=str(tiny_model_path), messages=msgs, tools=TOOLS).input_tokens
    assert n == len(prompt_ids(tok, ref, OPENAI_TOOLS))
    m = c.messages.create(model=str(tiny_model_path), max_tokens=3, messages=msgs, tools=TOOLS, extra_body=GREEDY)
    assert m.usage.input_tokens == n


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_turn_and_its_result(server, tiny_model_path, stream):
    """tool_choice any: the grammar makes the tiny random model call the tool, with valid input."""
    c = client(server)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(
        model=str(tiny_model_path),
        max_tokens=200,
        messages=msgs,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 1.0},
    )
    if stream:
        with c.messages.stream(**kw) as s:
            events = list(s)
            m = s.get_final_message()
        assert any(e.type == "input_json" for e in events)  # input_json_delta events arrived
    else:
        m = c.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER)
    follow = msgs + [
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny, 21 C"}]},
    ]
    m2 = c.messages.create(
        model=str(tiny_model_path),
        max_tokens=5,
        messages=follow,
        tools=TOOLS,
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert m2.stop_reason in ("end_turn", "max_tokens") and m2.content[0].type == "text"


def test_tool_choice_tool_forces_that_tool(server, tiny_model_path):
    tz = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}}, "required": ["tz"]}
    tools = TOOLS + [{"name": "get_time", "input_schema": tz}]
    m = client(server).messages.create(
        model=str(tiny_model_path),
        max_tokens=200,
        tools=tools,
        messages=[{"role": "user", "content": "Weather?"}],
        tool_choice={"type": "tool", "name": "get_time"},
        extra_body={"temperature": 1.0},
    )
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and [u.name for u in uses] == ["get_time"]
    jsonschema.validate(uses[0].input, tools[1]["input_schema"])


def test_json_schema_output_validates(server, tiny_model_path):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    m = client(server).messages.create(
        model=str(tiny_model_path),
        max_tokens=100,
        messages=[{"role": "user", "content": "a number"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"temperature": 1.0},
    )
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


BAD = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "narrator", "content": "x"}]}, "messages.0.role"),  # system is a role Claude Code sends
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"tool_choice": {"type": "tool"}, "tools": TOOLS}, "tool_choice.name"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "'nope'"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"tools": [{"name": "x y", "input_schema": {}}]}, "tools.0.name"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"output_config": {"effort": "huge"}}, "effort"),
    (
        {
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
            "tool_choice": {"type": "any"},
            "tools": TOOLS,
        },
        "cannot be combined",
    ),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]}, "tool_result"),
]


def test_bad_inputs_get_anthropic_error_object(server, tiny_model_path):
    base = {"model": str(tiny_model_path), "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=30) as h:
        for extra, words in BAD:
            body = {k: v for k, v in {**base, **extra}.items() if v is not None}
            r = h.post(server.url + "/v1/messages", json=body)
            assert r.status_code == 400, (extra, r.text)
            j = r.json()
            assert j["type"] == "error" and set(j["error"]) == {"type", "message"}, j
            assert j["error"]["type"] == "invalid_request_error" and words in j["error"]["message"], (extra, j)
        r = h.post(server.url + "/v1/messages", json={**base, "model": "claude-unknown"})  # as Anthropic: 404
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
        assert "claude-unknown" in r.json()["error"]["message"]
        r = h.post(server.url + "/v1/messages", content=b"{oops", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["type"] == "error" and "JSON" in r.json()["error"]["message"]
        r = h.post(server.url + "/v1/messages/count_tokens", json={"model": str(tiny_model_path), "messages": "hi"})
        assert r.status_code == 400 and r.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError) as e:  # the client reads it as Anthropic's error
        client(server).messages.create(model=str(tiny_model_path), max_tokens=4, messages=[])
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_x_api_key_authenticates(tiny_model_path):
    s = Server(tiny_model_path, "--num-blocks", "64", "--api-key", "sekret")
    try:
        kw = dict(model=str(tiny_model_path), max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert client(s, api_key="sekret").messages.create(**kw).usage.output_tokens >= 1
        with pytest.raises(anthropic.AuthenticationError) as e:
            client(s, api_key="wrong").messages.create(**kw)
        assert e.value.body["error"]["type"] == "authentication_error"
        r = httpx.post(s.url + "/v1/messages", json=kw, headers={"Authorization": "Bearer sekret"}, timeout=30)
        assert r.status_code == 200
        r = httpx.post(s.url + "/v1/messages", json=kw, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    finally:
        s.stop()


def test_a_failed_step_is_anthropics_error(tiny_loaded, monkeypatch):
    """An engine fault: a 500 `api_error` object, or, once streaming, an `error` event."""
    import mlx.core as mx
    from fastapi.testclient import TestClient

    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.llm_engine import LLMEngine
    from mlxpaged.server.app import build_app
    from mlxpaged.server.engine_loop import EngineLoop
    from mlxpaged.server.metrics import Metrics

    mx.eval(tiny_loaded.model.parameters())
    loop = EngineLoop(lambda: LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=64)))
    loop.start()
    app = build_app(loop, Metrics(), model_id="tiny")
    real = loop.engine._forward

    def broken(*a, **kw):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(loop.engine, "_forward", broken)
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app) as c:
        r = c.post("/v1/messages", json=body)
        assert r.status_code == 500 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "api_error" and "injected fault" in r.json()["error"]["message"]
        text = c.post("/v1/messages", json={**body, "stream": True}).text
        assert text.startswith("event: message_start") and "event: error" in text and "injected fault" in text
        assert "message_stop" not in text
        monkeypatch.setattr(loop.engine, "_forward", real)
        assert c.post("/v1/messages", json=body).status_code == 200
