"""Ollama's API over real HTTP, driven by the official `ollama` Python client; and OpenAI's
`GET /v1/models/{id}` through the `openai` client.

References: the OpenAI chat and completions routes of the same server for the same greedy
request (tokens, text, counts), the chat template through transformers (prompt lengths),
`jsonschema` (formats and tool arguments), the checkpoint's own files (sizes, parameter count,
context, template).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import jsonschema
import ollama
import openai
import pytest

import mlxpaged

from server_proc import Server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}}
]
# A whole answer that is one call object naming an offered function is a call (tools.py); this
# format makes the tiny random model write one, so the parsed call comes back in Ollama's shape.
CALL = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER},
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
# The tools as the client sends them: its `Tool` type keeps only some schema keywords (no maxLength).
SENT_TOOLS = [ollama.Tool.model_validate(t).model_dump(exclude_none=True) for t in TOOLS]
GREEDY = {"temperature": 0.0, "num_predict": 12}
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def server(tiny_model_path):
    s = Server(tiny_model_path, "--num-blocks", "128")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def name(server):
    return server.client().models.list().data[0].id


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url)


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def prompt_len(tok, messages, tools=None) -> int:
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return len(tok.encode(text, add_special_tokens=False))


def openai_chat(server, name, messages, max_tokens=12, **kw):
    r = server.client().chat.completions.create(
        model=name, messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )
    return r.choices[0], r.usage


def test_list_show_ps_and_version_describe_the_checkpoint(client, name, tiny_model_path):
    import mlx.core as mx

    config = json.loads((tiny_model_path / "config.json").read_text())
    on_disk = sum(f.stat().st_size for f in tiny_model_path.rglob("*") if f.is_file())
    weights = {k: v for f in tiny_model_path.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    (m,) = client.list().models
    assert m.model == name and m.size == on_disk and m.modified_at is not None
    assert m.details.family == config["model_type"] and m.details.format == "safetensors"
    assert m.details.quantization_level == "F32"  # served in float32 (the server tests' --dtype)
    s = client.show(name)
    assert s.modelinfo["general.parameter_count"] == sum(v.size for v in weights.values())
    assert s.modelinfo[f"{config['model_type']}.context_length"] == config["max_position_embeddings"]
    template = json.loads((tiny_model_path / "tokenizer_config.json").read_text())["chat_template"]
    assert s.template == template and "tools" in s.capabilities and "vision" not in s.capabilities
    assert client.show(name + ":latest").details == s.details  # Ollama's default tag names it too
    (p,) = client.ps().models
    assert p.model == name and p.context_length == config["max_position_embeddings"]
    assert p.size == sum(v.nbytes for v in weights.values())  # float32 on disk, float32 in memory
    assert httpx.get(client._client.base_url.join("/api/version")).json() == {"version": mlxpaged.__version__}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_the_openai_route(server, client, name, tok, stream):
    messages = [{"role": "system", "content": "Blocks of sixteen"}, {"role": "user", "content": "Write a Python"}]
    ref, usage = openai_chat(server, name, messages)
    assert usage.prompt_tokens == prompt_len(tok, messages)
    if stream:
        parts = list(client.chat(name, messages=messages, options=GREEDY, stream=True))
        assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
        text, last = "".join(p.message.content or "" for p in parts), parts[-1]
    else:
        last = client.chat(name, messages=messages, options=GREEDY)
        text = last.message.content
    assert text == ref.message.content and last.message.role == "assistant"
    assert (last.prompt_eval_count, last.eval_count) == (usage.prompt_tokens, usage.completion_tokens)
    assert last.done_reason == ref.finish_reason  # "length" or "stop", as both name them
    assert last.total_duration >= last.prompt_eval_duration > 0 and last.eval_duration >= 0
    assert last.model == name


@pytest.mark.parametrize("stream", [False, True])
def test_generate_templated_and_raw(server, client, name, stream):
    def run(**kw):
        if not stream:
            return client.generate(name, options=GREEDY, **kw)
        parts = list(client.generate(name, options=GREEDY, stream=True, **kw))
        assert parts[-1].done and not any(p.done for p in parts[:-1])
        parts[-1].response = "".join(p.response for p in parts)
        return parts[-1]

    ref, usage = openai_chat(
        server, name, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paged attention"}]
    )
    g = run(prompt="Paged attention", system="Be brief.")
    assert (g.response, g.prompt_eval_count, g.eval_count) == (
        ref.message.content,
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    raw = server.client().completions.create(model=name, prompt="The KV cache", max_tokens=12, temperature=0)
    g = run(prompt="The KV cache", raw=True)
    assert (g.response, g.eval_count) == (raw.choices[0].text, raw.usage.completion_tokens)
    assert g.prompt_eval_count == raw.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_come_back_as_objects_and_go_back_through_the_template(client, name, tok, stream):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(messages=messages, tools=TOOLS, format=CALL, options={"temperature": 1.0, "seed": 3, "num_predict": 60})
    if stream:
        parts = list(client.chat(name, stream=True, **kw))
        calls = [c for p in parts for c in p.message.tool_calls or []]
        last, content = parts[-1], "".join(p.message.content or "" for p in parts)
    else:
        last = client.chat(name, **kw)
        calls, content = list(last.message.tool_calls or []), last.message.content
    assert last.done_reason == "stop" and content == ""
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    args = dict(calls[0].function.arguments)  # an object, not JSON text
    jsonschema.validate(args, WEATHER)
    assert last.prompt_eval_count == prompt_len(tok, messages, SENT_TOOLS)
    # the call and its result, sent back: the template renders them (tool_calls with object arguments)
    follow = messages + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"},
    ]
    r = client.chat(name, messages=follow, tools=TOOLS, options=GREEDY)
    ref = follow[:1] + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": args}}],
        },
        {"role": "tool", "content": "sunny, 21 C"},
    ]
    assert r.prompt_eval_count == prompt_len(tok, ref, SENT_TOOLS)


@pytest.mark.parametrize("stream", [False, True])
def test_format_schema_and_json(client, name, stream):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    opts = {"temperature": 1.0, "seed": 5, "num_predict": 200}
    for fmt in (schema, "json"):
        msgs = [{"role": "user", "content": "A record, please"}]
        if stream:
            parts = list(client.chat(name, messages=msgs, format=fmt, options=opts, stream=True))
            text, last = "".join(p.message.content for p in parts), parts[-1]
        else:
            last = client.chat(name, messages=msgs, format=fmt, options=opts)
            text = last.message.content
        assert last.done_reason == "stop"
        value = json.loads(text)
        jsonschema.validate(value, schema if fmt == schema else {"type": "object"})


def test_open_webui_request(server, name, tok):
    """Chat bodies in the shape Open WebUI's Ollama payload converter builds them (written from its
    source, `convert_payload_openai_to_ollama`): options with num_ctx, num_predict and stop,
    keep_alive, stream; a tool round with OpenAI's call `id` and `index` and the result's
    `tool_call_id` kept alongside Ollama's fields."""
    body = json.loads((DATA / "open_webui_ollama_chat.json").read_text())
    body["model"] = name + ":latest"  # the name /api/tags listed, with Ollama's default tag
    with httpx.Client(timeout=60) as h:
        r = h.post(server.url + "/api/chat", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert all(not x["done"] for x in lines[:-1]) and lines[-1]["done"]
    ref, usage = openai_chat(
        server, name, body["messages"], max_tokens=body["options"]["num_predict"], stop=body["options"]["stop"]
    )
    assert "".join(x["message"]["content"] for x in lines) == ref.message.content
    assert lines[-1]["eval_count"] == usage.completion_tokens
    assert lines[-1]["prompt_eval_count"] == usage.prompt_tokens
    assert lines[-1]["model"] == body["model"]

    body = json.loads((DATA / "open_webui_ollama_chat_tools.json").read_text())
    body["model"] = name
    r = httpx.post(server.url + "/api/chat", json=body, timeout=60)
    assert r.status_code == 200, r.text
    call = body["messages"][1]["tool_calls"][0]
    ref = [
        body["messages"][0],
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call["function"]}]},
        {"role": "tool", "content": "sunny, 21 C"},
    ]
    assert r.json()["prompt_eval_count"] == prompt_len(tok, ref, body["tools"])
    assert r.json()["done"] and r.json()["eval_count"] <= body["options"]["num_predict"]


def test_refusals_name_what_is_refused(server, client, name):
    def post(path, body, status):
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == status, r.text
        assert list(r.json()) == ["error"]  # Ollama's error object
        return r.json()["error"]

    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    assert "mirostat" in post("/api/chat", {**chat, "options": {"mirostat": 1}}, 400)
    assert "logprobs" in post("/api/chat", {**chat, "logprobs": True}, 400)
    img = {**chat, "messages": [{"role": "user", "content": "what is this?", "images": ["aGk="]}]}
    # a text-only model: the admission path's refusal, in the words every route gives
    assert post("/api/chat", img, 400) == f"model {name} takes no images (it has no vision tower)"
    generate_img = {"model": name, "prompt": "what is this?", "images": ["aGk="], "stream": False}
    assert post("/api/generate", generate_img, 400) == f"model {name} takes no images (it has no vision tower)"
    assert "keep_alive" in post("/api/chat", {**chat, "keep_alive": "five minutes"}, 400)
    assert "think" in post("/api/chat", {**chat, "think": True}, 400)  # the tiny model does not reason
    assert "num_ctx" in post("/api/chat", {**chat, "options": {"num_ctx": 3}}, 400)
    # the admission path's limits, in this API's field names
    assert post("/api/chat", {**chat, "options": {"stop": ["x"] * 100}}, 400).startswith("options.stop has 100")
    assert "not found" in post("/api/show", {"model": "llama3.2"}, 404)
    assert "suffix" in post("/api/generate", {"model": name, "prompt": "def f(", "suffix": "return 1"}, 400)
    assert "truncate" in post("/api/embed", {"model": name, "input": "hi", "truncate": True}, 400)
    assert "not found" in post("/api/chat", {**chat, "model": "llama3.2"}, 404)
    assert post("/api/pull", {"model": name}, 404)  # not served here: `mlxpaged pull` fetches models
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404
    # accepted: keep_alive in its forms, and a body with no messages (Ollama's way to load a model)
    for keep in ("5m", "1h30m", -1, 0, "0"):
        r = client.chat(name, messages=[], keep_alive=keep)
        assert r.done and r.done_reason == ("unload" if keep in (0, "0") else "load")


def test_openai_models_retrieve(server, name, tiny_model_path):
    config = json.loads((tiny_model_path / "config.json").read_text())
    c = server.client()
    m = c.models.retrieve(name)
    assert m.id == name and m.object == "model"
    assert m.model_extra["max_model_len"] == config["max_position_embeddings"]
    assert c.models.retrieve(str(tiny_model_path)).id == name  # an alias names the same model
    assert c.models.list().data[0].model_dump() == m.model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found" and "gpt-4o" in e.value.body["message"]


def test_api_key_refusal_is_ollamas_error_object(tiny_model_path):
    s = Server(tiny_model_path, "--num-blocks", "32", "--api-key", "k1")
    try:
        r = httpx.get(s.url + "/api/tags", timeout=10)
        assert r.status_code == 401 and list(r.json()) == ["error"]
        ok = ollama.Client(host=s.url, headers={"Authorization": "Bearer k1"})
        assert ok.list().models[0].model == os.path.basename(str(tiny_model_path))
    finally:
        s.stop()
