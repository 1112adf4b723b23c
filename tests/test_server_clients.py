"""The agent SDKs people point at a local server, unmodified, against `mlxpaged serve`: openai-agents
0.24 (chat and Responses, `Runner.run` and `run_streamed`, a forced function tool), pydantic-ai
2.38 (its default ToolOutput, a forced tool call, and NativeOutput, a JSON schema) and instructor
1.17 (TOOLS, JSON_SCHEMA, JSON), langchain-openai 1.8 (forced and named tools, streamed, structured
output by tool call and by schema, chat and Responses) and llm 0.36 (a prompt, `--schema`,
`--functions`, chat and Responses); then Claude Code's and Codex's captured first requests, and the
two CLIs themselves. The model is a
tiny random checkpoint carrying Qwen2.5's real tokenizer, so `<tool_call>` is one added token as on
the default model; random weights answer nothing sensible, so what is asserted is what the server
guarantees whatever the weights: forced calls and schema outputs parse and validate (guided
decoding), each SDK's own types come back, streams carry their events, usage is counted."""

from __future__ import annotations

import asyncio
import inspect
import json
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict
from test_server_spine import write_tiny_with_tokenizer

from mlxpaged.testing.slowness import wall
from tests.server_proc import Server


# Enums only, no other keys: random weights would write an unbounded integer's digits, or keys
# after keys, until max_tokens (a schema's grammar allows what the schema allows).
class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Rome"]
    days: Literal[1, 2, 3]


CONTEXT = 32768  # the default model's: the CLIs' real first requests (~20k tokens and more) fit
CAPTURED = Path(__file__).parent / "data" / "clients"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from mlxpaged.loading.gguf import convert_gguf
    from mlxpaged.loading.offline_model import ensure_offline_model

    path = write_tiny_with_tokenizer(tmp_path_factory.mktemp("clients"), convert_gguf(ensure_offline_model()))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    s = Server(
        path, "--num-blocks", str(CONTEXT // 16 + 64), "--served-model-name", "tiny", "--log-level", "info", timeout=120
    )
    yield s
    s.stop()


def run(coro):
    return asyncio.run(coro)


# -- openai-agents ---------------------------------------------------------------------------------
def agents_agent(served, api: str):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, function_tool
    from openai import AsyncOpenAI

    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"], days: Literal[1, 2, 3]) -> str:
        """The forecast for a city.

        Args:
            city: which city
            days: how many days ahead
        """
        calls.append(Weather(city=city, days=days))  # the SDK validated the arguments against the schema
        return f"sunny in {city}"

    client = AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    model = (OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel)(model="tiny", openai_client=client)
    agent = Agent(
        name="forecaster",
        instructions="Answer with the weather tool.",
        model=model,
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="required", max_tokens=64, temperature=0),
        tool_use_behavior="stop_on_first_tool",  # the tool's result is the final output
    )
    return agent, calls


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_runs_a_forced_tool(served, api):
    from agents import RunConfig, Runner

    agent, calls = agents_agent(served, api)
    result = run(Runner.run(agent, "Weather in Paris for 3 days?", run_config=RunConfig(tracing_disabled=True)))
    assert len(calls) == 1, (result.new_items, result.raw_responses)
    assert result.final_output == f"sunny in {calls[0].city}"
    usage = result.context_wrapper.usage
    assert usage.requests == 1 and usage.input_tokens > 0 and usage.output_tokens > 0


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_streams_a_forced_tool(served, api):
    from agents import RunConfig, Runner

    agent, calls = agents_agent(served, api)

    async def go():
        result = Runner.run_streamed(agent, "Weather in Rome?", run_config=RunConfig(tracing_disabled=True))
        kinds = [e.type for e in [e async for e in result.stream_events()]]
        return result, kinds

    result, kinds = run(go())
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert len(calls) == 1 and result.final_output == f"sunny in {calls[0].city}"


# -- pydantic-ai -----------------------------------------------------------------------------------
@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("mode", ["tool", "native"])
def test_pydantic_ai_structured_output(served, api, mode):
    from pydantic_ai import Agent, NativeOutput, ToolOutput
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=served.url + "/v1", api_key="x")
    model = (OpenAIChatModel if api == "chat" else OpenAIResponsesModel)("tiny", provider=provider)
    output = ToolOutput(Weather) if mode == "tool" else NativeOutput(Weather)  # ToolOutput: pydantic-ai's default
    agent = Agent(model, output_type=output, model_settings={"max_tokens": 64, "temperature": 0})
    result = agent.run_sync("Weather in Paris for 2 days?")
    assert isinstance(result.output, Weather)
    assert result.usage.input_tokens > 0 and result.usage.output_tokens > 0


# -- instructor -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_the_model(served, mode):
    """instructor 1.17's modes over chat: TOOLS (a forced tool call), JSON_SCHEMA (response_format
    json_schema): a validated model. (JSON mode sends json_object, any JSON, with the schema only in
    the prompt: a model that reads the prompt follows it, random weights cannot.)"""
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(
        OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0), mode=getattr(instructor.Mode, mode)
    )
    got = client.chat.completions.create(
        model="tiny",
        response_model=Weather,
        messages=[{"role": "user", "content": "Weather in Rome for 1 day?"}],
        max_tokens=64,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(got, Weather)


# -- LangChain ---------------------------------------------------------------------------------------
def weather_tool():
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "Rome"], days: Literal[1, 2, 3]) -> str:
        """The forecast for a city, days ahead."""
        return f"sunny in {city}"

    return get_weather


def langchain_chat(served, api: str):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=served.url + "/v1",
        api_key="x",
        model="tiny",
        temperature=0,
        max_tokens=64,
        max_retries=0,
        use_responses_api=api == "responses",
    )


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_langchain_binds_a_forced_tool(served, api, choice):
    """langchain-openai 1.8's `bind_tools` with `tool_choice` "required" or the tool's name (the case
    once seen to give `[]`): one call of that tool whose arguments validate."""
    msg = langchain_chat(served, api).bind_tools([weather_tool()], tool_choice=choice).invoke("Weather in Rome?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"], msg
    Weather(**msg.tool_calls[0]["args"])
    assert msg.usage_metadata["input_tokens"] > 0 and msg.usage_metadata["output_tokens"] > 0


def test_langchain_streams_a_forced_tool(served):
    """The same call streamed: the chunks add up to the one tool call."""
    bound = langchain_chat(served, "chat").bind_tools([weather_tool()], tool_choice="required")
    chunks = list(bound.stream("Weather in Paris?"))
    assert len(chunks) > 1
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert [c["name"] for c in whole.tool_calls] == ["get_weather"]
    Weather(**whole.tool_calls[0]["args"])


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(served, api, method):
    """`with_structured_output` by a forced tool call (the case once seen to give `None`) and by a
    JSON schema: the pydantic model itself."""
    got = langchain_chat(served, api).with_structured_output(Weather, method=method).invoke("Paris, 2 days")
    assert isinstance(got, Weather)


# -- llm (Simon Willison's CLI) ----------------------------------------------------------------------
def llm_cli(served, tmp_path, *args: str) -> str:
    """`llm` with only an extra-openai-models.yaml entry (model name, base URL; chat and Responses);
    returns stdout."""
    import os
    import subprocess
    import sys

    home = tmp_path / "llm"
    home.mkdir(exist_ok=True)
    entry = "  model_name: tiny\n  api_base: {url}/v1\n  supports_tools: true\n  supports_schema: true\n"
    (home / "extra-openai-models.yaml").write_text(
        "- model_id: tiny\n"
        + entry.format(url=served.url)
        + "- model_id: tiny-r\n  responses: true\n"
        + entry.format(url=served.url)
    )
    exe = str(Path(sys.executable).with_name("llm"))
    env = {**os.environ, "LLM_USER_PATH": str(home)}
    r = subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=wall(120))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    return r.stdout


def llm_last(served, tmp_path) -> dict:
    return json.loads(llm_cli(served, tmp_path, "logs", "--json", "-n", "1"))[0]


@pytest.mark.parametrize("model", ["tiny", "tiny-r"])
def test_llm_prompt_schema_and_functions(served, tmp_path, model):
    """llm 0.36 on chat (`tiny`) and Responses (`tiny-r`): a streamed prompt; `--schema` gives JSON
    that validates against the schema; `--functions` is served with the tools in the prompt (its
    prompt counts more tokens than the same prompt without them). llm keeps a streamed Responses
    turn's usage only from `response.completed`, and a turn cut by max_tokens ends with
    `response.incomplete` (as OpenAI's does), so the counted turns there are not streamed."""
    import jsonschema

    assert llm_cli(served, tmp_path, "-m", model, "-o", "max_tokens", "12", "say hi")  # random weights: any text
    opt = ["-o", "max_tokens", "12"] + (["--no-stream"] if model == "tiny-r" else [])
    llm_cli(served, tmp_path, "-m", model, *opt, "say hi")
    plain = llm_last(served, tmp_path)
    assert plain["input_tokens"] > 0 and 0 < plain["output_tokens"] <= 12, plain

    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    out = llm_cli(served, tmp_path, "-m", model, "--schema", json.dumps(schema), "-o", "max_tokens", "32", "Paris?")
    jsonschema.validate(json.loads(out), schema)

    fn = "def get_weather(city: str) -> str:\n    'The forecast for a city.'\n    return 'sunny'\n"
    llm_cli(served, tmp_path, "-m", model, *opt, "--functions", fn, "say hi")
    with_tools = llm_last(served, tmp_path)
    assert with_tools["input_tokens"] > plain["input_tokens"] + 20, (with_tools, plain)


# -- the CLIs' first requests, as captured (tests/data/clients/: client, version, command) ---------
def captured(name: str) -> dict:
    body = json.loads((CAPTURED / name).read_text())
    return {k: v for k, v in body.items() if not k.startswith("_")}


def test_claude_codes_captured_first_request_is_served(served):
    """Claude Code 2.1.197's `claude -p` request as it sent it (its model name, 24 tools, a system
    message after the user's, thinking adaptive, output_config.effort high, context_management,
    max_tokens 64,000): a 200 stream through the official client, its prompt tokenized whole and
    max_tokens clamped to what the context leaves; read to `message_start` and closed (random
    weights may write for thousands of tokens before any text: the documented-shape replay in
    test_server_agents.py reads a whole stream on a short context)."""
    import anthropic

    body = captured("claude_code_2.1.197.json")
    body["model"] = "tiny"  # the one edit: Claude Code takes the served name from ANTHROPIC_MODEL
    client = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    known = inspect.signature(client.messages.create).parameters
    extra = {k: body.pop(k) for k in list(body) if k not in known}
    with client.messages.create(**body, extra_body=extra) as stream:
        start = next(iter(stream))
        clamped = stream.response.headers.get("x-mlxpaged-max-tokens-clamped")
    assert start.type == "message_start" and start.message.model == "tiny"
    n = start.message.usage.input_tokens
    assert n > 10_000 and int(clamped) == CONTEXT - n


def test_codexs_captured_first_request_is_served(served):
    """Codex 0.171's `codex exec` request as it sent it (developer messages, function tools, a
    namespace tool, a hosted web_search, reasoning.summary auto, include, store false,
    prompt_cache_key, client_metadata): a 200 stream through the official client, to its first
    output text."""
    import openai

    body = captured("codex_0.171.0.json")
    body["model"], body["max_output_tokens"] = "tiny", 8  # the served name; a short turn
    body.pop("stream")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    known = inspect.signature(client.responses.stream).parameters
    extra = {k: body.pop(k) for k in list(body) if k not in known}
    with client.responses.stream(**body, extra_body=extra) as s:
        events = list(s)
    types, final = [e.type for e in events], events[-1].response
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert final.usage.input_tokens > 1000 and final.usage.output_tokens == 8 and final.store is False


# -- the CLIs themselves, where they are installed -------------------------------------------------
AGENT_CLI_DIR = Path(__file__).parent.parent / ".venv" / "agent-cli" / "node_modules" / ".bin"  # the README's npm line


def cli(name: str) -> str | None:
    """`claude` or `codex` from MLXPAGED_AGENT_CLI_DIR (an npm prefix's node_modules/.bin), the
    README's install (.venv/agent-cli), or PATH."""
    import os
    import shutil

    where = os.environ.get("MLXPAGED_AGENT_CLI_DIR")
    if where:
        return shutil.which(name, path=where)
    return shutil.which(name, path=str(AGENT_CLI_DIR)) or shutil.which(name)


@pytest.fixture(scope="module")
def answers_at_once(tmp_path_factory):
    """A server whose tiny model ends every answer at once: the CLIs treat running into their
    output cap as an error, and random weights never write an end token. Residual channel 0 is a
    constant 10 (every embedding's, untouched by the layer's outputs), the final norm keeps only
    it, and an untied output layer maps it to the end token's logit alone."""
    import mlx.core as mx

    from mlxpaged.loading.gguf import convert_gguf
    from mlxpaged.loading.offline_model import ensure_offline_model

    if cli("claude") is None and cli("codex") is None:
        pytest.skip("[expected] neither CLI is installed (npm install @anthropic-ai/claude-code @openai/codex)")
    path = write_tiny_with_tokenizer(tmp_path_factory.mktemp("eos"), convert_gguf(ensure_offline_model()))
    config = json.loads((path / "config.json").read_text())
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], int) else config["eos_token_id"][0]
    (path / "config.json").write_text(
        json.dumps({**config, "max_position_embeddings": CONTEXT, "tie_word_embeddings": False})
    )
    w = mx.load(str(path / "model.safetensors"))
    emb = w["model.embed_tokens.weight"]
    vocab, hidden = emb.shape
    one = (mx.arange(hidden) == 0).astype(emb.dtype)
    w["model.embed_tokens.weight"] = emb * (1 - one) + 10 * one
    for k in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        w[k] = w[k] * (1 - one)[:, None]
    w["model.norm.weight"] = one
    w["lm_head.weight"] = mx.zeros((vocab, hidden)).at[eos, 0].add(10.0)
    mx.save_safetensors(str(path / "model.safetensors"), w, metadata={"format": "mlx"})
    s = Server(path, "--num-blocks", str(CONTEXT // 16 + 64), "--served-model-name", "tiny", "--log-level", "info")
    yield s
    s.stop()


def test_claude_p_answers_through_the_server(answers_at_once, tmp_path):
    """`claude -p` with only its base URL, a key and the served model name: exit 0, and the server
    logged the CLI's request as a 200."""
    import subprocess

    exe = cli("claude")
    if exe is None:
        pytest.skip(
            "[expected] Claude Code is not installed (npm install @anthropic-ai/claude-code; MLXPAGED_AGENT_CLI_DIR)"
        )
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "ANTHROPIC_BASE_URL": answers_at_once.url,
        "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_MODEL": "tiny",
        "ANTHROPIC_SMALL_FAST_MODEL": "tiny",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "tiny",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    r = subprocess.run([exe, "-p", "say hi"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=wall(200))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    log = answers_at_once.stderr()
    # its turn; some versions probe the root first (`HEAD /`), newer ones do not, so that is not asked
    assert "POST /v1/messages 200" in log


def test_codex_exec_answers_through_the_server(answers_at_once, tmp_path):
    """`codex exec` with a model provider that names only the base URL and the Responses wire API:
    exit 0, and the server logged its request as a 200."""
    import subprocess

    exe = cli("codex")
    if exe is None:
        pytest.skip("[expected] Codex is not installed (npm install @openai/codex; MLXPAGED_AGENT_CLI_DIR)")
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "mlxpaged"\n\n[model_providers.mlxpaged]\nname = "mlxpaged"\n'
        f'base_url = "{answers_at_once.url}/v1"\nwire_api = "responses"\n'
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "CODEX_HOME": str(home)}
    r = subprocess.run(
        [exe, "exec", "--skip-git-repo-check", "say hi"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=wall(200),
    )
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert "POST /v1/responses 200" in answers_at_once.stderr()
