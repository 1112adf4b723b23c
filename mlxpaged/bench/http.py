"""`mlxpaged bench serve`: mlxpaged's server vs mlx_lm.server over HTTP, as a user would measure them.

Both servers load the same converted checkpoint and get the same streamed requests, arriving as
a Poisson process at each rate. Per request: time to first token (TTFT), inter-token latency
(ITL: a request's first-to-last token time over its tokens per sample minus one), and normalized latency
(end-to-end seconds / output tokens, the paper's Figure 12 measure). Per run: completed
requests/s and the server's peak resident memory (sampled every 50 ms with psutil).

Prompts are real ShareGPT (or Alpaca) text, the first requests that pass the benchmark's length
filter after the seeded shuffle (`bench/datasets.py`), cut to `--max-prompt` tokens; each asks
for its traced answer length, capped at `--max-output`. mlx_lm.server has no `n`: an n-sample
request is sent to it as n requests. On the CPU both servers load a float32 copy of the
checkpoint (mlx_lm.server has no dtype flag and float16 is slow on the CPU), and both use the
system OpenBLAS (mlx_lm.server is started after `mlxpaged._blas` loads it).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Req:
    prompt: str
    max_tokens: int
    system: str | None = None


@dataclass
class RunResult:
    server: str
    load: str
    rate: float
    completed: int = 0
    failed: int = 0
    duration_s: float = 0.0
    ttft: list = field(default_factory=list)
    itl: list = field(default_factory=list)
    norm_latency: list = field(default_factory=list)
    output_tokens: int = 0
    peak_rss_mb: float = 0.0

    def summary(self) -> dict:
        def q(xs, p):
            return statistics.quantiles(xs, n=10)[p - 1] if len(xs) >= 2 else (xs[0] if xs else float("nan"))

        med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
        return {"server": self.server, "load": self.load, "rate": self.rate, "completed": self.completed,
                "failed": self.failed, "req_per_s": self.completed / self.duration_s if self.duration_s else 0.0,
                "ttft_ms_median": 1e3 * med(self.ttft), "ttft_ms_p90": 1e3 * q(self.ttft, 9),
                "itl_ms_median": 1e3 * med(self.itl), "itl_ms_p90": 1e3 * q(self.itl, 9),
                "norm_latency_s_per_tok": med(self.norm_latency), "output_tokens": self.output_tokens,
                "peak_rss_mb": self.peak_rss_mb}


# -- the load --------------------------------------------------------------------------------------
def build_requests(tokenizer, trace: str, count: int, max_prompt: int, max_output: int, seed: int = 0) -> list[Req]:
    """`count` real prompts of data set `trace`, at most `max_prompt` tokens, asking for their
    traced answer length capped at `max_output`."""
    from .datasets import sample_requests

    out = []
    for text, p, a in sample_requests(trace, lambda ts: [len(tokenizer.encode(t)) for t in ts], count):
        if p > max_prompt:
            text = tokenizer.decode(tokenizer.encode(text)[:max_prompt])
        out.append(Req(text, min(a, max_output)))
    return out


def shared_system_prompt(tokenizer, tokens: int = 500) -> str:
    from .prompts import load_prompts

    ids = tokenizer.encode("You are a careful assistant. Follow these examples.\n" + "\n".join(load_prompts(400)[200:]))
    return tokenizer.decode(ids[:tokens])


# -- servers ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    def __init__(self, name: str, cmd: list[str], port: int, timeout: float = 300):
        import httpx

        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{name} did not start in {timeout} s")

    def rss_mb(self) -> float:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss / 1e6

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(name: str, model_path: str, extra: list[str]) -> ServerProc:
    port = free_port()
    if name == "mlxpaged":
        cmd = [sys.executable, "-m", "mlxpaged.cli", "serve", "--model", model_path, "--port", str(port),
               "--log-level", "warning", *extra]
    else:
        # The same BLAS as mlxpaged: load the system OpenBLAS before MLX, then run mlx_lm.server as `-m` would.
        boot = "import mlxpaged._blas as b, runpy; b.use_system_blas(); runpy.run_module('mlx_lm.server', run_name='__main__')"
        cmd = [sys.executable, "-c", boot, "--model", model_path, "--port", str(port), "--log-level", "WARNING"]
    return ServerProc(name, cmd, port)


# -- one run: Poisson arrivals at `rate` -----------------------------------------------------------
async def _one(client: httpx.AsyncClient, url: str, model: str, req: Req, n: int, res: RunResult) -> None:
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + [{"role": "user", "content": req.prompt}]
    body = {"model": model, "messages": messages, "max_tokens": req.max_tokens, "temperature": 0.0 if n == 1 else 0.8,
            "stream": True, "stream_options": {"include_usage": True}}
    if n > 1:
        body.update(n=n, seed=0)
    t0 = time.perf_counter()
    import httpx

    first, last, chunks, tokens = None, None, 0, 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.failed += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    tokens = obj["usage"]["completion_tokens"]
                if any((c.get("delta") or {}).get("content") for c in obj.get("choices", [])):
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
    except httpx.HTTPError:
        res.failed += 1
        return
    end = time.perf_counter()
    tokens = tokens or chunks
    if first is None or tokens == 0:
        res.failed += 1
        return
    res.completed += 1
    res.output_tokens += tokens
    res.ttft.append(first - t0)
    per_sample = tokens / n
    if per_sample > 1:  # a request's mean gap between two tokens of one sample
        res.itl.append((last - first) / (per_sample - 1))
    res.norm_latency.append((end - t0) / per_sample)


async def run_load(server: ServerProc, model: str, reqs: list[Req], rate: float, n: int, load: str,
                   seed: int = 0) -> RunResult:
    """Send `reqs` at Poisson arrivals of `rate`/s; an n-sample request goes to mlx_lm.server as n requests."""
    import httpx

    res = RunResult(server.name, load, rate)
    rng = random.Random(seed)
    fan = n if server.name == "mlx_lm" else 1
    samples = n if server.name == "mlxpaged" else 1
    stop = asyncio.Event()

    async def watch_rss():
        while not stop.is_set():
            res.peak_rss_mb = max(res.peak_rss_mb, server.rss_mb())
            await asyncio.sleep(0.05)

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        watcher = asyncio.create_task(watch_rss())
        t0 = time.perf_counter()
        tasks = []
        for req in reqs:
            for _ in range(fan):
                tasks.append(asyncio.create_task(_one(client, server.url, model, req, samples, res)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        res.duration_s = time.perf_counter() - t0
        stop.set()
        await watcher
    if fan > 1:  # n requests stand for one n-sample request
        res.completed //= fan
    return res


# -- the sweep -------------------------------------------------------------------------------------
LOADS = {"sharegpt": 1, "n4": 4, "system": 1}  # load name -> n


def model_path(model: str | None, tiny: bool) -> str:
    if tiny:
        from .models import tiny_checkpoint

        return tiny_checkpoint()
    if model is None:  # the offline model, as converted by mlxpaged (mlx-lm reads that folder too)
        from ..loading.loader import load

        model = str(load(None, "float32").path)
    return model


def float32_copy(path: str) -> str:
    """A float32 copy of checkpoint `path` (made once, beside mlxpaged's cache), so that both
    servers compute in float32 on the CPU; `path` itself where MLX runs on a GPU."""
    import shutil

    import mlx.core as mx

    if mx.metal.is_available():
        return path
    src = Path(path)
    dst = Path.home() / ".cache" / "mlxpaged" / "bench-float32" / src.name
    if (dst / "model.safetensors").exists():
        return str(dst)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("quantization"):
        return path  # quantized weights stay as they are
    dst.mkdir(parents=True, exist_ok=True)
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update({k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
                        for k, v in mx.load(str(f)).items()})
    mx.save_safetensors(str(dst / "model.tmp.safetensors"), weights)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, dst / f.name)
    cfg["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    (dst / "model.tmp.safetensors").rename(dst / "model.safetensors")
    return str(dst)


def sweep(path: str, rates: list[float], loads: list[str], num_requests: int, max_prompt: int, max_output: int,
          repeats: int, mlxpaged_args: list[str], trace: str = "sharegpt", progress=print) -> list[dict]:
    """Every (load, rate) on both servers, `repeats` times, alternating which server goes first."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(Path(path))
    reqs = build_requests(tok, trace, num_requests, max_prompt, max_output)
    system = shared_system_prompt(tok)
    rows = []
    for rep in range(repeats):
        for name in (("mlxpaged", "mlx_lm") if rep % 2 == 0 else ("mlx_lm", "mlxpaged")):
            server = start_server(name, path, mlxpaged_args)
            try:
                for load in loads:
                    rs = [Req(r.prompt, r.max_tokens, system) for r in reqs] if load == "system" else reqs
                    asyncio.run(run_load(server, path, rs[:2], 4.0, LOADS[load], load))  # warm-up, not recorded
                    for rate in rates:
                        res = asyncio.run(run_load(server, path, rs, rate, LOADS[load], load, seed=rep))
                        rows.append({**res.summary(), "repeat": rep})
                        progress(_line(rows[-1]))
            finally:
                server.stop()
    return rows


def _line(r: dict) -> str:
    return (f"{r['server']:>8} {r['load']:>8} rate {r['rate']:5.2f}: {r['req_per_s']:5.2f} req/s, TTFT "
            f"{r['ttft_ms_median']:7.0f}/{r['ttft_ms_p90']:7.0f} ms, ITL {r['itl_ms_median']:6.1f}/{r['itl_ms_p90']:6.1f} ms, "
            f"norm {r['norm_latency_s_per_tok']:6.3f} s/tok, peak RSS {r['peak_rss_mb']:6.0f} MB, "
            f"failed {r['failed']}")


def medians(rows: list[dict]) -> list[dict]:
    """One row per (server, load, rate): the median over repeats of each figure, with min-max of norm latency."""
    keys = sorted({(r["server"], r["load"], r["rate"]) for r in rows})
    out = []
    for k in keys:
        rs = [r for r in rows if (r["server"], r["load"], r["rate"]) == k]
        row = {f: statistics.median(r[f] for r in rs) for f in rs[0] if isinstance(rs[0][f], (int, float)) and f != "repeat"}
        row.update(server=k[0], load=k[1], rate=k[2], repeats=len(rs),
                   norm_min=min(r["norm_latency_s_per_tok"] for r in rs), norm_max=max(r["norm_latency_s_per_tok"] for r in rs))
        out.append(row)
    return out


def sustainable(rows: list[dict], server: str, load: str, bound: float) -> float:
    """The highest swept rate whose median normalized latency is within `bound` s/token (0 if none)."""
    ok = [r["rate"] for r in rows if r["server"] == server and r["load"] == load and r["norm_latency_s_per_tok"] <= bound]
    return max(ok, default=0.0)


def report(rows: list[dict], loads: list[str], bound: float, echo=print) -> dict:
    med = medians(rows)
    echo(f"\nmedians over repeats; sustainable = highest rate with normalized latency <= {bound} s/token")
    for r in med:
        echo(_line(r) + f"  (norm min-max {r['norm_min']:.3f}-{r['norm_max']:.3f}, {r['repeats']} runs)")
    ratios = {}
    for load in loads:
        a, b = sustainable(med, "mlxpaged", load, bound), sustainable(med, "mlx_lm", load, bound)
        ratios[load] = {"mlxpaged": a, "mlx_lm": b, "ratio": a / b if b else float("inf") if a else float("nan")}
        echo(f"{load:>8}: sustainable rate mlxpaged {a:.2f} req/s, mlx_lm {b:.2f} req/s, ratio {ratios[load]['ratio']:.2f}")
        for rate in sorted({r["rate"] for r in med if r["load"] == load}):
            x = {r["server"]: r for r in med if r["load"] == load and r["rate"] == rate}
            if len(x) == 2:
                echo(f"{'':>8}  rate {rate:5.2f}: normalized latency mlx_lm/mlxpaged "
                     f"{x['mlx_lm']['norm_latency_s_per_tok'] / x['mlxpaged']['norm_latency_s_per_tok']:.2f}, "
                     f"peak RSS mlx_lm/mlxpaged {x['mlx_lm']['peak_rss_mb'] / x['mlxpaged']['peak_rss_mb']:.2f}")
    return {"medians": med, "sustainable": ratios}


def draw_plot(ax, med: list[dict], loads: list[str]) -> None:
    for load in loads:
        for server, style in (("mlxpaged", "-o"), ("mlx_lm", "--s")):
            rs = sorted((r for r in med if r["load"] == load and r["server"] == server), key=lambda r: r["rate"])
            ax.plot([r["rate"] for r in rs], [r["norm_latency_s_per_tok"] for r in rs], style, label=f"{server} {load}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.legend()


def add_command(bench_group, with_common, write_plot) -> None:
    """Register `mlxpaged bench serve` on the bench group."""
    import click

    @bench_group.command("serve")
    @with_common
    @click.option("--rates", default="0.25,0.5,1", show_default=True, help="Request rates (req/s) to sweep.")
    @click.option("--num-requests", default=16, show_default=True, help="Requests per rate.")
    @click.option("--max-prompt", default=256, show_default=True, help="Cap on the traced prompt length (tokens).")
    @click.option("--max-output", default=32, show_default=True, help="Cap on the traced output length (tokens).")
    @click.option("--loads", default="sharegpt,n4,system", show_default=True, help="sharegpt, n4 (n=4 each), system (500-token shared system prompt).")
    @click.option("--trace", default="sharegpt", type=click.Choice(["sharegpt", "alpaca"]), show_default=True)
    @click.option("--repeats", default=3, show_default=True, help="Runs of each case, alternating which server goes first.")
    @click.option("--bound", default=1.0, show_default=True, help="Normalized-latency bound (s/token) for the sustainable rate.")
    @click.option("--num-blocks", default=None, type=int, help="mlxpaged's KV pool (default: sized from free memory).")
    def serve_cmd(model, tiny, dtype, out_dir, plot, rates, num_requests, max_prompt, max_output, loads, trace,
                  repeats, bound, num_blocks):
        """mlxpaged serve vs mlx_lm.server over HTTP: Poisson arrivals, TTFT, ITL, normalized latency, peak RSS."""
        from .report import write_result

        path = float32_copy(model_path(model, tiny)) if dtype in ("auto", "float32") else model_path(model, tiny)
        rate_list = [float(r) for r in rates.split(",") if r]
        load_list = [x for x in loads.split(",") if x]
        bad = set(load_list) - set(LOADS)
        if bad:
            click.echo(f"error: unknown load(s) {sorted(bad)}; choose from {sorted(LOADS)}", err=True)
            sys.exit(1)
        extra = ["--dtype", dtype] + (["--num-blocks", str(num_blocks)] if num_blocks else [])
        rows = sweep(path, rate_list, load_list, num_requests, max_prompt, max_output, repeats, extra, trace,
                     progress=lambda s: click.echo(s, err=True))
        summary = report(rows, load_list, bound, echo=click.echo)
        out = write_result(out_dir, "serve", Path(path).name, {
            "rates": rate_list, "num_requests": num_requests, "max_prompt": max_prompt, "max_output": max_output,
            "trace": trace, "prompt_text": f"real {trace} text, cut to max_prompt tokens", "bound_s_per_token": bound,
            "rows": rows, **summary})
        click.echo(f"results: {out}")
        if plot:
            write_plot(out, lambda ax: draw_plot(ax, summary["medians"], load_list))
