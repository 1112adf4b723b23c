"""LoRA adapters on the server: a request picks one as `model: "BASE:NAME"` or with mlx_lm.server's
`adapters` field (the name or the folder given at start); its tokens are mlx-lm's with that adapter
applied; an unknown adapter is a 404 naming it, two different ones in one request a 400; an
adapter for another base model ends `serve` and `generate` at start with one line."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import openai
import pytest
from click.testing import CliRunner

from mlxpaged.cli.main import main
from mlxpaged.testing.slowness import wall
from mlxpaged.testing.tiny_adapter import write_tiny_adapter
from mlxpaged.testing.tiny_model import write_tiny_qwen2

PROMPT = "Paged attention borrows an idea from operating systems:"
N = 10


@pytest.fixture(scope="module")
def adapters(tiny_model_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    return {
        "A": write_tiny_adapter(tiny_model_path, d / "A", seed=1),
        "B": write_tiny_adapter(tiny_model_path, d / "B", seed=2, rank=8, keys=["mlp.down_proj"]),
    }


@pytest.fixture(scope="module")
def want(tiny_model_path, tiny_loaded, adapters):
    """mlx-lm's greedy tokens for PROMPT, by adapter name (None: the base model)."""
    import mlx_lm
    from mlx_lm.generate import generate_step

    ids = tiny_loaded.tokenizer.encode(PROMPT)
    out = {}
    for name in (None, "A", "B"):
        model, _ = mlx_lm.load(str(tiny_model_path), adapter_path=str(adapters[name]) if name else None)
        steps = generate_step(mx.array(ids), model, max_tokens=N, sampler=lambda x: mx.argmax(x, -1))
        out[name] = [int(t) for t, _ in steps]
    assert len({tuple(v) for v in out.values()}) == 3
    return out


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_path, tmp_path_factory):
    """--adapter-dir's folder: A again (as "A2"), one for another base model, and a damaged one."""
    d = tmp_path_factory.mktemp("adapter-dir")
    write_tiny_adapter(tiny_model_path, d / "A2", seed=1)
    other = write_tiny_qwen2(d.parent / "other", hidden=128, heads=2, kv_heads=1, intermediate=256)
    write_tiny_adapter(other, d / "wrong", seed=3)
    (d / "empty").mkdir()
    return d


@pytest.fixture(scope="module")
def client(tiny_loaded, adapters, adapter_dir):
    from fastapi.testclient import TestClient

    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.builder import build_engine
    from mlxpaged.server.app import build_app
    from mlxpaged.server.engine_loop import EngineLoop
    from mlxpaged.server.metrics import Metrics

    named = {k: str(v) for k, v in adapters.items()}
    loop = EngineLoop(
        lambda: build_engine(tiny_loaded, EngineConfig.of(num_blocks=256), adapters=named, adapter_dir=str(adapter_dir))
    )
    loop.start()
    with TestClient(build_app(loop, Metrics(), model_id="tiny")) as c:
        yield c


def completion_ids(client, tiny_loaded, **body) -> list[int]:
    r = client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True, **body}
    )
    assert r.status_code == 200, r.text
    return tiny_loaded.tokenizer.encode(r.json()["choices"][0]["text"])


def test_model_suffix_and_adapters_field_pick_the_adapter(client, tiny_loaded, adapters, want):
    """Each way of naming an adapter gives mlx-lm's tokens with it; without one, the base model's.
    (The tokens are compared as text: the completion's text re-encoded.)"""
    text = {k: tiny_loaded.tokenizer.decode(v) for k, v in want.items()}
    for body, name in (
        ({"model": "tiny"}, None),
        ({"model": "tiny:A"}, "A"),
        ({"model": "tiny:B"}, "B"),
        ({"adapters": "B"}, "B"),
        ({"model": "tiny", "adapters": str(adapters["A"])}, "A"),  # mlx_lm.server's: the folder
        ({"model": "tiny:A", "adapters": "A"}, "A"),
    ):
        got = tiny_loaded.tokenizer.decode(completion_ids(client, tiny_loaded, **body))
        assert got == text[name], body


def test_the_openai_client(client, tiny_loaded, want):
    c = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="unused", http_client=client, max_retries=0)
    text = {k: tiny_loaded.tokenizer.decode(v) for k, v in want.items()}
    r = c.completions.create(
        model="tiny:A", prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == text["A"]
    r = c.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True, "adapters": "B"}
    )
    assert r.choices[0].text == text["B"]
    chat = c.chat.completions.create(model="tiny:B", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="unknown adapter 'nope'"):
        c.chat.completions.create(model="tiny:nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses", {"input": "hi"}),
    ],
)
def test_unknown_adapter_is_a_404_naming_it(client, path, body):
    size = {"max_output_tokens": 2} if path == "/v1/responses" else {"max_tokens": 2}
    assert client.post(path, json={**body, **size, "model": "tiny:A"}).status_code == 200
    r = client.post(path, json={**body, **size, "model": "tiny:nope"})
    assert r.status_code == 404 and "unknown adapter 'nope'" in r.text and "'A', 'B'" in r.text, r.text
    assert path.startswith("/v1/messages") or r.json()["error"]["code"] == "adapter_not_found"
    if path.startswith("/v1/chat") or path == "/v1/completions":
        r = client.post(path, json={**body, **size, "adapters": "nope"})
        assert r.status_code == 404 and "unknown adapter 'nope'" in r.text, r.text
        assert r.json()["error"]["param"] == "adapters"
        r = client.post(path, json={**body, **size, "model": "tiny:A", "adapters": "B"})
        assert r.status_code == 400 and "model names adapter 'A' and adapters 'B'" in r.text, r.text
    r = client.post(path, json={**body, **size, "model": "other:A"})
    assert r.status_code == 404 and "unknown model 'other:A'" in r.text, r.text


def test_generate_with_an_adapter(tiny_model_path, adapters, want):
    r = CliRunner().invoke(
        main,
        ["generate", "--model", str(tiny_model_path), "--dtype", "float32", "-p", PROMPT, "--no-chat"]
        + ["--max-tokens", str(N), "--ignore-eos", "--adapter", str(adapters["A"]), "--json"],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.splitlines()[-1])["outputs"][0]["token_ids"] == want["A"]


def test_an_adapter_for_another_model_ends_serve_with_one_line(tiny_model_path, tmp_path):
    other = write_tiny_qwen2(tmp_path / "other", hidden=128, heads=2, kv_heads=1, intermediate=256)
    wrong = write_tiny_adapter(other, tmp_path / "wrong", seed=3)
    cmd = [sys.executable, "-m", "mlxpaged.cli", "serve", "--model", str(tiny_model_path), "--port", "0"]
    run = lambda *args: subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=wall(60))  # noqa: E731
    with ThreadPoolExecutor(2) as pool:
        mismatch, bad_flag = pool.map(lambda a: run("--adapter", a), [f"W={wrong}", "W"])
    lines = mismatch.stderr.strip().splitlines()
    assert mismatch.returncode == 1 and len(lines) == 1, mismatch.stderr[-2000:]
    assert lines[0].startswith("error: adapter 'W' (qwen2): model.layers.") and "another base model" in lines[0]
    assert bad_flag.returncode == 1
    assert bad_flag.stderr.strip() == "error: --adapter W: give NAME=PATH (the folder mlx_lm.lora wrote)"


def test_adapter_dir_loads_on_first_use(client, tiny_loaded, adapter_dir, want):
    """A folder of --adapter-dir is loaded when a request first names it (by name, or by its path in
    `adapters`); one for another base model, or without an adapter in it, is a 400 naming why, and
    nothing outside the folder is reachable through it."""
    text = tiny_loaded.tokenizer.decode(want["A"])
    assert tiny_loaded.tokenizer.decode(completion_ids(client, tiny_loaded, model="tiny:A2")) == text
    got = completion_ids(client, tiny_loaded, adapters=str(adapter_dir / "A2"))
    assert tiny_loaded.tokenizer.decode(got) == text
    body = {"prompt": PROMPT, "max_tokens": 2}
    r = client.post("/v1/completions", json={**body, "model": "tiny:wrong"})
    assert r.status_code == 400 and "adapter 'wrong' (qwen2): model.layers." in r.text, r.text
    assert "an adapter for another base model" in r.text and r.json()["error"]["code"] == "adapter_not_served"
    r = client.post("/v1/completions", json={**body, "adapters": "empty"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "adapter 'empty': no adapter_config.json", r.text
    for outside in ("..", "../" + adapter_dir.name, str(adapter_dir.parent / "other"), ".hidden"):
        r = client.post("/v1/completions", json={**body, "adapters": outside})
        assert r.status_code == 404 and "unknown adapter" in r.text, (outside, r.text)
    assert client.post("/v1/completions", json={**body, "model": "tiny:A2"}).status_code == 200


def test_an_adapter_on_an_embedding_is_refused_by_name(client):
    """Pooled requests run on the base model: an adapter there is a 400 naming it, not ignored."""
    assert client.post("/v1/embeddings", json={"model": "tiny", "input": "hi"}).status_code == 200
    r = client.post("/v1/embeddings", json={"model": "tiny:A", "input": "hi"})
    assert r.status_code == 400, r.text
    assert "adapter 'A'" in r.json()["error"]["message"]
