"""The agent SDKs people point at a local server, unmodified, against `mlxpaged serve`: openai-agents
0.24 (chat and Responses, `Runner.run` and `run_streamed`, a forced function tool) and pydantic-ai
2.38 (its default ToolOutput, a forced tool call, and NativeOutput, a JSON schema). The model is a
tiny random checkpoint carrying Qwen2.5's real tokenizer, so `<tool_call>` is one added token as on
the default model; random weights answer nothing sensible, so what is asserted is what the server
guarantees whatever the weights: forced calls and schema outputs parse and validate (guided
decoding), each SDK's own types come back, streams carry their events, usage is counted."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from pydantic import BaseModel
from test_server_spine import write_tiny_with_tokenizer

from tests.server_proc import Server


# Enums only: random weights would write an unbounded integer's digits until max_tokens.
class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    days: Literal[1, 2, 3]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from mlxpaged.loading.gguf import convert_gguf
    from mlxpaged.loading.offline_model import ensure_offline_model

    path = write_tiny_with_tokenizer(tmp_path_factory.mktemp("clients"), convert_gguf(ensure_offline_model()))
    s = Server(path, "--num-blocks", "512", "--served-model-name", "tiny", timeout=120)
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
