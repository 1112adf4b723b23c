"""The web page of `mlxpaged serve`, in a real headless Chromium (Debian's, through Selenium and
chromedriver; nothing downloaded), and its cache view's JSON against a strict schema.

References: the official `openai` client's answers (the page must show the same greedy text), the
API's own usage numbers (the blocks the pool view shows cached after a request), `jsonschema`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time

import httpx
import jsonschema
import pytest

from mlxpaged.testing.slowness import wall

from server_proc import Server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
BS = 16  # the server's block size (the default)
NUM_BLOCKS = 256  # more than all tests here take together: no cached block is evicted, counts add up


def _browser(*extra: str):
    """Headless Chromium; `extra`: more command-line switches (a host resolver rule...)."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        why = "Chromium is not installed: apt-get install -y chromium chromium-driver (see .ci/run)"
        if os.environ.get("CI"):  # CI installs it: a missing browser there is a failure, not a skip
            pytest.fail(why)
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM  # with the Service below, Selenium Manager never downloads anything
    switches = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,900")
    for arg in (*switches, *extra):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


@pytest.fixture(scope="module")
def browser():
    driver = _browser()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(tiny_model_path):
    s = Server(tiny_model_path, "--num-blocks", str(NUM_BLOCKS))
    yield s
    s.stop()


def _wait(driver, cond, timeout=20.0, what="condition"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, wall(timeout), poll_frequency=0.05).until(lambda d: cond(d), message=what)


def _css(driver, sel):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, sel)


def _text(driver, sel) -> str:
    els = _css(driver, sel)
    return els[0].text if els else ""


def _console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _open(driver, server) -> None:
    driver.get(server.url + "/")
    model = server.client().models.list().data[0].id
    _wait(driver, lambda d: _text(d, "#model") == model, what="the model's name")
    _wait(driver, lambda d: _text(d, "#cache-state").startswith("live"), what="the cache view's stream")
    # "live" is shown when the stream opens; the first picture may draw a moment later
    _wait(driver, lambda d: _pool(d)["total"] > 0, what="the cache view's first picture")


def _ask(driver, text: str, *, n=1, temperature=0.0, max_tokens=16) -> None:
    driver.execute_script(
        "document.getElementById('n').value = arguments[0];"
        "document.getElementById('temperature').value = arguments[1];"
        "document.getElementById('max-tokens').value = arguments[2];"
        "document.getElementById('prompt').value = arguments[3];",
        n,
        temperature,
        max_tokens,
        text,
    )
    _css(driver, "#send")[0].click()


def _answers(driver) -> list[tuple[str, str]]:
    """(text, meta) of each answer of the last turn, read in one script (the page keeps changing)."""
    return [
        tuple(a)
        for a in driver.execute_script(
            "const t = [...document.querySelectorAll('.turn')].pop();"
            "return t ? [...t.querySelectorAll('.answer')].map(a => [a.querySelector('.text').textContent,"
            " a.querySelector('.meta').textContent]) : [];"
        )
    ]


def _greedy(server, text: str, max_tokens: int) -> str:
    r = server.client().chat.completions.create(
        model=server.client().models.list().data[0].id,
        messages=[{"role": "user", "content": text}],
        temperature=0,
        max_tokens=max_tokens,
    )
    return r.choices[0].message.content


def _place(driver, sel) -> tuple[float, float]:
    """Where an element is on the screen (its top-left corner in the viewport)."""
    r = driver.execute_script(
        "const r = document.querySelector(arguments[0]).getBoundingClientRect(); return [r.x, r.y];", sel
    )
    return tuple(r)


def _pool(driver) -> dict:
    """The pool view's cells by class, and the block ids the request tables show, in one read."""
    return driver.execute_script(
        "const cells = [...document.querySelectorAll('#pool .block')];"
        "const ids = cls => cells.flatMap((c, i) => c.classList.contains(cls) ? [i] : []);"
        "return {used: ids('used'), cached: ids('cached'), total: cells.length,"
        " chips: [...document.querySelectorAll('#requests .chip')].map(c => +c.textContent),"
        " reqs: document.querySelectorAll('#requests .req').length};"
    )


def test_page_loads_and_chat_answers_as_the_api(server, browser):
    _open(browser, server)
    assert _pool(browser)["total"] == NUM_BLOCKS
    text = "Tell me about paged attention."
    _ask(browser, text, max_tokens=12)
    _wait(browser, lambda d: _answers(d) and _answers(d)[0][1] == "finish: length", what="the answer")
    assert _answers(browser) == [(_greedy(server, text, 12), "finish: length")]
    assert _console_errors(browser) == []


def test_n2_shows_two_answers(server, browser):
    _open(browser, server)
    text = "Two answers, please."
    _ask(browser, text, n=2, max_tokens=10)
    _wait(browser, lambda d: len(_answers(d)) == 2 and all(m for _, m in _answers(d)), what="two answers")
    greedy = _greedy(server, text, 10)
    assert _answers(browser) == [(greedy, "finish: length")] * 2  # temperature 0: both are the greedy answer
    assert _console_errors(browser) == []


def test_blocks_in_use_then_cached_and_stop_button(server, browser):
    """A long answer: its blocks show in use (the grid and its block table agree) while it streams;
    Stop ends it, and its blocks go back to the pool; a finished answer's full blocks show cached
    in the number the API's usage gives."""
    _open(browser, server)
    before = _pool(browser)
    assert before["used"] == []
    _ask(browser, "Write a long answer about memory.", max_tokens=2000)
    stop_at = _place(browser, "#stop-btn")
    seen = _wait(
        browser,
        lambda d: (p := _pool(d))["used"] and p["chips"] and _answers(d)[0][0] and p,
        what="the request's blocks in use while it streams",
    )
    assert set(seen["chips"]) == set(seen["used"])  # n=1, one request: its table is exactly the used blocks
    assert seen["reqs"] == 1
    # Stop stays where it was while the answer grows (a button that moves is missed by the click)
    assert _place(browser, "#stop-btn") == stop_at
    _css(browser, "#stop-btn")[0].click()
    _wait(browser, lambda d: _answers(d)[0][1] == "stopped", what="the stopped answer")
    _wait(browser, lambda d: not _pool(d)["used"] and not _pool(d)["reqs"], what="the blocks back to the pool")

    # A request that finishes: its full blocks stay cached (prefix caching), the rest free.
    start = _pool(browser)
    _ask(browser, "Count the cached blocks, please.", max_tokens=40)
    _wait(browser, lambda d: _answers(d)[0][1] == "finish: length", what="the answer")
    usage = _wait(browser, lambda d: _text(d, ".turn:last-child .usage"), what="the usage line")
    line = re.fullmatch(r"prompt (\d+) tokens \((\d+) from the prefix cache\), answers (\d+) tokens", usage)
    p, cached, c = map(int, line.groups())
    assert c == 40
    # The KV of the prompt and of all answer tokens but the last is stored; its full blocks are named.
    new_cached = (p + c - 1) // BS - cached // BS
    _wait(
        browser,
        lambda d: not (q := _pool(d))["used"] and len(q["cached"]) == len(start["cached"]) + new_cached,
        what=f"{new_cached} more cached blocks",
    )
    assert _console_errors(browser) == []


def test_the_log_follows_a_long_answer(server, browser):
    """An answer taller than the log keeps its end in view while it streams."""
    _open(browser, server)
    _ask(browser, "Another long answer, please.", max_tokens=1200)
    _wait(browser, lambda d: _answers(d)[0][1] == "finish: length", what="the answer")
    height, top, view = browser.execute_script(
        "const l = document.getElementById('log'); return [l.scrollHeight, l.scrollTop, l.clientHeight];"
    )
    assert height > view + 100  # the answer overflows the log: where it is scrolled to is not a given
    assert top + view >= height - 1


def test_api_key_wrong_then_right(tiny_model_path, browser):
    key = "s3cret-key"
    with_key = Server(tiny_model_path, "--api-key", key, "--num-blocks", "64")
    try:
        assert httpx.get(with_key.url + "/").status_code == 200  # the page itself holds no data
        assert httpx.get(with_key.url + "/web/cache.json").status_code == 401
        browser.get(with_key.url + "/")
        _wait(browser, lambda d: _css(d, "#key-panel")[0].is_displayed(), what="the key prompt")
        assert _text(browser, "#cache-state") == ""  # no cache view without the key
        for attempt, expect in (("not-the-key", "wrong API key"), (key, None)):
            field = _css(browser, "#key")[0]
            field.clear()
            field.send_keys(attempt)
            _css(browser, "#key-save")[0].click()
            if expect:
                _wait(browser, lambda d: expect in _text(d, "#key-error"), what="the wrong key's error")
        model = with_key.client(api_key=key).models.list().data[0].id
        _wait(browser, lambda d: _text(d, "#model") == model, what="the model's name with the key")
        _wait(browser, lambda d: _text(d, "#cache-state").startswith("live"), what="the cache view with the key")
        _ask(browser, "hello", max_tokens=5)
        _wait(browser, lambda d: _answers(d) and _answers(d)[0][1] == "finish: length", what="the answer")
        greedy = with_key.client(api_key=key).chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hello"}],
            temperature=0,
            max_tokens=5,
        )
        assert _answers(browser)[0][0] == greedy.choices[0].message.content
        # the browser logs the 401s it was answered as errors; nothing else may be one
        assert [m for m in _console_errors(browser) if "401" not in m] == []
        # the page's open cache stream does not hold up a shutdown (uvicorn would wait 10 s for it)
        t0 = time.monotonic()
        rc, _ = with_key.interrupt()
        assert rc == 0 and time.monotonic() - t0 < min(wall(4), 9)  # uvicorn would wait 10 s
        browser.get("about:blank")
        browser.get_log("browser")  # the page's failed reconnects to the stopped server: not the next test's
    finally:
        with_key.stop()


def test_preemption_shows_as_it_happens(tiny_model_path, browser):
    """Two requests that cannot both grow in a 12-block pool: the newer is preempted; the page's
    events say so and its counter ends at the number Prometheus' /metrics gives."""
    s = Server(tiny_model_path, "--num-blocks", "12")
    try:
        _open(browser, s)
        model = s.client().models.list().data[0].id

        # two prompts in one body: the engine gets both requests at once
        prompts = ["request one " * 3, "request two " * 3]
        run = lambda: s.client().completions.create(  # noqa: E731
            model=model, prompt=prompts, max_tokens=120, extra_body={"ignore_eos": True}
        )
        t = threading.Thread(target=run)
        t.start()
        _wait(browser, lambda d: "preempted" in _text(d, "#events"), timeout=60, what="a preemption event")
        t.join()
        count = next(v for k, v in s.metrics().items() if "preemptions" in k)
        assert count >= 1
        _wait(browser, lambda d: _text(d, "#c-preemptions") == str(int(count)), what="the preemption counter")
        assert _console_errors(browser) == []
    finally:
        s.stop()
        browser.get("about:blank")
        browser.get_log("browser")  # the page's failed reconnects to the stopped server


# -- the cache view's JSON: shapes and counts only ------------------------------------------------------
_INT = {"type": "integer", "minimum": 0}
_REQUEST = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "status", "n", "prompt_tokens", "cached_tokens", "preemptions", "forked", "samples"],
    "properties": {
        "id": _INT,
        "status": {"enum": ["waiting", "running", "preempted"]},
        "n": _INT,
        "prompt_tokens": _INT,
        "cached_tokens": _INT,
        "preemptions": _INT,
        "forked": {"type": "boolean"},
        "samples": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["sample", "tokens", "blocks"],
                "properties": {"sample": _INT, "tokens": _INT, "blocks": {"type": "array", "items": _INT}},
            },
        },
    },
}
VIEW_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["block_size", "num_blocks", "max_blocks", "pool", "shared", "requests", "waiting", "counters", "idle"],
    "properties": {
        "block_size": _INT,
        "num_blocks": _INT,
        "max_blocks": _INT,
        "pool": {"type": "string", "pattern": r"^[.cu]*$"},
        "shared": {"type": "array", "items": {"type": "array", "items": _INT, "minItems": 2, "maxItems": 2}},
        "requests": {"type": "array", "items": _REQUEST},
        "waiting": {"type": "array", "items": _REQUEST},
        "counters": {"type": "object", "additionalProperties": {"type": "number"}},
        "idle": {"type": "boolean"},
    },
}


def test_cache_view_shows_shapes_and_counts_only(server):
    """While a request with a recognisable prompt runs, the view holds no string but the pool's
    state letters and the statuses, no field the schema does not name, and nothing of the prompt."""
    prompt = "zebra quantum marmalade " * 8
    done = threading.Event()

    def run():
        try:
            server.client().completions.create(
                model=server.client().models.list().data[0].id,
                prompt=prompt,
                max_tokens=300,
                n=2,
                temperature=1.0,
                extra_body={"ignore_eos": True},  # both samples live to the end, sharing the prompt's blocks
            )
        finally:
            done.set()

    t = threading.Thread(target=run)
    t.start()
    views = []
    deadline = time.monotonic() + 30
    while not done.is_set() and time.monotonic() < deadline:
        v = httpx.get(server.url + "/web/cache.json", timeout=10).json()
        if v.get("requests"):
            views.append(v)
        time.sleep(0.05)
    t.join()
    assert views, "no picture showed the running request"
    for v in views:
        jsonschema.validate(v, VIEW_SCHEMA)
        raw = json.dumps(v)
        assert "zebra" not in raw and "chatcmpl" not in raw and "cmpl-" not in raw
        for r in v["requests"]:
            assert r["prompt_tokens"] > 0 and len(r["samples"]) in (1, 2)
            for s in r["samples"]:
                assert len(s["blocks"]) >= -(-s["tokens"] // v["block_size"])  # the table covers its tokens
                assert all(b < v["num_blocks"] for b in s["blocks"])  # every integer there is a block id
    # a forked request's samples share the prompt's blocks: the shared list says so
    forked = [v for v in views if any(r["forked"] for r in v["requests"])]
    assert forked and all(v["shared"] for v in forked)


def test_no_web(tiny_model_path):
    s = Server(tiny_model_path, "--no-web", "--num-blocks", "16")
    try:
        for path in ("/", "/web/app.js", "/web/cache", "/web/cache.json"):
            r = httpx.get(s.url + path)
            assert r.status_code == 404, path
            assert "error" in r.json()
        assert s.client().models.list().data  # the API itself is on
    finally:
        s.stop()


def test_cache_view_counts_a_forked_request(tiny_loaded):
    """In process, n=4 on a 40-token prompt: the picture's sharing and fill follow from paging
    itself. The prompt's 2 full blocks are shared by the 4 samples (reference count 4); each
    sample copied the partly filled third block on its first write (3 copies; the last sample
    keeps the original); the stored tokens are the prompt's full blocks once plus each sample's
    own tokens past them, and waste is the rest of the slots the used blocks reserve."""
    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.cache_view import Labels, cache_view
    from mlxpaged.engine.llm_engine import LLMEngine
    from mlxpaged.engine.sampling_params import SamplingParams

    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=64))
    prompt = [(7 * i + 3) % 300 + 20 for i in range(40)]
    engine.add_request(prompt, SamplingParams(n=4, max_tokens=30, temperature=1.0, seed=0, ignore_eos=True))
    seqs = lambda: [s for r in engine.scheduler.running.values() for s in r.seqs]  # noqa: E731
    while not (len(seqs()) == 4 and all(s.num_computed_tokens >= 50 for s in seqs())):
        engine.step()
    v = cache_view(engine, Labels())
    full = 40 // BS
    samples = v["requests"][0]["samples"]
    assert v["requests"][0]["forked"] and len(samples) == 4
    heads = {tuple(s["blocks"][:full]) for s in samples}
    assert len(heads) == 1 and sorted(v["shared"]) == sorted([b, 4] for b in heads.pop())
    assert len({s["blocks"][full] for s in samples}) == 4  # the third block: each sample's own
    c = v["counters"]
    assert c["cow_copies"] == 3
    stored = full * BS + sum(s["tokens"] - full * BS for s in samples)
    used = len({b for s in samples for b in s["blocks"]})
    assert (c["tokens_stored"], c["blocks_used"], v["pool"].count("u")) == (stored, used, used)
    assert c["blocks_without_sharing"] == sum(len(s["blocks"]) for s in samples)
    assert c["waste"] == pytest.approx(1 - stored / (used * BS))
    assert c["tokens_per_block"] == pytest.approx(stored / used)
    while engine.has_unfinished_requests():
        engine.step()
    v = cache_view(engine, Labels())
    assert v["requests"] == [] and v["counters"]["blocks_used"] == 0 and "u" not in v["pool"]
