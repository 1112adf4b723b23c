"""Soak: a long-running server's memory stays flat (the complaint users of peer servers file most).

Requests over HTTP with random prompt lengths, random n in 1..4, a tenth of the clients
disconnecting mid-stream and some bad requests. Afterwards no KV block is in use, and MLX's
active memory returns to within 64 KB of its value after the first 50 requests, the engine and
its loop hold no finished request, and resident memory stays within 5% (plus one malloc arena).
MLXPAGED_SOAK_REQUESTS sets the size (default 100; the full run is 1,000).
"""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_proc import Server

pytestmark = pytest.mark.soak

WARMUP = 50
CLIENTS = 8


def one_request(url: str, model: str, rng: random.Random) -> str:
    """Send one random request; returns what happened ("ok", "disconnect", "bad")."""
    kind = rng.random()
    body = {
        "model": model,
        "prompt": [rng.randrange(5, 300) for _ in range(rng.randint(4, 400))],
        "n": rng.randint(1, 4),
        "max_tokens": rng.randint(4, 48),
        "temperature": rng.choice([0.0, 0.8]),
        "seed": rng.randrange(1000),
        "stream": True,
    }
    with httpx.Client(timeout=120) as h:
        if kind < 0.05:  # bad requests of several kinds
            bad = rng.choice([{"n": 0}, {"max_tokens": "x"}, {"model": "nope"}, {"prompt": []}, {"prompt": [5] * 5000}])
            r = h.post(url + "/v1/completions", json={**body, **bad})
            assert r.status_code == (404 if "model" in bad else 400), r.text  # an unknown model is OpenAI's 404
            return "bad"
        with h.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            if kind < 0.15:  # a tenth of the clients leave mid-stream
                for _ in range(2):
                    next(lines, None)
                return "disconnect"
            data = [ln for ln in lines if ln.startswith("data:")]
            assert data[-1] == "data: [DONE]" and '"error"' not in "".join(data)
    return "ok"


def wait_idle(server: Server, timeout: float = 30.0) -> dict:
    t0 = time.monotonic()
    while True:
        m = server.metrics()
        if (
            m["mlxpaged_kv_blocks_used"] == 0
            and m["mlxpaged_requests_running"] == 0
            and m["mlxpaged_requests_waiting"] == 0
        ):
            return m
        assert time.monotonic() - t0 < timeout, {
            k: v for k, v in m.items() if k.startswith("mlxpaged_re") or "blocks" in k
        }
        time.sleep(0.05)


def run_batch(server: Server, model: str, seeds: range) -> dict[str, int]:
    counts: dict[str, int] = {}
    with ThreadPoolExecutor(CLIENTS) as pool:
        for what in pool.map(lambda s: one_request(server.url, model, random.Random(s)), seeds):
            counts[what] = counts.get(what, 0) + 1
    return counts


def test_soak_memory_is_flat(tiny_model_path):
    total = int(os.environ.get("MLXPAGED_SOAK_REQUESTS", "100"))
    server = Server(tiny_model_path, "--num-blocks", "1024", "--max-num-seqs", "32")
    try:
        model = tiny_model_path.name
        t0 = time.monotonic()
        counts = run_batch(server, model, range(WARMUP))
        base = wait_idle(server)
        more = run_batch(server, model, range(WARMUP, total))
        end = wait_idle(server)
        for k, v in more.items():
            counts[k] = counts.get(k, 0) + v
        active0, active1 = base["mlxpaged_mlx_active_memory_bytes"], end["mlxpaged_mlx_active_memory_bytes"]
        rss0, rss1 = base["process_resident_memory_bytes"], end["process_resident_memory_bytes"]
        print(
            f"\nsoak: {total} requests {counts} in {time.monotonic() - t0:.0f} s; "
            f"generated {end['mlxpaged_generation_tokens_total']:.0f} tokens; "
            f"preemptions {end['mlxpaged_preemptions_total']:.0f}; "
            f"MLX active {active0 / 1e6:.1f} -> {active1 / 1e6:.1f} MB; MLX cache "
            f"{base['mlxpaged_mlx_cache_memory_bytes'] / 1e6:.1f} -> "
            f"{end['mlxpaged_mlx_cache_memory_bytes'] / 1e6:.1f} MB; RSS {rss0 / 1e6:.1f} -> {rss1 / 1e6:.1f} MB"
        )
        assert end["mlxpaged_kv_blocks_used"] == 0
        # Nothing of a finished request stays behind: the engine and the loop hold none when idle.
        assert end["mlxpaged_requests_held"] == 0 and end["mlxpaged_sinks_held"] == 0
        assert counts.get("disconnect", 0) > 0 and counts.get("bad", 0) > 0
        # The pool is fixed and idle frees MLX's cache: active memory returns to within 64 KB, so a leak
        # of even 1 KB per request shows over the full 1,000-request run (64 KB / 950 requests).
        assert abs(active1 - active0) <= 64 * 1024
        # A leak grows with the requests; a worker thread's first malloc arena is a one-off step
        # of up to ~17 MB (seen before this test's code changed, under load), allowed once here.
        assert abs(rss1 - rss0) <= 0.05 * rss0 + 24e6
    finally:
        server.stop()
