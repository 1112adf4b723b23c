"""`mlxpaged serve` over real HTTP: a server subprocess on the tiny model, driven by the `openai` client.

References are independent of the server: `LLM.generate` in this process (same weights, same
SamplingParams) for tokens, mlx-lm's own Qwen2 forward pass for log-probabilities.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

from mlxpaged import LLM, SamplingParams
from mlxpaged.testing.slowness import wall

from server_proc import Server, in_process_app  # noqa: E402

NUM_BLOCKS = 128  # 2,048 token slots: small enough that "cannot fit in the pool" is easy to provoke
PROMPTS = [
    "The KV cache stores",
    "Paged attention borrows",
    "Write a Python function",
    "Blocks of sixteen tokens",
    "Copy-on-write lets many",
    "The quick brown fox",
    "def reverse(s):",
    "virtual memory and paging",
    "one per sequence.",
    "keys and values of",
    "until they diverge.",
    "0123456789 !?",
    "an idea from operating",
    "return s[::-1]",
    "found through a block",
    "jumps over the lazy",
]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    s = Server(tiny_model_path, "--num-blocks", str(NUM_BLOCKS))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(tiny_loaded):
    return LLM(tiny_loaded, num_blocks=512)


def model_name(path) -> str:
    return path.name  # the served name is the checkpoint's folder name, never its path


def collect_stream(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """Concatenated text and finish_reason per choice index, and the usage chunk (if any)."""
    texts, finish, use = {}, {}, None
    for ch in stream:
        if ch.usage is not None:
            use = ch.usage
        for c in ch.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, use


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


# -- tokens equal LLM.generate ----------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n,temperature,seed", [(1, 0.0, None), (4, 0.8, 7)])
def test_completions_match_generate(server, llm, tiny_model_path, stream, n, temperature, seed):
    prompt = "The KV cache stores the keys"
    sp = SamplingParams(n=n, temperature=temperature, seed=seed, max_tokens=24)
    ref = llm.generate(prompt, sp)[0]
    kw = dict(model=model_name(tiny_model_path), prompt=prompt, n=n, temperature=temperature, seed=seed, max_tokens=24)
    if stream:
        texts, finish, use = collect_stream(
            server.client().completions.create(**kw, stream=True, stream_options={"include_usage": True})
        )
    else:
        r = server.client().completions.create(**kw)
        texts = {c.index: c.text for c in r.choices}
        finish = {c.index: c.finish_reason for c in r.choices}
        use = r.usage
    assert texts == {c.index: c.text for c in ref.outputs}
    assert finish == {c.index: c.finish_reason for c in ref.outputs}
    assert use.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)
    assert use.prompt_tokens == len(ref.prompt_token_ids)
    if n > 1:
        assert len(set(texts.values())) > 1  # the samples really differ (seed + i each)


def test_completions_token_id_prompts(server, llm, tiny_model_path):
    """Prompts given as token ids, one list or a list of lists (lm-eval sends them so), give what
    `LLM.generate` gives on the same ids, choices in prompt order."""
    tok = llm.engine.tokenizer
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS[:3]]
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    refs = llm.generate(ids, sp)
    kw = dict(model=model_name(tiny_model_path), temperature=0.0, max_tokens=8)
    one = server.client().completions.create(prompt=ids[0], **kw)
    assert [c.text for c in one.choices] == [refs[0].outputs[0].text]
    assert one.usage.prompt_tokens == len(ids[0])
    many = server.client().completions.create(prompt=ids, **kw)
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == [r.outputs[0].text for r in refs]
    assert many.usage.prompt_tokens == sum(map(len, ids))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_generate(server, llm, tiny_model_path, stream):
    messages = [
        {"role": "system", "content": "Blocks of sixteen tokens."},
        {"role": "user", "content": "Write a Python function"},
    ]
    ref = llm.generate(chat_ids(llm.tokenizer, messages), SamplingParams(temperature=0, max_tokens=20))[0]
    kw = dict(model=model_name(tiny_model_path), messages=messages, temperature=0, max_completion_tokens=20)
    if stream:
        texts, finish, _ = collect_stream(server.client().chat.completions.create(**kw, stream=True))
        assert (texts[0], finish[0]) == (ref.outputs[0].text, ref.outputs[0].finish_reason)
    else:
        r = server.client().chat.completions.create(**kw)
        assert r.choices[0].message.role == "assistant"
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (
            ref.outputs[0].text,
            ref.outputs[0].finish_reason,
        )
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_stop_string_streamed_never_taken_back(server, llm, tiny_model_path):
    """Greedy text cut at a stop string: the streamed deltas add up to the same cut text."""
    prompt = "Paged attention borrows"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0].text
    stop = full[8:11]
    assert stop.strip(), full
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop))[0].outputs[0]
    texts, finish, _ = collect_stream(
        server.client().completions.create(
            model=model_name(tiny_model_path),
            prompt=prompt,
            temperature=0,
            max_tokens=30,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert (texts[0], finish[0]) == (ref.text, "stop") and stop not in texts[0]


# -- logprobs against mlx-lm's forward pass -----------------------------------------------------
def reference_logprobs(mlx_lm_model, ids: list[int]) -> np.ndarray:
    logits = mlx_lm_model(mx.array(ids)[None])[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def test_logprobs_are_the_models(server, llm, tiny_model_path, mlx_lm_tiny):
    model, _ = mlx_lm_tiny
    messages = [{"role": "user", "content": "The quick brown fox"}]
    prompt_ids = chat_ids(llm.tokenizer, messages)
    out = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    ref = reference_logprobs(model, prompt_ids + out.token_ids)[len(prompt_ids) - 1 : -1]
    r = server.client().chat.completions.create(
        model=model_name(tiny_model_path),
        messages=messages,
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == len(out.token_ids)
    for row, tok, entry in zip(ref, out.token_ids, content):
        assert entry.logprob == pytest.approx(row[tok], abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(np.sort(row)[::-1][:3], abs=1e-4)
    # completions: an integer `logprobs`, values of the chosen tokens, with temperature (not transformed)
    comp = server.client().completions.create(
        model=model_name(tiny_model_path), prompt=prompt_ids, max_tokens=6, temperature=0.7, seed=3, logprobs=2
    )
    lp = comp.choices[0].logprobs
    gen = llm.generate(prompt_ids, SamplingParams(temperature=0.7, seed=3, max_tokens=6))[0].outputs[0].token_ids
    ref = reference_logprobs(model, prompt_ids + gen)[len(prompt_ids) - 1 : -1]
    assert lp.token_logprobs == pytest.approx([row[t] for row, t in zip(ref, gen)], abs=1e-4)
    assert [max(d.values()) for d in lp.top_logprobs] == pytest.approx(ref.max(axis=-1), abs=1e-4)


# -- concurrency, disconnects, prefix reuse -----------------------------------------------------
def test_concurrent_streams_equal_alone(server, llm, tiny_model_path):
    alone = [
        llm.generate(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0].text
        for p in PROMPTS
    ]
    results: dict[int, str] = {}
    running_seen, done = [], threading.Event()

    def client(i):
        texts, _, _ = collect_stream(
            server.client().completions.create(
                model=model_name(tiny_model_path),
                prompt=PROMPTS[i],
                temperature=0,
                max_tokens=40,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        results[i] = texts[0]

    def poll():
        while not done.is_set():
            running_seen.append(server.metrics()["mlxpaged_requests_running"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    poller = threading.Thread(target=poll)
    poller.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    poller.join()
    assert [results.get(i) for i in range(len(PROMPTS))] == alone
    assert max(running_seen) > 1


def test_disconnect_mid_stream_frees_blocks(server, tiny_model_path):
    """A client gone mid-stream: its blocks return to the pool, it stops generating, and the
    prompt tokens it computed are counted on /metrics (an agent CLI that drops a long prefill
    at its timeout did that work)."""
    before = server.metrics()
    assert before["mlxpaged_kv_blocks_used"] == 0
    body = {
        "model": model_name(tiny_model_path),
        "prompt": "The KV cache stores",
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = []
            for ln in lines:
                if ln.startswith("data:"):
                    got.append(ln)
                if len(got) == 5:
                    break
            assert server.metrics()["mlxpaged_kv_blocks_used"] > 0
    t0 = time.monotonic()
    while server.metrics()["mlxpaged_kv_blocks_used"] > 0:
        assert time.monotonic() - t0 < wall(1.0), "blocks not returned within a second of the disconnect"
        time.sleep(0.02)
    after = server.metrics()
    generated = after["mlxpaged_generation_tokens_total"] - before["mlxpaged_generation_tokens_total"]
    assert generated < 1500  # it was aborted, not run to the end
    assert after["mlxpaged_requests_running"] == 0
    n = httpx.post(server.url + "/tokenize", json={"model": body["model"], "prompt": body["prompt"]}).json()["count"]
    prompt = [
        after[f"mlxpaged_prompt_tokens_{k}_total"] - before[f"mlxpaged_prompt_tokens_{k}_total"]
        for k in ("computed", "cached")
    ]
    assert sum(prompt) == n and prompt[0] > 0, (prompt, n)


def test_prefix_reuse_reports_cached_tokens(server, llm, tiny_model_path):
    system = " ".join(["Copy-on-write lets many samples share the blocks of one prompt."] * 12)
    n_sys = len(llm.tokenizer.encode(system))
    assert n_sys >= 100
    c = server.client()
    kw = dict(model=model_name(tiny_model_path), temperature=0, max_tokens=4)
    first = c.chat.completions.create(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "The KV cache"}], **kw
    )
    second = c.chat.completions.create(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Paged attention"}], **kw
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 96


# -- bad input -------------------------------------------------------------------------------------
BAD = [
    ("/v1/completions", b"{not json", "malformed JSON", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": 5}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, "empty", "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature", "temperature"),
    ("/v1/completions", {"prompt": [[1, 2], [99999]]}, "vocabulary", "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 99, "logprobs": True},
        "top_logprobs",
        "top_logprobs",
    ),
    # 2,100 prompt tokens > the 128 x 16 = 2,048-token pool: names the pool and the limit
    (
        "/v1/completions",
        {"prompt": [5 + i % 300 for i in range(2100)], "max_tokens": 4},
        "prompt cannot fit in the KV pool",
        "prompt",
    ),
    # fits alone, but not with 4 samples of 600 tokens
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600, "n": 4}, "request cannot fit in the KV pool", "n"),
    # longer than the model's 4,096 positions
    ("/v1/completions", {"prompt": [5 + i % 300 for i in range(4195)], "max_tokens": 4}, "context", "prompt"),
]


def test_bad_inputs_get_400_with_error_object(server, tiny_model_path):
    with httpx.Client(timeout=30) as h:
        for path, body, words, param in BAD:
            if isinstance(body, bytes):
                r = h.post(server.url + path, content=body, headers={"content-type": "application/json"})
            else:
                r = h.post(server.url + path, json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["type"] == "invalid_request_error"
            assert words in err["message"] and "\n" not in err["message"], (body, err)
            assert err["param"] == param, (body, err)
        assert h.get(server.url + "/v1/nope").json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):  # OpenAI's answer to an unknown model: 404 model_not_found
        server.client().completions.create(model="gpt-9", prompt="hi")
    r = server.client().completions.create(model=model_name(tiny_model_path), prompt="hi", max_tokens=3)
    assert r.choices[0].text is not None and r.usage.completion_tokens >= 1
    assert server.metrics()["mlxpaged_kv_blocks_used"] == 0


def test_models_health_metrics(server, tiny_model_path):
    assert [m.id for m in server.client().models.list()] == [model_name(tiny_model_path)]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    m = server.metrics()
    for name in (
        "requests_running",
        "requests_waiting",
        "kv_blocks_used",
        'prefix_cache_hit_tokens_total{tier="memory"}',
        'prefix_cache_hit_tokens_total{tier="disk"}',
        "preemptions_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
    ):
        assert f"mlxpaged_{name}" in m
    assert m["mlxpaged_kv_blocks_total"] == NUM_BLOCKS


# -- auth, a full queue, Ctrl-C: a second server ----------------------------------------------------
def test_auth_queue_and_interrupt(tiny_model_path):
    s = Server(
        tiny_model_path, "--api-key", "sekret", "--max-queue", "1", "--max-num-seqs", "1", "--shutdown-timeout", "1"
    )
    try:
        name = model_name(tiny_model_path)
        with pytest.raises(openai.AuthenticationError):
            s.client().models.list()
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").completions.create(model=name, prompt="hi", max_tokens=2)
        ok = s.client(api_key="sekret")
        assert ok.completions.create(model=name, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

        # one request runs (max-num-seqs 1), one waits (max-queue 1): a third gets 503 + Retry-After
        auth = {"Authorization": "Bearer sekret"}
        long = {"prompt": "The KV cache", "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
        h = httpx.Client(timeout=30, headers=auth)
        first = h.send(h.build_request("POST", s.url + "/v1/completions", json=long), stream=True)
        first_lines = first.iter_lines()  # kept: closing the iterator closes the response (a disconnect)
        next(first_lines)
        second = []  # sent from a thread: its response headers come only once it is admitted
        t = threading.Thread(
            target=lambda: second.append(
                h.send(h.build_request("POST", s.url + "/v1/completions", json=long), stream=True)
            ),
            daemon=True,
        )
        t.start()
        t0 = time.monotonic()
        while s.metrics()["mlxpaged_requests_waiting"] < 1:
            assert time.monotonic() - t0 < wall(10), (
                {k: v for k, v in s.metrics().items() if "mlxpaged_re" in k or "gen" in k},
                second,
            )
            time.sleep(0.02)
        busy = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "queue_full"

        # Ctrl-C with two requests in flight: a clean exit, no traceback
        rc, err = s.interrupt()
        assert rc == 0, err
        assert "Traceback" not in err and "stopped" in err
        rest = [ln for ln in first_lines if ln.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2]  # aborted after the 1 s drain
        t.join(5)
    finally:
        s.stop()


# -- a failing step fails only its requests (in process: a fault injected into the forward pass) ----
def test_step_error_fails_only_its_requests(tiny_loaded, monkeypatch):
    from fastapi.testclient import TestClient

    app, loop = in_process_app(tiny_loaded)
    engine = loop.engine
    real, calls = engine._forward, []  # the forward pass of one step, inside step()'s StepError guard

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return real(*a, **kw)

    monkeypatch.setattr(engine, "_forward", flaky)
    with TestClient(app) as c:
        bad = c.post("/v1/completions", json={"prompt": "The KV cache", "max_tokens": 4})
        assert bad.status_code == 500
        assert "injected fault" in bad.json()["error"]["message"]
        good = c.post("/v1/completions", json={"prompt": "The KV cache", "max_tokens": 4, "temperature": 0})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
        deadline = time.monotonic() + 2  # the snapshot follows the step that delivered the answer
        while loop.snapshot["kv_blocks_used"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.snapshot["kv_blocks_used"] == 0
    assert not loop._thread.is_alive()


def test_generate_works_without_serve_extra(tmp_path):
    """`mlxpaged --help` lists serve, and importing the CLI does not import FastAPI."""
    code = (
        "import sys, mlxpaged.cli.main; assert 'fastapi' not in sys.modules and 'uvicorn' not in sys.modules; "
        "print(sorted(mlxpaged.cli.main.main.commands))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=wall(60))
    assert out.returncode == 0, out.stderr
    assert "serve" in out.stdout and "generate" in out.stdout
