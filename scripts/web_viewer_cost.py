"""What a connected web viewer costs the engine: step time with the page's cache stream open against none.

One `mlxpaged serve` on the tiny random checkpoint; each run sends the same load (`--requests`
chat requests at once, n=2, `--max-tokens` tokens each, EOS ignored) and divides its wall time
by the engine steps it took (/health counts them). Runs alternate: no viewer, then a viewer
reading /web/cache (server-sent events) for the whole run, `--repeats` times each, back to back in
alternating order; the ratio is formed within each repeat. Then, in process, the time one picture
takes to build and serialize (what the engine and event-loop threads spend per picture).

    python scripts/web_viewer_cost.py [--repeats 3] [--num-blocks 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

from mlxpaged.bench.report import write_json
from mlxpaged.testing.tiny_model import write_tiny_qwen2


def _steps(url: str) -> int:
    return httpx.get(url + "/health", timeout=5).json()["steps"]


def _viewer(url: str, stop: threading.Event, counts: list[int]) -> None:
    try:
        with httpx.stream("GET", url + "/web/cache", timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])  # a real viewer parses every picture
                    counts[0] += 1
                if stop.is_set():
                    return
    except httpx.HTTPError:  # the server stopped
        pass


def picture_cost(tiny: Path, num_blocks: int, requests: int, max_tokens: int) -> tuple[float, int]:
    """In process: seconds one cache picture takes to build (`cache_view`), a picture every step of
    the same load, and the number of pictures; the feed builds at most one per 50 ms."""
    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.builder import build_engine
    from mlxpaged.engine.cache_view import Labels, cache_view
    from mlxpaged.engine.sampling_params import SamplingParams

    engine = build_engine(str(tiny), EngineConfig.of(num_blocks=num_blocks), dtype="float32")
    for i in range(requests):
        engine.add_request(
            f"request {i}: tell me a long story",
            SamplingParams(n=2, max_tokens=max_tokens, seed=i, temperature=0.8, ignore_eos=True),
        )
    labels, spent, count = Labels(), 0.0, 0
    while engine.has_unfinished_requests():
        engine.step()
        t = time.perf_counter()
        json.dumps(cache_view(engine, labels))  # built on the engine thread; serialized on the event loop
        spent += time.perf_counter() - t
        count += 1
    return spent / count, count


def _run(url: str, model: str, requests: int, max_tokens: int, viewer: bool) -> tuple[float, int, int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    stop, counts = threading.Event(), [0]
    watcher = threading.Thread(target=_viewer, args=(url, stop, counts), daemon=True) if viewer else None
    if watcher:
        watcher.start()
        time.sleep(0.5)
    s0, t0 = _steps(url), time.perf_counter()

    def one(i: int):
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"request {i}: tell me a long story"}],
            n=2,
            max_tokens=max_tokens,
            temperature=0.8,
            seed=i,
            extra_body={"ignore_eos": True},
        )

    with ThreadPoolExecutor(requests) as pool:
        list(pool.map(one, range(requests)))
    dt, steps = time.perf_counter() - t0, _steps(url) - s0
    stop.set()
    return dt / steps * 1e3, steps, counts[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    tiny = write_tiny_qwen2(Path(tempfile.mkdtemp()) / "tiny-qwen2")
    cmd = [sys.executable, "-m", "mlxpaged.cli", "serve", "--model", str(tiny), "--dtype", "float32"]
    cmd += ["--port", str(a.port), "--num-blocks", str(a.num_blocks), "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{a.port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        model = openai.OpenAI(base_url=url + "/v1", api_key="none").models.list().data[0].id
        _run(url, model, a.requests, 32, False)  # warm-up
        rows = {"none": [], "viewer": []}
        for rep in range(a.repeats):
            # back to back, the order alternating, so a load that drifts favours neither
            for kind in ("none", "viewer") if rep % 2 == 0 else ("viewer", "none"):
                ms, steps, pictures = _run(url, model, a.requests, a.max_tokens, kind == "viewer")
                rows[kind].append({"ms_per_step": ms, "steps": steps, "pictures": pictures})
                print(f"repeat {rep + 1} {kind:6s}: {ms:.2f} ms/step over {steps} steps, {pictures} pictures received")
        for kind, rs in rows.items():
            ms = [r["ms_per_step"] for r in rs]
            print(f"{kind:6s}: median {statistics.median(ms):.2f} ms/step (runs {', '.join(f'{m:.2f}' for m in ms)})")
        ratios = [v["ms_per_step"] / n["ms_per_step"] for v, n in zip(rows["viewer"], rows["none"])]
        med, lo, hi = statistics.median(ratios), min(ratios), max(ratios)
        print(f"viewer / none within a repeat: median {med:.2f} (min {lo:.2f}, max {hi:.2f})")
        cost, pictures = picture_cost(tiny, a.num_blocks, a.requests, a.max_tokens)
        print(f"one picture (built + serialized, {a.num_blocks} blocks): {cost * 1e6:.0f} us, mean of {pictures}")
        if a.json:
            out = {"settings": vars(a), "load_average": os.getloadavg(), "runs": rows, "ratios": ratios}
            out |= {"picture_us": cost * 1e6, "pictures": pictures}
            write_json(a.json, "web_viewer_cost", "tiny-qwen2", out)
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
