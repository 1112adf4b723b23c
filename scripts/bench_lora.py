"""Many LoRA adapters in one batch: decode throughput of 8 requests over 4 adapters (2 each).

Four systems, `--repeats` times each, the order rotating every repeat (a shared machine's load
moves timings more than one run can show):
- mixed: one mlxpaged engine holding the 4 adapters, all 8 requests in one batch (each step's
  rows of the 4 adapters share one packed forward pass);
- separate: the same engine, one adapter's 2 requests at a time (4 runs one after another);
- base: the same engine, the 8 requests on the base model (what the adapters cost);
- serve: `mlxpaged serve --adapter ...`, the 8 requests sent at once over HTTP (`model: "base:NAME"`);
- mlx_lm.server: the same 8 requests at once, each naming its adapter folder in `adapters` (it
  loads the model again whenever a request names another adapter).
mixed, separate and base report decode tokens/s (generated tokens after every request of the run has its
first token, over that time); the two servers report end-to-end tokens/s (completion tokens over
the wall time of the 8 requests, prefill and reloads included). Each is given per wall second and
per CPU second of the process that computes it (this process, or the server's): on a machine
shared with other work the CPU seconds move far less than the wall time. Every figure is a median
with its min-max range.

    python scripts/bench_lora.py                    # tiny random-weight Qwen2 and 4 tiny adapters
    python scripts/bench_lora.py --max-tokens 32 --repeats 3 --no-servers
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlxpaged  # noqa: F401  (first: system BLAS on Linux)


def engine_run(engine, asks, max_tokens: int) -> tuple[int, float, float]:
    """(tokens generated after every request had its first, the wall seconds and the CPU seconds
    of this process that took) for `asks` ((prompt, adapter) pairs) run to completion as one batch."""
    from mlxpaged import SamplingParams

    rids = [
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, adapter=a))
        for p, a in asks
    ]
    counts = dict.fromkeys(rids, 0)
    start = first_tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
        if start is None and all(counts.values()):
            start, cpu, first_tokens = time.perf_counter(), time.process_time(), sum(counts.values())
    return sum(counts.values()) - first_tokens, time.perf_counter() - start, time.process_time() - cpu


class Proc:
    """A server subprocess, ready when its /health (or /v1/models) answers."""

    def __init__(self, cmd: list[str], url: str, probe: str):
        import httpx

        self.url = url
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{cmd[:4]} exited: {self.log.read()[-2000:]}")
            try:
                if httpx.get(url + probe, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError(f"{cmd[:4]} did not start")

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


def http_run(server: Proc, bodies: list[dict]) -> tuple[int, float, float]:
    """(completion tokens, wall seconds, the server process's CPU seconds) of `bodies` sent at once
    to /v1/completions."""
    import httpx
    import psutil

    proc = psutil.Process(server.proc.pid)
    url = server.url

    def one(body):
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    cpu = sum(proc.cpu_times()[:2])
    t = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        tokens = sum(pool.map(one, bodies))
    return tokens, time.perf_counter() - t, sum(proc.cpu_times()[:2]) - cpu


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-servers", action="store_true", help="the two engine runs only")
    ap.add_argument("--json", dest="json_out", default=None, help="write the results to this file")
    args = ap.parse_args()

    from mlxpaged import EngineConfig
    from mlxpaged.bench.repeat import fmt, spread
    from mlxpaged.engine.builder import build_engine
    from mlxpaged.loading.loader import load
    from mlxpaged.testing.tiny_adapter import write_tiny_adapter
    from mlxpaged.testing.tiny_model import CORPUS, write_tiny_qwen2

    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    base = write_tiny_qwen2(work / "base")
    names = ["a", "b", "c", "d"]
    folders = {n: write_tiny_adapter(base, work / n, seed=i + 1) for i, n in enumerate(names)}
    prompts = CORPUS[:8]
    asks = [(prompts[i], names[i % 4]) for i in range(8)]
    loaded = load(str(base), "float32")
    engine = build_engine(
        loaded,
        EngineConfig.of(num_blocks=1024, enable_prefix_caching=False),
        adapters={n: str(f) for n, f in folders.items()},
    )
    engine_run(engine, asks[:4], 4)  # warm up

    def mixed():
        return engine_run(engine, asks, args.max_tokens)

    def separate():
        runs = [engine_run(engine, [x for x in asks if x[1] == n], args.max_tokens) for n in names]
        return tuple(sum(r[i] for r in runs) for i in range(3))

    def plain():
        return engine_run(engine, [(p, None) for p, _ in asks], args.max_tokens)

    systems = {"mixed": mixed, "separate": separate, "base": plain}
    servers = []
    if not args.no_servers:
        port = free_port()
        ours = Proc(
            [sys.executable, "-m", "mlxpaged.cli", "serve", "--model", str(base), "--dtype", "float32"]
            + ["--port", str(port), "--log-level", "warning", "--no-prefix-caching"]
            + [f"--adapter={n}={f}" for n, f in folders.items()],
            f"http://127.0.0.1:{port}",
            "/health",
        )
        servers.append(ours)
        port2 = free_port()
        theirs = Proc(
            [sys.executable, "-m", "mlx_lm", "server", "--model", str(base), "--port", str(port2)]
            + ["--log-level", "WARNING", "--prompt-cache-size", "0"],
            f"http://127.0.0.1:{port2}",
            "/v1/models",
        )
        servers.append(theirs)
        common = {"max_tokens": args.max_tokens, "temperature": 0.0}
        ours_bodies = [{"model": f"base:{a}", "prompt": p, **common} for p, a in asks]
        theirs_bodies = [{"model": str(base), "prompt": p, "adapters": str(folders[a]), **common} for p, a in asks]
        http_run(ours, ours_bodies[:4])  # warm up
        http_run(theirs, theirs_bodies[:4])
        systems["serve"] = lambda: http_run(ours, ours_bodies)
        systems["mlx_lm.server"] = lambda: http_run(theirs, theirs_bodies)
    try:
        order = list(systems)
        rates = {k: [] for k in order}  # tokens per wall second
        cpu_rates = {k: [] for k in order}  # tokens per CPU second of the process that computes them
        tokens = {k: [] for k in order}
        for i in range(args.repeats):
            for k in order[i % len(order) :] + order[: i % len(order)]:
                n, s, c = systems[k]()
                rates[k].append(n / s)
                cpu_rates[k].append(n / c)
                tokens[k].append(n)
    finally:
        for s in servers:
            s.close()
    print(f"8 requests over 4 adapters, {args.max_tokens} tokens each, {args.repeats} repeats (order rotating)")
    print("median (min-max)      tokens per wall second       tokens per CPU second")
    for k in order:
        kind = "decode" if k in ("mixed", "separate", "base") else "end-to-end"
        w, c = fmt(spread(rates[k]), 1), fmt(spread(cpu_rates[k]), 1)
        print(f"  {k:14s} {w:>26s} {c:>26s}  {kind}, {tokens[k][0]} tokens a run")
    pairs = [("mixed", "separate"), ("mixed", "base")] + ([("serve", "mlx_lm.server")] if "serve" in rates else [])
    for a, b in pairs:
        wall = [x / y for x, y in zip(rates[a], rates[b])]
        cpu = [x / y for x, y in zip(cpu_rates[a], cpu_rates[b])]
        print(f"  {a} / {b}: wall {fmt(spread(wall))}, CPU {fmt(spread(cpu))}")
    if args.json_out:
        out = {"wall_rates": rates, "cpu_rates": cpu_rates, "tokens": tokens}
        Path(args.json_out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
