"""One output path: a route's non-streamed answer equals its stream as the official client adds it up.

For the same greedy request, the streamed answer reassembled by the official SDKs (the `openai`
client's `chat.completions.stream(...)` snapshot and `responses.stream(...)`'s
last event, the `anthropic` client's `messages.stream(...).get_final_message()`) and
the non-streamed answer must agree on the content, the tool calls, the reasoning, the finish
reason and the usage, on chat, Messages and Responses. Each request has its own `cache_salt`, so
neither takes the other's blocks from the prefix cache and the usage counts the same prompt work.
Ollama's /api/chat and /api/generate, which no SDK adds up, are compared with their NDJSON lines
joined; and a non-streamed request whose client leaves is aborted.

Also here: Claude Code's billing line (`x-anthropic-billing-header: ...`, the first system block,
different in every request in some versions) is not templated, so a conversation's second turn
takes the first turn's blocks from the prefix cache.
"""

from __future__ import annotations

import dataclasses
import json
import uuid

import anthropic
import openai
import pytest

TOOLS = {  # bounded arguments: the tiny random model closes them well before max_tokens
    "get_weather": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
THINK_QUESTION = [{"role": "user", "content": "The KV cache stores"}]  # the thinker's corpus


def _app(loaded, blocks: int = 128):
    import mlx.core as mx

    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.llm_engine import LLMEngine
    from mlxpaged.server.app import build_app
    from mlxpaged.server.engine_loop import EngineLoop
    from mlxpaged.server.metrics import Metrics

    mx.eval(loaded.model.parameters())
    loop = EngineLoop(lambda: LLMEngine(loaded, EngineConfig.of(num_blocks=blocks)))
    loop.start()
    return build_app(loop, Metrics(), model_id="tiny")


@pytest.fixture(scope="module")
def tiny(tiny_loaded):
    from fastapi.testclient import TestClient

    with TestClient(_app(tiny_loaded)) as c:
        yield c


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A tiny model whose template opens a think block in the generation prompt (Qwen3's way)."""
    from fastapi.testclient import TestClient

    from mlxpaged.loading.loader import load
    from mlxpaged.testing.tiny_model import write_tiny_thinker

    loaded = load(str(write_tiny_thinker(tmp_path_factory.mktemp("thinker"))), "float32")
    assert loaded.tokenizer.has_thinking
    with TestClient(_app(loaded, 64)) as c:
        yield c, loaded.tokenizer


def salt() -> str:
    return uuid.uuid4().hex


def _openai(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(c.base_url) + "/v1", api_key="unused", http_client=c)


def _anthropic(c) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=str(c.base_url), api_key="unused", http_client=c)


def _no_ids(obj):
    """The answer without the ids each request draws anew (message, call and item ids), and the
    openai SDK's own `parsed_arguments`, which only its stream helper adds."""
    if isinstance(obj, dict):
        drop = ("id", "call_id", "created", "created_at", "parsed_arguments")  # the last: the SDK's stream parse
        return {k: _no_ids(v) for k, v in obj.items() if k not in drop}
    if isinstance(obj, list):
        return [_no_ids(v) for v in obj]
    return obj


def chat_pair(c, **kw) -> tuple[dict, dict]:
    """(streamed and reassembled by the openai client, whole) choice and usage of one chat request."""
    client, extra = _openai(c), kw.pop("extra", {})
    with client.chat.completions.stream(
        model="tiny", stream_options={"include_usage": True}, extra_body={"cache_salt": salt(), **extra}, **kw
    ) as s:
        for _ in s:  # the SDK adds the chunks up (get_final_completion() refuses a "length" finish)
            pass
        streamed = s.current_completion_snapshot
    whole = client.chat.completions.create(model="tiny", extra_body={"cache_salt": salt(), **extra}, **kw)

    def summary(r) -> dict:
        ch = r.choices[0]
        m = ch.message
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]
        reasoning = (m.model_extra or {}).get("reasoning_content")
        return {
            "content": m.content or "",  # a stream that sent no content leaves the SDK's content None
            "calls": calls,
            "reasoning": reasoning,
            "finish": ch.finish_reason,
            "usage": r.usage.model_dump(),
        }

    return summary(streamed), summary(whole)


def messages_pair(c, **kw) -> tuple[dict, dict]:
    client = _anthropic(c)  # recent anthropic SDKs take temperature only as an extra field
    with client.messages.stream(model="tiny", extra_body={"cache_salt": salt(), **GREEDY}, **kw) as s:
        streamed = s.get_final_message()
    whole = client.messages.create(model="tiny", extra_body={"cache_salt": salt(), **GREEDY}, **kw)
    fields = ("content", "stop_reason", "stop_sequence", "usage", "role", "model")
    return tuple(_no_ids(m.model_dump(include=set(fields))) for m in (streamed, whole))


def responses_pair(c, **kw) -> tuple[dict, dict]:
    client = _openai(c)
    with client.responses.stream(model="tiny", extra_body={"cache_salt": salt()}, **kw) as s:
        streamed = list(s)[-1].response  # response.completed or .incomplete, as the SDK parsed it
    whole = client.responses.create(model="tiny", extra_body={"cache_salt": salt()}, **kw)
    fields = ("output", "status", "incomplete_details", "usage")
    return tuple(_no_ids(r.model_dump(include=set(fields))) for r in (streamed, whole))


GREEDY = {"temperature": 0}


@pytest.mark.parametrize("case", ["text", "forced call", "call cut by max_tokens"])
def test_chat_whole_answer_is_the_stream_added_up(tiny, case):
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in TOOLS.items()]
    kw = dict(messages=QUESTION, max_tokens=12, **GREEDY)
    if case != "text":
        kw.update(tools=tools, tool_choice="required", max_tokens=120 if case == "forced call" else 9)
    streamed, whole = chat_pair(tiny, **kw)
    assert streamed == whole
    if case == "forced call":
        assert whole["finish"] == "tool_calls" and [n for n, _ in whole["calls"]] == ["get_weather"], whole
    if case == "call cut by max_tokens":  # the span the cap cut stays text, in both
        assert whole["finish"] == "length" and whole["calls"] == [] and whole["content"].startswith("<tool_call"), whole


@pytest.mark.parametrize("case", ["text", "forced call", "call cut by max_tokens"])
def test_messages_whole_answer_is_the_stream_added_up(tiny, case):
    kw = dict(messages=QUESTION, max_tokens=12)
    if case != "text":
        kw.update(tools=[{"name": n, "input_schema": s} for n, s in TOOLS.items()], tool_choice={"type": "any"})
        kw["max_tokens"] = 120 if case == "forced call" else 9
    streamed, whole = messages_pair(tiny, **kw)
    assert streamed == whole
    kinds = [b["type"] for b in whole["content"]]
    if case == "forced call":
        assert whole["stop_reason"] == "tool_use" and "tool_use" in kinds, whole
    if case == "call cut by max_tokens":
        assert whole["stop_reason"] == "max_tokens" and kinds == ["text"], whole


@pytest.mark.parametrize("case", ["text", "forced call", "call cut by max_tokens"])
def test_responses_whole_answer_is_the_stream_added_up(tiny, case):
    kw = dict(input=QUESTION, max_output_tokens=12, temperature=0)
    if case != "text":
        kw.update(tools=[{"type": "function", "name": n, "parameters": s} for n, s in TOOLS.items()])
        kw.update(tool_choice="required", max_output_tokens=120 if case == "forced call" else 9)
    streamed, whole = responses_pair(tiny, **kw)
    assert streamed == whole
    kinds = [o["type"] for o in whole["output"]]
    if case == "forced call":
        assert whole["status"] == "completed" and "function_call" in kinds, whole
    if case == "call cut by max_tokens":
        assert whole["status"] == "incomplete" and kinds == ["message"], whole


def test_a_second_call_cut_by_max_tokens_follows_the_first(tiny, tiny_loaded, monkeypatch):
    """Messages, `tool_choice` any, the end tokens banned so that after its first call the grammar
    has the model start a second one, which `max_tokens` cuts: the message has the first call's
    `tool_use` block and then the cut span as text, in the order written, as the stream sends them
    (the cut span used to come first, before the `tool_use`, in the whole message only)."""
    loop = tiny.app.state.server.engine_loop
    submit, ends = loop.submit, set(tiny_loaded.tokenizer.eos_token_ids)

    def never_ending(prompt, params, rid, sink):
        return submit(prompt, dataclasses.replace(params, logit_bias={t: -100 for t in ends}), rid, sink)

    monkeypatch.setattr(loop, "submit", never_ending)
    tools = [{"name": n, "input_schema": s} for n, s in TOOLS.items()]
    streamed, whole = messages_pair(tiny, messages=QUESTION, max_tokens=110, tools=tools, tool_choice={"type": "any"})
    assert streamed == whole
    kinds = [b["type"] for b in whole["content"]]
    assert whole["stop_reason"] == "max_tokens" and kinds == ["tool_use", "text"], whole
    assert whole["content"][0]["name"] == "get_weather" and whole["content"][1]["text"].startswith("<tool_call>")


def test_reasoning_whole_answer_is_the_stream_added_up(thinker):
    """Reasoning and an answer (a biased `</think>` closes the block mid-answer) on chat; reasoning
    alone (the block never closes) as Messages' thinking block and Responses' reasoning item."""
    c, tok = thinker
    end = tok.encode("</think>", add_special_tokens=False)
    streamed, whole = chat_pair(
        c, messages=THINK_QUESTION, max_tokens=24, extra={"logit_bias": {str(end[0]): 5}}, **GREEDY
    )
    assert streamed == whole and streamed["reasoning"] and streamed["content"], streamed
    streamed, whole = messages_pair(c, messages=THINK_QUESTION, max_tokens=24)
    assert streamed == whole and [b["type"] for b in whole["content"]] == ["thinking", "text"], whole
    streamed, whole = responses_pair(c, input=THINK_QUESTION, max_output_tokens=24, temperature=0)
    assert streamed == whole and [o["type"] for o in whole["output"]][0] == "reasoning", whole


# -- Claude Code's billing line --------------------------------------------------------------------
def claude_code_turn(messages: list, billing: str) -> dict:
    """A Messages body in Claude Code's shape: the billing line as the first system block."""
    system = [
        {
            "type": "text",
            "text": f"x-anthropic-billing-header: cc_version=2.1.332.{billing}; cc_entrypoint=cli; cch={billing};",
        },
        {
            "type": "text",
            "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.",
            "cache_control": {"type": "ephemeral"},
        },
        {
            "type": "text",
            "text": "You help users with software engineering tasks. " * 12,
            "cache_control": {"type": "ephemeral"},
        },
    ]
    return {"model": "tiny", "max_tokens": 8, "temperature": 0, "system": system, "messages": messages}


def test_a_changing_billing_line_keeps_the_first_turns_blocks_cached(tiny):
    """Two turns of one conversation whose billing lines differ: the second takes every full block of
    the first turn's prompt from the prefix cache (block size 16)."""
    first = [{"role": "user", "content": "Write a function that reverses a string."}]
    r1 = tiny.post("/v1/messages", json=claude_code_turn(first, "a1b2c"))
    assert r1.status_code == 200, r1.text
    m1 = r1.json()
    n1 = m1["usage"]["input_tokens"] + m1["usage"]["cache_read_input_tokens"]
    assert n1 > 32
    second = first + [
        {"role": "assistant", "content": m1["content"]},
        {"role": "user", "content": "Now make it handle None."},
    ]
    r2 = tiny.post("/v1/messages", json=claude_code_turn(second, "f9e8d"))
    assert r2.status_code == 200, r2.text
    assert r2.json()["usage"]["cache_read_input_tokens"] >= n1 // 16 * 16, (n1, r2.json()["usage"])


# -- a client gone while a whole answer is computed -------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_model_path):
    from server_proc import Server

    s = Server(tiny_model_path, "--num-blocks", "256")
    yield s
    s.stop()


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_client_gone_before_the_whole_answer_aborts_it(served, tiny_model_path, route):
    """A non-streamed request whose client gives up: collecting the events stops, the engine
    request is aborted and its blocks return to the pool, well before its 4,000 tokens."""
    import time

    import httpx

    from mlxpaged.testing.slowness import wall

    before = served.metrics()
    body = {"model": tiny_model_path.name, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    if route == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "The KV cache stores"}]
    else:
        path, body["prompt"] = "/v1/completions", "The KV cache stores"
    with httpx.Client(timeout=1.0) as h, pytest.raises(httpx.ReadTimeout):
        h.post(served.url + path, json=body)
    t0 = time.monotonic()
    while served.metrics()["mlxpaged_kv_blocks_used"] > 0:
        assert time.monotonic() - t0 < wall(3.0), "blocks not returned after the client left"
        time.sleep(0.05)
    generated = served.metrics()["mlxpaged_generation_tokens_total"] - before["mlxpaged_generation_tokens_total"]
    assert 0 < generated < 4000  # it ran, and was aborted, not run to the end


@pytest.mark.parametrize("route", ["chat", "generate"])
def test_ollama_whole_answer_is_its_lines_added_up(thinker, route):
    """Ollama's /api/chat and /api/generate: the non-streamed answer equals the NDJSON lines added
    up (text, thinking, done_reason and counts), on a model that reasons."""
    c, _ = thinker
    body = {"model": "tiny", "options": {"temperature": 0, "num_predict": 24}}
    if route == "chat":
        body["messages"] = THINK_QUESTION
    else:
        body["prompt"] = THINK_QUESTION[0]["content"]
    r = c.post(f"/api/{route}", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [json.loads(ln) for ln in r.text.splitlines() if ln]
    whole = c.post(f"/api/{route}", json={**body, "stream": False}).json()

    def part(obj: dict, key: str) -> str:
        return (obj["message"] if route == "chat" else obj).get(key) or ""

    def summary(parts: list[dict]) -> dict:
        last = parts[-1]
        assert last["done"] and all(not p["done"] for p in parts[:-1])
        text_key = "content" if route == "chat" else "response"
        counts = {k: last[k] for k in ("done_reason", "prompt_eval_count", "eval_count")}
        return {
            "text": "".join(part(p, text_key) for p in parts),
            "thinking": "".join(part(p, "thinking") for p in parts),
            **counts,
        }

    streamed = summary(lines)
    assert streamed == summary([whole]) and streamed["thinking"], streamed
