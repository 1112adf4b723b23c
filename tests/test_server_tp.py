"""Guided and tool requests served by two tensor-parallel ranks.

Rank 0 sends each request to the other rank in its wire form (`EngineRequest.to_wire`); a guided
spec (response_format, a forced tool) must arrive whole, or the ranks fall out of step. The
reference is one process: the same app in-process on the same checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from mlxpaged.testing.slowness import wall

from launch import _free_port_pair, _ring_can_start, wait_healthy  # noqa: E402

pytestmark = pytest.mark.skipif(_ring_can_start() is not None, reason=f"[expected] {_ring_can_start()}")

SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": ["x", "yy"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
}
SCHEMA.update(required=["a", "n"], additionalProperties=False)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
MSGS = [{"role": "user", "content": "The weather, as JSON"}]
BODIES = [
    {
        "messages": MSGS,
        "max_tokens": 80,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
    },
    {
        "messages": MSGS,
        "max_tokens": 160,
        "temperature": 0,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
    {"messages": MSGS, "max_tokens": 12, "temperature": 0.9, "seed": 5, "n": 2},
]


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _answers(replies: list[dict]) -> list:
    return [
        [
            (
                c["message"]["content"],
                c["message"].get("tool_calls")
                and [(t["function"]["name"], t["function"]["arguments"]) for t in c["message"]["tool_calls"]],
            )
            for c in r["choices"]
        ]
        for r in replies
    ]


def test_guided_and_tool_requests_on_two_ranks_equal_one_process(tiny_model_path, tiny_loaded, tmp_path):
    from fastapi.testclient import TestClient

    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.llm_engine import LLMEngine
    from mlxpaged.server.app import build_app
    from mlxpaged.server.engine_loop import EngineLoop
    from mlxpaged.server.metrics import Metrics

    port, http_port = _free_port_pair(), _free_port_pair()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    cmd = [sys.executable, "-m", "mlxpaged.cli", "serve", "--model", str(tiny_model_path), "--dtype", "float32"]
    cmd += ["--port", str(http_port), "--num-blocks", "128"]
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "MLXPAGED_TP_CHECK_EVERY": "1"}
    procs = [
        subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**env, "MLX_RANK": str(r)}) for r in range(2)
    ]
    try:
        wait_healthy(http_port, procs)
        got = [_post(http_port, b) for b in BODIES]
        assert all(p.poll() is None for p in procs), "a rank ended"
    finally:
        procs[0].send_signal(signal.SIGINT)
        errs = []
        for p in procs:
            try:
                errs.append(p.communicate(timeout=wall(60))[1])
            except subprocess.TimeoutExpired:
                p.kill()
                errs.append(p.communicate()[1])
    assert [p.returncode for p in procs] == [0, 0], [e[-1500:] for e in errs]

    loop = EngineLoop(lambda: LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=128)))
    loop.start()
    with TestClient(build_app(loop, Metrics(), model_id="tiny")) as c:
        want = [c.post("/v1/chat/completions", json=b).json() for b in BODIES]
    assert _answers(got) == _answers(want)
    json.loads(got[0]["choices"][0]["message"]["content"])  # the schema was enforced on both ranks
    assert got[1]["choices"][0]["finish_reason"] == "tool_calls", got[1]


def test_sampling_params_wire_form_round_trips():
    """Every field, the guided spec and logit_bias's int keys included, survives JSON."""
    from mlxpaged.engine.guided import GuidedDecoding
    from mlxpaged.engine.sampling_params import SamplingParams
    from mlxpaged.server.engine_loop import EngineRequest

    for guided in (GuidedDecoding(json_schema=SCHEMA), GuidedDecoding(grammar='start: "a"'), None):
        params = SamplingParams(n=2, seed=7, stop=["x"], logit_bias={3: 1.5}, guided=guided, max_tokens=9)
        req = EngineRequest([1, 2], params, "r")
        back = EngineRequest.from_wire(json.loads(json.dumps(req.to_wire())))
        assert back == req
