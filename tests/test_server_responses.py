"""OpenAI's Responses API over real HTTP, driven by the official `openai` client.

References: `LLM.generate` in this process on the prompt the chat template writes, the template
itself through transformers (input lengths), jsonschema (forced calls and `text.format`).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from mlxpaged import LLM, SamplingParams

from server_proc import Server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}}
]
STORE = 3


@pytest.fixture(scope="module")
def server(tiny_model_path):
    s = Server(tiny_model_path, "--num-blocks", "128", "--responses-store", str(STORE))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(tiny_loaded):
    return LLM(tiny_loaded, num_blocks=256)


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def prompt_ids(tok, messages, tools=None) -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("stream", [False, True])
def test_text_matches_generate(server, llm, tok, tiny_model_path, stream):
    ids = prompt_ids(
        tok,
        [
            {"role": "system", "content": "Blocks of sixteen tokens."},
            {"role": "user", "content": "Write a Python function"},
        ],
    )
    ref = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    kw = dict(
        model=str(tiny_model_path),
        instructions="Blocks of sixteen tokens.",
        input="Write a Python function",
        max_output_tokens=12,
        temperature=0,
    )
    if not stream:
        r = server.client().responses.create(**kw)
        assert r.object == "response" and r.id.startswith("resp_")
        assert r.output_text == ref.text and [o.type for o in r.output] == ["message"]
        assert r.status == ("incomplete" if ref.finish_reason == "length" else "completed")
        assert (r.usage.input_tokens, r.usage.output_tokens) == (len(ids), len(ref.token_ids))
        return
    events = list(server.client().responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-1] == ("response.incomplete" if ref.finish_reason == "length" else "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ref.text
    assert events[-1].response.output_text == ref.text
    assert events[-1].response.usage.output_tokens == len(ref.token_ids)


def test_function_call_items_go_through_the_template(server, tok, tiny_model_path):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    r = server.client().responses.create(
        model=str(tiny_model_path), input=items, tools=TOOLS, max_output_tokens=2, temperature=0
    )
    ref = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    assert r.usage.input_tokens == len(prompt_ids(tok, ref, CHAT_TOOLS))


@pytest.mark.parametrize("stream", [False, True])
def test_forced_function_call_and_its_output(server, tok, tiny_model_path, stream):
    c = server.client()
    kw = dict(
        model=str(tiny_model_path),
        input="Weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=1.0,
    )
    if stream:
        events = list(c.responses.create(**kw, stream=True))
        types = [e.type for e in events]
        assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        r = events[-1].response
        assert events[-1].type == "response.completed" and r.output[-1].arguments == args
    else:
        r = c.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    # the client sends the call back with its output; stateless, so the whole history goes again
    follow = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
    ]
    r2 = c.responses.create(
        model=str(tiny_model_path), input=follow, tools=TOOLS, tool_choice="none", max_output_tokens=3, temperature=0
    )
    assert r2.output[0].type == "message"
    # tool_choice none leaves the tools out of the prompt
    ref = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": calls[0].call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.loads(calls[0].arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"},
    ]
    assert r2.usage.input_tokens == len(prompt_ids(tok, ref))


def test_text_format_json_schema_validates(server, tiny_model_path):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    r = server.client().responses.create(
        model=str(tiny_model_path),
        input="Give me a record",
        text={"format": {"type": "json_schema", "name": "rec", "schema": schema}},
        max_output_tokens=100,
        temperature=1.0,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_previous_response_id_continues_and_is_bounded(server, llm, tok, tiny_model_path):
    c = server.client()
    kw = dict(model=str(tiny_model_path), max_output_tokens=4, temperature=0)
    first = c.responses.create(input="The KV cache", **kw)
    second = c.responses.create(input="Paged attention", previous_response_id=first.id, **kw)
    history = [
        {"role": "user", "content": "The KV cache"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Paged attention"},
    ]
    ids = prompt_ids(tok, history)
    assert second.usage.input_tokens == len(ids)
    assert second.output_text == llm.generate(ids, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    for i in range(STORE):  # push `first` out of the LRU (second was used more recently)
        c.responses.create(input=f"filler {i}", **kw)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(input="more", previous_response_id=first.id, **kw)
    assert e.value.body["param"] == "previous_response_id" and f"--responses-store {STORE}" in e.value.body["message"]
    nostore = c.responses.create(input="x", store=False, **kw)
    with pytest.raises(openai.BadRequestError):
        c.responses.create(input="more", previous_response_id=nostore.id, **kw)


def test_stateless_server_names_the_limit(tiny_model_path):
    s = Server(tiny_model_path, "--num-blocks", "64")
    try:
        c = s.client()
        r = c.responses.create(model=str(tiny_model_path), input="hi", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model=str(tiny_model_path), input="more", previous_response_id=r.id, max_output_tokens=2)
        assert e.value.body["param"] == "previous_response_id" and "--responses-store" in e.value.body["message"]
    finally:
        s.stop()


BAD = [
    ({"input": 3}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"tools": [{"type": "teleport"}]}, "tools"),  # a hosted tool (web_search) is accepted, not offered
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text"),
    ({"reasoning": {"effort": "huge"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
]


def test_bad_inputs_get_openai_error_object(server, tiny_model_path):
    with httpx.Client(timeout=30) as h:
        for extra, param in BAD:
            body = {"model": str(tiny_model_path), "input": "hi", "max_output_tokens": 2, **extra}
            r = h.post(server.url + "/v1/responses", json=body)
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
            assert err["param"] == param, (extra, err)
        r = h.post(server.url + "/v1/responses", json={"model": "gpt-unknown", "input": "hi"})  # OpenAI's 404
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_a_failed_step_is_an_error_object(tiny_loaded, monkeypatch):
    """An engine fault: a 500 OpenAI error object, or, once streaming, an `error` event."""
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

    def broken(*a, **kw):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(loop.engine, "_forward", broken)
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4}
    with TestClient(app) as c:
        r = c.post("/v1/responses", json=body)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "server_error"
        text = c.post("/v1/responses", json={**body, "stream": True}).text
        assert text.startswith("event: response.created") and "event: error" in text and "injected fault" in text
        assert "response.completed" not in text
