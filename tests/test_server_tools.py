"""Tool calls on the OpenAI chat route: the parser, its streamed form, the forcing grammar, the route.

The scripted completions are written by the chat template itself (an assistant turn with two
`tool_calls`, rendered by the tiny model's template, which writes calls exactly as Qwen2.5's
does, and, in the real-model tier, by Qwen2.5's own); the parser must give the calls back. The
grammar is checked by llguidance's own matcher on the tokenizer, independently of the engine.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from mlxpaged.server.tools import ToolCall, ToolCallStream, tool_call_grammar
from mlxpaged.testing.slowness import wall

from server_proc import Server

# Strings are bounded: the tiny random model, inside a string, would rarely close it before max_tokens.
WEATHER = {
    "type": "object",
    "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
}
TIME = {
    "type": "object",
    "required": ["tz"],
    "properties": {
        "tz": {"type": "string", "maxLength": 12},
        "hours": {"type": "integer", "minimum": 0, "maximum": 23},
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}},
]
CALLS = [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "Europe/Paris", "hours": 3})]


def hf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def scripted_completion(tok, content: str = "Let me look that up.") -> str:
    """The assistant turn the template writes for two calls: what a model trained on it emits."""
    msgs = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(CALLS)
            ],
        },
    ]
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    start = text.rindex("<|im_start|>assistant") + len("<|im_start|>assistant")
    return text[start : text.rindex("<|im_end|>")].lstrip("\n")


def events_of(text: str, cuts, names=None) -> list:
    """The parser's events for `text` fed in pieces ending at `cuts`, adjacent text merged."""
    p, out, prev = ToolCallStream(names), [], 0
    for c in [*cuts, len(text)]:
        out += p.feed(text[prev:c])
        prev = c
    out += p.finish()
    merged: list = []
    for e in out:
        if isinstance(e, str) and merged and isinstance(merged[-1], str):
            merged[-1] += e
        else:
            merged.append(e if isinstance(e, str) else (e.name, json.loads(e.arguments)))
    return merged


def parse_tool_calls(text: str, names=None) -> tuple[str | None, list]:
    """(content, calls) of a whole completion through the one parser, as the chat route's message
    has them: content None when it is empty and there are calls."""
    s = ToolCallStream(names)
    events = s.feed(text) + s.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls = [e for e in events if isinstance(e, ToolCall)]
    return (content or None) if calls else content, calls


def check_two_calls(text: str, content: str) -> None:
    got_content, calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert len({c.id for c in calls}) == 2
    whole = events_of(text, [])
    assert whole == [content, *CALLS]
    for i in range(len(text) + 1):  # every split point
        assert events_of(text, [i]) == whole, i
    assert events_of(text, range(1, len(text))) == whole  # one character at a time
    for i in range(0, len(text) + 1, 5):  # pairs of split points
        for j in range(i, len(text) + 1, 3):
            assert events_of(text, [i, j]) == whole, (i, j)


# -- the tiny model's template -------------------------------------------------------------------
def test_tiny_template_without_tools_is_plain_chatml(tiny_model_path):
    """The tools support added to the tiny model's template changes nothing for plain chats."""
    tok = hf_tokenizer(tiny_model_path)
    chatml = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    for msgs in (
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "a\nb"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "x"},
        ],
    ):
        for gen in (True, False):
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False) == tok.apply_chat_template(
                msgs, add_generation_prompt=gen, tokenize=False, chat_template=chatml
            )


# -- the parser ---------------------------------------------------------------------------------
def test_two_calls_from_the_template_parse_at_every_split(tiny_model_path):
    tok = hf_tokenizer(tiny_model_path)
    text = scripted_completion(tok)
    assert text.count("<tool_call>") == 2
    check_two_calls(text, "Let me look that up.")


@pytest.mark.real_model
def test_two_calls_from_qwen_template_parse_at_every_split():
    from mlxpaged.loading.gguf import convert_gguf
    from mlxpaged.loading.offline_model import ensure_offline_model

    tok = hf_tokenizer(convert_gguf(ensure_offline_model()))
    assert "<tool_call>" in tok.chat_template  # the checkpoint's own template writes the spans
    text = scripted_completion(tok)
    assert text.count("<tool_call>") == 2
    check_two_calls(text, "Let me look that up.")


def test_malformed_and_unclosed_spans_stay_text():
    good = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    cases = {
        "plain text, no call \n": ("plain text, no call \n", []),
        "a <tool_call>not json</tool_call> b": ("a <tool_call>not json</tool_call> b", []),
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>': (
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
            [],
        ),
        '<tool_call>["f"]</tool_call>': ('<tool_call>["f"]</tool_call>', []),
        'x <tool_call>\n{"name": "f"': ('x <tool_call>\n{"name": "f"', []),  # cut off by max_tokens
        "ends with <tool_": ("ends with <tool_", []),
        f"hi\n{good}\n": ("hi", [("f", {"x": 1})]),
        f"{good} then text": ("then text", [("f", {"x": 1})]),
        f"a\n<tool_call>bad</tool_call>\n{good}": ("a\n<tool_call>bad</tool_call>", [("f", {"x": 1})]),
        # arguments written as a JSON string are accepted as the object they encode
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>': (None, [("f", {"x": 1})]),
    }
    for text, (content, calls) in cases.items():
        got, got_calls = parse_tool_calls(text)
        assert (got, [(c.name, json.loads(c.arguments)) for c in got_calls]) == (content, calls), text
        whole = events_of(text, [])
        for i in range(len(text) + 1):
            assert events_of(text, [i]) == whole, (text, i)


def test_a_bare_json_call_to_an_offered_function_is_a_call():
    """What Qwen2.5-0.5B answers (greedy) to a weather question with a weather tool: no tags."""
    bare = '{"name": "get_weather", "arguments": {"city": "Lyon"}}'
    names = {"get_weather"}
    cases = [
        (bare, names, (None, [("get_weather", {"city": "Lyon"})])),
        (f"\n {bare}\n", names, (None, [("get_weather", {"city": "Lyon"})])),
        (bare, {"other"}, (bare, [])),  # not an offered function: text
        (bare, None, (bare, [])),  # no tools offered: text
        (bare + " and more", names, (bare + " and more", [])),  # not the whole completion: text
        ('{"a": 1}', names, ('{"a": 1}', [])),
        ("Sure: " + bare, names, ("Sure: " + bare, [])),
        # ... or in a fenced block (the 0.5B answered so through the Responses route)
        (f"```json\n{bare}\n```", names, (None, [("get_weather", {"city": "Lyon"})])),
        (f"```\n{bare}\n```\n", names, (None, [("get_weather", {"city": "Lyon"})])),
        (f"```python\n{bare}\n```", names, (f"```python\n{bare}\n```", [])),
        (f"```json\n{bare}\n``` done", names, (f"```json\n{bare}\n``` done", [])),
        ("``", names, ("``", [])),
        ("`x` is code", names, ("`x` is code", [])),
        ("``x``", names, ("``x``", [])),
        # what streams at once (`test_text_that_cannot_be_a_bare_call_streams_at_once`)
        ("```python\nprint(1)\n```", names, ("```python\nprint(1)\n```", [])),
        ("```jsonc\n{}\n```", names, ("```jsonc\n{}\n```", [])),
        (f"```json\nHere: {bare}\n```", names, (f"```json\nHere: {bare}\n```", [])),
        ("{name: 1}", names, ("{name: 1}", [])),
    ]
    for text, offered, (content, calls) in cases:
        got, got_calls = parse_tool_calls(text, offered)
        assert (got, [(c.name, json.loads(c.arguments)) for c in got_calls]) == (content, calls), text
        whole = events_of(text, [], offered)
        for i in range(len(text) + 1):
            assert events_of(text, [i], offered) == whole, (text, i)
        assert events_of(text, range(1, len(text)), offered) == whole


def test_text_that_cannot_be_a_bare_call_streams_at_once():
    """A completion starting with `{` or a fence is held back while it may still be one call object;
    as soon as its start rules that out (a ```python block, a fence's body not starting with `{`,
    `{` not followed by a key), its text streams, where it was once held to the end."""
    names = {"get_weather"}

    def shown(text: str) -> str:
        """The content streamed after feeding `text` a character at a time (before the end)."""
        p = ToolCallStream(names)
        return "".join(e for c in text for e in p.feed(c) if isinstance(e, str))

    # held: each may still grow into `{"name": ...}`, bare or in a ```json block
    for text in ("```", "```js", " ```json ", "```json\n", "```\n \n", "```json\n{", '{"na', "{ ", "{}", '```\n{"n'):
        assert shown(text) == "", text
    # streamed as soon as the start decides it (the rest follows as it comes)
    for text, first in [
        ("```p", "```p"),
        ("```python\nimport os", "```python\nimport os"),
        ("```json5", "```json5"),
        ("```js on", "```js on"),
        ("```json\nThe call", "```json\nThe call"),
        ("{x", "{x"),
        ("{ 'a'", "{ 'a'"),
    ]:
        assert shown(text) == first, text
    assert shown(" ```python\nx") == " ```python\nx"  # leading whitespace is content too


# -- the grammar (checked by llguidance's matcher, not by the engine) -----------------------------
def _accepts(tok, grammar: str, text: str) -> bool:
    import llguidance
    import llguidance.hf

    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok), llguidance.grammar_from("lark", grammar))
    for t in tok.encode(text, add_special_tokens=False):
        if not m.consume_token(t):
            return False
    return m.is_accepting()


def test_forcing_grammar_accepts_the_templates_calls_only(tiny_model_path):
    import llguidance

    tok = hf_tokenizer(tiny_model_path)
    fns = [t["function"] for t in TOOLS]
    both = tool_call_grammar(fns)
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", both)) == ""
    text = scripted_completion(tok, content="")
    assert _accepts(tok, both, text)
    one_span = text[: text.index("</tool_call>") + len("</tool_call>")]
    assert _accepts(tok, both, one_span)
    assert not _accepts(tok, tool_call_grammar(fns, parallel=False), text)  # one call only
    assert not _accepts(tok, tool_call_grammar(fns[:1]), text)  # get_time is not offered there
    bad_args = one_span.replace('"Paris"', "42")
    assert not _accepts(tok, both, bad_args)  # city must be a string
    assert not _accepts(tok, both, "Sure! " + one_span)  # no text before a forced call


# -- the route ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_path):
    s = Server(tiny_model_path, "--num-blocks", "128")
    yield s
    s.stop()


def chat_prompt_len(tok, messages, tools=None) -> int:
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return len(tok.encode(text, add_special_tokens=False))


def test_tools_and_tool_results_go_through_the_template(server, tiny_model_path):
    tok = hf_tokenizer(tiny_model_path)
    c = server.client()
    user = [{"role": "user", "content": "Weather in Paris?"}]
    r = c.chat.completions.create(model=str(tiny_model_path), messages=user, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == chat_prompt_len(tok, user, TOOLS) > chat_prompt_len(tok, user)
    # tool_choice none leaves the tools out of the prompt
    r = c.chat.completions.create(
        model=str(tiny_model_path), messages=user, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    assert r.usage.prompt_tokens == chat_prompt_len(tok, user)
    # an assistant turn with tool_calls (arguments as OpenAI's JSON string) and the tools' results
    history = user + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:00"},
    ]
    r = c.chat.completions.create(
        model=str(tiny_model_path), messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    ref = [dict(m) for m in history]
    ref[1] = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}},
        ],
    }
    text = tok.apply_chat_template(ref, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text and "<tool_response>\n14:00" in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


BAD = [
    ({"tool_choice": "required"}, "needs tools", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'", "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "offered twice", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools"),
    ({"response_format": {"type": "json_schema"}}, "schema", "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "cannot be combined",
        "response_format",
    ),
    ({"logit_bias": {"999999": 5}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"abc": 5}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"5": 300}}, "logit_bias", "logit_bias"),
    ({"min_p": 2}, "min_p", "min_p"),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty"),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
                    ],
                },
            ]
        },
        "not valid JSON",
        "messages",
    ),
]


def test_bad_tool_inputs_get_400_with_error_object(server, tiny_model_path):
    with httpx.Client(timeout=30) as h:
        for extra, words, param in BAD:
            body = {
                "model": str(tiny_model_path),
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                **extra,
            }
            r = h.post(server.url + "/v1/chat/completions", json=body)
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
            assert words in err["message"] and err["param"] == param, (extra, err)


# -- calls the grammar forces (tool_choice required or named) -------------------------------------
def _check_call(name: str, arguments: str, allowed: set[str]) -> None:
    assert name in allowed
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
    jsonschema.validate(json.loads(arguments), schema)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forced_calls_are_valid_calls(server, tiny_model_path, choice, seed):
    allowed = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    kw = dict(
        model=str(tiny_model_path),
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=200,
        temperature=1.0,
        seed=seed,
    )
    r = server.client().chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert ch.message.tool_calls and ch.message.content is None
    for tc in ch.message.tool_calls:
        assert tc.type == "function" and tc.id.startswith("call_")
        _check_call(tc.function.name, tc.function.arguments, allowed)
    if choice != "required":
        assert len(ch.message.tool_calls) == 1
    # streamed: the same calls, as delta.tool_calls chunks with their index
    calls: dict[int, dict] = {}
    finish = None
    for chunk in server.client().chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"name": "", "arguments": ""})
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == [
        (tc.function.name, json.loads(tc.function.arguments)) for tc in ch.message.tool_calls
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format_validates(server, tiny_model_path, stream):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    kw = dict(
        model=str(tiny_model_path),
        messages=[{"role": "user", "content": "A record, please"}],
        response_format={"type": "json_schema", "json_schema": {"name": "rec", "schema": schema, "strict": True}},
        max_tokens=300,
        temperature=1.0,
        seed=5,
    )
    if stream:
        text = "".join(
            c.choices[0].delta.content or ""
            for c in server.client().chat.completions.create(**kw, stream=True)
            if c.choices
        )
    else:
        r = server.client().chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"
        text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


def test_unsupported_schema_is_a_400_naming_it(server, tiny_model_path):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=str(tiny_model_path),
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"$ref": "http://example.com/remote.json"}}},
                },
            },
        )
    assert e.value.body["param"] == "response_format"


# -- the real model (Qwen2.5-Coder-0.5B-Instruct, offline) ----------------------------------------
@pytest.mark.real_model
def test_real_model_weather_call_and_extraction():
    """tool_choice auto: the model's own call is parsed and names the prompt's city; a JSON-schema
    extraction from a paragraph validates."""
    from mlxpaged.loading.gguf import convert_gguf
    from mlxpaged.loading.offline_model import ensure_offline_model

    s = Server(convert_gguf(ensure_offline_model()), "--num-blocks", "256", "--served-model-name", "qwen", timeout=300)
    try:
        c = s.client(timeout=wall(600))
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Get the current weather in a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                },
            }
        ]
        r = c.chat.completions.create(
            model="qwen",
            messages=[{"role": "user", "content": "What's the weather like in Lyon right now?"}],
            tools=tools,
            temperature=0,
            max_tokens=64,
        )
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        call = ch.message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Lyon"
        schema = {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "age", "city"],
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "city": {"type": "string"},
            },
        }
        text = (
            "Extract the person as JSON: Maria Lopez is a 34-year-old software engineer who lives in Valencia "
            "and writes Python and Rust."
        )
        r = c.chat.completions.create(
            model="qwen",
            messages=[{"role": "user", "content": text}],
            temperature=0,
            max_tokens=80,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": schema, "strict": True},
            },
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    finally:
        s.stop()


# -- the sampling knobs reach the engine ----------------------------------------------------------
def test_logit_bias_and_penalties_reach_the_sampler(server, tiny_model_path, tiny_loaded):
    """+100 forces a token; -100 bans the greedy one (found by this process's engine); the penalties
    and min_p are accepted and reach the engine (their effect is tests/test_sampling_knobs.py's)."""
    from mlxpaged import LLM, SamplingParams

    tok = hf_tokenizer(tiny_model_path)
    c = server.client()
    forced = tok.encode("cache", add_special_tokens=False)[0]
    r = c.completions.create(
        model=str(tiny_model_path),
        prompt="The KV",
        max_tokens=6,
        temperature=1.0,
        seed=3,
        logit_bias={str(forced): 100},
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].logprobs.tokens == [tok.decode([forced])] * 6
    llm = LLM(tiny_loaded, num_blocks=64)
    for prompt in ["The KV cache stores", "Paged attention borrows", "Write a Python function", "The quick brown"]:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0].outputs[0]
        if "\ufffd" not in out.text:  # a whole-character token, so its text names it
            break
    greedy = out.token_ids[0]
    kw = dict(model=str(tiny_model_path), prompt=prompt, max_tokens=1, temperature=0, logprobs=0)
    assert c.completions.create(**kw).choices[0].logprobs.tokens == [tok.decode([greedy])]
    banned = c.completions.create(**kw, logit_bias={str(greedy): -100}).choices[0].logprobs.tokens
    assert banned != [tok.decode([greedy])]
    r = c.chat.completions.create(
        model=str(tiny_model_path),
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        presence_penalty=1.5,
        frequency_penalty=-0.5,
        extra_body={"repetition_penalty": 1.3, "min_p": 0.1},
    )
    assert r.usage.completion_tokens >= 1
