"""Several models in one server (`mlxpaged serve --model A --model B ...`): each loaded when a
request names it, unloaded when idle past its keep-alive or to make room under `--max-memory`.

References: each model's own greedy answer from an in-process `LLM` of that checkpoint alone (the
tokens a server of one model gives), the checkpoints' files for the memory budget (their weights'
bytes and KV pools' sizes from their configs), the official `ollama` client for `keep_alive` and
`/api/ps`, and the server's log for what it loaded and unloaded.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import ollama
import pytest

from mlxpaged.testing.tiny_model import write_tiny_family, write_tiny_qwen2

from server_proc import Server

NUM_BLOCKS, BLOCK = 64, 16
PROMPT = "The KV cache stores the keys"


def kv_bytes(path) -> int:
    """The KV pool's bytes from the checkpoint's config: K and V, every layer, every block, float32."""
    c = json.loads((path / "config.json").read_text())
    heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * NUM_BLOCKS * BLOCK * heads * head_dim * 4


def weight_bytes(path) -> int:
    """The weights' bytes as the safetensors header lists them (float32 checkpoints)."""
    raw = (path / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    bad = root / "broken"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
    return {
        "q": write_tiny_qwen2(root / "qwen"),
        "l": write_tiny_family(root / "llama", "llama", seed=1),
        "m": write_tiny_family(root / "mistral", "mistral", seed=2),
        "bad": bad,
    }


@pytest.fixture(scope="module")
def sizes(paths):
    return {k: weight_bytes(p) + kv_bytes(p) for k, p in paths.items() if k != "bad"}


@pytest.fixture(scope="module")
def server(paths, sizes):
    # room for any two of the three models, never for all three
    small, *big = sorted(sizes.values())
    budget = sum(big) + small // 2
    assert all(a + b <= budget for a in sizes.values() for b in sizes.values()) and sum(sizes.values()) > budget
    models = [a for k in ("l", "m", "bad") for a in ("--model", f"{k}={paths[k]}")]
    s = Server(
        paths["q"],  # --model PATH: served by its folder's name
        *models,
        "--num-blocks",
        str(NUM_BLOCKS),
        "--max-memory",
        f"{budget}B",
        "--keep-alive",
        "-1",
        "--log-level",
        "info",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected(paths):
    """Each checkpoint's greedy completion from an in-process engine of that model alone."""
    from mlxpaged import LLM, SamplingParams
    from mlxpaged.loading.loader import load

    out = {}
    for k in ("q", "l", "m"):
        llm = LLM(load(str(paths[k]), "float32"), num_blocks=NUM_BLOCKS)
        out[k] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0].text
    return out


def complete(server, name: str) -> str:
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": name, "prompt": PROMPT, "max_tokens": 10, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == name
    return r.json()["choices"][0]["text"]


def loaded(server) -> set[str]:
    return {m.model for m in ollama.Client(host=server.url).ps().models}


def wait_until(cond, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_models_load_when_named_and_the_least_recently_used_idle_one_makes_room(server, sizes, expected):
    names = {"qwen": "q", "l": "l", "m": "m"}
    listed = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["qwen", "l", "m", "bad"]  # every served model, loaded or not
    assert all(m["max_model_len"] == 4096 for m in listed[:3])
    assert loaded(server) == {"qwen"}  # the first model is loaded at start-up, the others when asked

    assert complete(server, "l") == expected["l"]
    assert loaded(server) == {"qwen", "l"}
    ps = {m.model: m.size for m in ollama.Client(host=server.url).ps().models}
    assert ps == {"qwen": sizes["q"], "l": sizes["l"]}  # what counts against --max-memory: weights + KV pool
    assert complete(server, "qwen") == expected["q"]  # l is now the least recently used
    assert complete(server, "m") == expected["m"]  # no room for three: l goes
    assert loaded(server) == {"qwen", "m"}
    assert "unloaded model l (to make room for m)" in server.stderr()
    # interleaved, each by name: every answer is its model's own
    for name in ("l", "qwen", "m", "qwen", "l"):
        assert complete(server, name) == expected[names[name]]
    assert len(loaded(server)) == 2
    # a model that cannot load says so, naming itself and the reason, and the others keep serving
    r = httpx.post(server.url + "/v1/completions", json={"model": "bad", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["code"] == "model_load_failed"
    assert r.json()["error"]["message"].startswith("model 'bad' failed to load: ") and "no_such_family" in r.text
    r = httpx.post(server.url + "/v1/completions", json={"model": "gpt-4o", "prompt": "x"})
    assert r.status_code == 404 and "this server serves 'qwen', 'l', 'm', 'bad'" in r.json()["error"]["message"]
    assert complete(server, "l") == expected["l"]


def test_keep_alive_zero_unloads_after_the_answer(server, expected):
    client = ollama.Client(host=server.url)
    complete(server, "m")
    r = client.generate(model="m", prompt=PROMPT, raw=True, options={"temperature": 0, "num_predict": 10}, keep_alive=0)
    assert r.response == expected["m"]
    wait_until(lambda: "unloaded model m (idle past its keep-alive)" in server.stderr())
    assert "m" not in loaded(server)
    assert complete(server, "m") == expected["m"]  # loaded again when asked
    ps = {m.model: m for m in client.ps().models}
    assert ps["m"].expires_at.year == 9999  # the server's --keep-alive -1: never


def test_a_model_answers_while_another_loads(server, expected):
    """A loaded model's stream goes on while another model loads (each model has its own engine
    thread; a load runs in a worker thread, never on the event loop), and both answers are right."""
    key = {"qwen": "q"}.get
    stay = next(iter(loaded(server)))
    complete(server, stay)  # the most recently used: the load unloads the other one
    gone = ({"qwen", "l", "m"} - loaded(server)).pop()
    slow: dict = {}

    def load_gone():
        slow["text"] = complete(server, gone)

    def counts() -> tuple[int, int]:
        log = server.stderr()
        return log.count(f"loading model {gone} ("), log.count(f"loaded model {gone} (")

    before = counts()
    body = {"model": stay, "prompt": PROMPT, "max_tokens": 600, "temperature": 0, "ignore_eos": True, "stream": True}
    during, t = 0, threading.Thread(target=load_gone)  # pieces that came while the log showed the load under way
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = []
        for line in r.iter_lines():
            if not lines:
                t.start()  # once the stream has begun
            lines.append(line)
            loading, done = counts()
            during += loading > before[0] and done == before[1]
        assert [x for x in lines if x][-1] == "data: [DONE]"
    t.join()
    assert slow["text"] == expected[key(gone, gone)]
    assert loaded(server) == {stay, gone}
    assert during > 0


def test_pool_never_unloads_a_model_a_request_holds():
    """The pool alone, with stand-in models: the count cap makes room by unloading the least
    recently used idle model only; a load waits while every other loaded model is held."""
    from mlxpaged.server.model_pool import ModelPool, ModelSpec

    closed: list[str] = []

    class Loop:
        busy = False

        def __init__(self, name):
            self.name = name

    def build(spec):
        return Loop(spec.name), None, None, 10

    async def run():
        pool = ModelPool(
            [ModelSpec(n, n) for n in "abc"],
            build,
            lambda loop, app: closed.append(loop.name),
            max_bytes=100,
            max_loaded=2,
            keep_alive=float("inf"),
        )
        a, b, c = pool.models
        await pool.acquire(a)
        await pool.acquire(b)
        pool.release(b)  # a is held, b idle
        await pool.acquire(c)  # room for c: b goes, never a
        assert closed == ["b"] and {s.name for s in pool.loaded()} == {"a", "c"}
        waiting = asyncio.ensure_future(pool.acquire(b))  # a and c held: b waits
        await asyncio.sleep(0.2)
        assert not waiting.done() and closed == ["b"]
        pool.release(a)
        await asyncio.wait_for(waiting, 5)
        assert closed == ["b", "a"] and {s.name for s in pool.loaded()} == {"b", "c"}

    asyncio.run(run())


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--keep-alive", "5m"],
            "error: --keep-alive applies to a server of several models: give --model more than once",
        ),
        (["--model", "x=SECOND", "--max-memory", "lots"], "error: --max-memory: 'lots' is neither a fraction"),
    ],
)
def test_pool_flags_are_refused_in_one_line(paths, args, message):
    r = subprocess.run(
        [sys.executable, "-m", "mlxpaged.cli", "serve", "--model", str(paths["q"])]
        + [a.replace("SECOND", str(paths["l"])) for a in args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and r.stderr.startswith(message) and r.stderr.count("\n") == 1, r.stderr
