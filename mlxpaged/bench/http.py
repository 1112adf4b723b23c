"""`mlxpaged bench serve`: mlxpaged's server vs mlx_lm.server over HTTP, as a user would measure them.

Both servers load the same converted checkpoint and get the same streamed requests, arriving as
a Poisson process at each rate. Per request: time to first token (TTFT), inter-token latency
(ITL: first-to-last token time over tokens per sample minus one) and normalized latency
(end-to-end seconds / output tokens per sample, the paper's Figure 12 measure). Per run:
completed requests/s, the server's RSS when idle before the load, its peak RSS under the load
(sampled every 50 ms with psutil) and its RSS a few seconds after the load ended.

What keeps the comparison fair (docs/serving-benchmark.md says why each matters):
- a fresh server per (load, rate, repeat, server), warmed by two requests whose prompts are
  not in the measured set, so no server serves a measured prompt from a cache of an earlier run;
- matched lengths: every request asks for `max_tokens` and both servers must produce exactly
  that many tokens per sample (`ignore_eos` for mlxpaged, `logit_bias` -100 on every EOS id for
  mlx_lm.server, which has no `ignore_eos`); a request that returns another count fails;
- n=4: mlx_lm.server has no `n`, so an n-sample request goes to it as n requests sent at the
  same instant (each prefills the prompt) and counts as done when the last of them is; neither
  server gets a `seed`, because a seeded request makes mlx_lm.server leave its batch and serve
  requests one at a time (`_is_batchable` in mlx_lm/server.py);
- the shared-system-prompt load starts mlx_lm.server with `--prompt-cache-size` large enough to
  keep the shared prefix (PEER_ARGS), and both servers are warmed with that prefix;
- which server runs first alternates per (load, rate) and per repeat.

On the CPU both servers load a float32 copy of the checkpoint (mlx_lm.server has no dtype flag
and float16 is slow on the CPU), and both use the system OpenBLAS (mlx_lm.server is started
after `mlxpaged._blas` loads it). Statistics and the sustainable rate: `http_stats.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# Load name -> n (samples per request).
LOADS = {"sharegpt": 1, "system": 1, "n4": 4}
# mlx_lm.server flags per load: the system load is about reuse, so its prompt cache must be able
# to hold the shared prefix (its LRU evicts "assistant" and "user" entries before "system" ones;
# 32 entries leaves room).
PEER_ARGS = {"system": ["--prompt-cache-size", "32"]}
SYSTEM_PROMPT_TOKENS = 2000
WARMUP = 2  # requests per server start, prompts outside the measured set


@dataclass
class Req:
    prompt: str
    max_tokens: int
    system: str | None = None
    messages: list | None = None  # a whole chat history (the agent load); replaces system + prompt
    tools: list | None = None


@dataclass
class Part:
    """One HTTP request's stream: when it started, its token times, and what usage said."""

    ok: bool = False
    t0: float = 0.0
    first: float | None = None
    last: float | None = None
    end: float = 0.0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


@dataclass
class RunResult:
    server: str
    load: str
    rate: float
    repeat: int = 0
    n: int = 1
    completed: int = 0
    failed: int = 0
    length_mismatches: int = 0
    duration_s: float = 0.0
    ttft: list = field(default_factory=list)
    itl: list = field(default_factory=list)
    norm_latency: list = field(default_factory=list)
    output_tokens: list = field(default_factory=list)  # per request, all samples (None: failed)
    cached_tokens: int = 0
    prompt_tokens_sent: int = 0
    idle_rss_mb: float = 0.0
    peak_rss_mb: float = 0.0
    after_rss_mb: float = 0.0
    errors: list = field(default_factory=list)

    def summary(self) -> dict:
        def q(xs, p):
            return statistics.quantiles(xs, n=10)[p - 1] if len(xs) >= 2 else (xs[0] if xs else None)

        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
        ms = lambda x: None if x is None else 1e3 * x  # noqa: E731
        return {
            "server": self.server,
            "load": self.load,
            "rate": self.rate,
            "repeat": self.repeat,
            "n": self.n,
            "completed": self.completed,
            "failed": self.failed,
            "length_mismatches": self.length_mismatches,
            "req_per_s": self.completed / self.duration_s if self.duration_s else 0.0,
            "duration_s": self.duration_s,
            "ttft_ms_median": ms(med(self.ttft)),
            "ttft_ms_p90": ms(q(self.ttft, 9)),
            "itl_ms_median": ms(med(self.itl)),
            "itl_ms_p90": ms(q(self.itl, 9)),
            "norm_latency_mean": mean(self.norm_latency),
            "norm_latency_median": med(self.norm_latency),
            "output_tokens": self.output_tokens,
            "cached_prompt_tokens": self.cached_tokens,
            "idle_rss_mb": self.idle_rss_mb,
            "peak_rss_mb": self.peak_rss_mb,
            "after_rss_mb": self.after_rss_mb,
            "errors": self.errors[:5],
        }


# -- the load --------------------------------------------------------------------------------------
def build_requests(tokenizer, trace: str, count: int, max_prompt: int, max_output: int) -> list[Req]:
    """`count` distinct prompts: real `trace` text ("sharegpt", "alpaca") at most `max_prompt`
    tokens, each asking for its traced answer length capped at `max_output`; or ("builtin", for
    tests offline) `prompts.builtin_texts` asking for `max_output` tokens each."""
    if trace == "builtin":
        from .prompts import builtin_texts

        texts = builtin_texts()
        if count > len(texts):
            raise ValueError(f"{count} builtin prompts asked for, {len(texts)} exist")
        return [Req(t, max_output) for t in texts[:count]]
    from .datasets import sample_requests

    out = []
    for text, p, a in sample_requests(trace, lambda ts: [len(tokenizer.encode(t)) for t in ts], count):
        if p > max_prompt:
            text = tokenizer.decode(tokenizer.encode(text)[:max_prompt])
        out.append(Req(text, min(a, max_output)))
    if len(out) < count:
        raise ValueError(f"{trace} gave {len(out)} requests that pass the length filter, {count} asked for")
    return out


def shared_system_prompt(tokenizer, tokens: int = SYSTEM_PROMPT_TOKENS) -> str:
    """An agent-like system prompt of about `tokens` tokens: instructions, then worked examples."""
    from .prompts import builtin_texts

    head = (
        "You are a careful coding agent. Read the task, plan, then answer. Tools: search(query), "
        "read_file(path), run(cmd). Follow these examples.\n"
    )
    text, i, examples = head, 0, builtin_texts()
    while len(tokenizer.encode(text)) < tokens:
        text += f"Example {i}: {examples[i % len(examples)]}\n"
        i += 1
    return tokenizer.decode(tokenizer.encode(text)[:tokens])


def eos_ids(tokenizer) -> list[int]:
    """Every token id mlx_lm.server stops on (its tokenizer wrapper's EOS set)."""
    return sorted(int(t) for t in (getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id]))


# -- servers ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """A server in a process of its own. Its stderr goes to an unlinked temporary file, never to a
    pipe: nobody reads a pipe while the server runs, and a server that logs past the pipe's 64 KiB
    (vllm-mlx logs a line per open request every 5 s) would block in its next write and stall."""

    def __init__(self, name: str, cmd: list[str], port: int, timeout: float = 600, cwd: str | None = None):
        import tempfile

        import httpx

        self.name, self.cmd, self.url = name, cmd, f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, cwd=cwd)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{name} did not start in {timeout} s")

    def log_tail(self, chars: int = 2000) -> str:
        """The end of what the server wrote to stderr so far."""
        self.log.seek(0, os.SEEK_END)
        self.log.seek(max(0, self.log.tell() - 4 * chars))
        return self.log.read().decode(errors="replace")[-chars:]

    def rss_mb(self) -> float:
        import psutil

        try:
            return psutil.Process(self.proc.pid).memory_info().rss / 1e6
        except psutil.Error:
            return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def vllm_mlx_python() -> str:
    """The Python of vllm-mlx's own venv (it needs mlx-lm < 0.32, torch and gradio, so it cannot
    share this one): `MLXPAGED_VLLM_MLX` names that Python or the venv's `vllm-mlx` script, else
    the `vllm-mlx` on PATH. `ValueError` in one line when there is none."""
    import shutil

    where = os.environ.get("MLXPAGED_VLLM_MLX") or shutil.which("vllm-mlx")
    if not where or not Path(where).exists():
        raise ValueError(
            "vllm-mlx is not installed: make a venv of its own (python -m venv V && V/bin/pip install "
            'vllm-mlx "mlx[cpu]") and set MLXPAGED_VLLM_MLX=V/bin/python'
        )
    first = Path(where).read_bytes()[:200].split(b"\n")[0]
    return first[2:].decode().strip() if first.startswith(b"#!") else where


def server_command(name: str, model_path: str, port: int, extra: list[str]) -> list[str]:
    if name == "vllm_mlx":
        # Its own venv's Python, with the same system OpenBLAS loaded first, then its CLI as
        # `vllm-mlx serve` would run it: continuous batching, the paged cache, the prefix cache.
        from .._blas import loaded as blas

        boot = (
            "import ctypes, sys; "
            + (f"ctypes.CDLL({blas!r}, mode=ctypes.RTLD_GLOBAL); " if blas else "")
            + "sys.argv[0] = 'vllm-mlx'; from vllm_mlx.cli import main; sys.exit(main())"
        )
        return [
            vllm_mlx_python(),
            "-c",
            boot,
            "serve",
            model_path,
            "--port",
            str(port),
            "--continuous-batching",
            "--use-paged-cache",
            "--enable-prefix-cache",
            # its default aborts a request after 300 s (first turns of four conversations at once
            # take longer on this CPU); the harness's client and the other servers have no limit
            "--timeout",
            "86400",
            *extra,
        ]
    if name == "mlxpaged":
        return [
            sys.executable,
            "-m",
            "mlxpaged.cli",
            "serve",
            "--model",
            model_path,
            "--port",
            str(port),
            "--log-level",
            "warning",
            *extra,
        ]
    # The same BLAS as mlxpaged: load the system OpenBLAS before MLX, then run mlx_lm.server as `-m` would.
    boot = (
        "import mlxpaged._blas as b, runpy; b.use_system_blas(); runpy.run_module('mlx_lm.server', run_name='__main__')"
    )
    return [sys.executable, "-c", boot, "--model", model_path, "--port", str(port), "--log-level", "WARNING", *extra]


def server_cwd(name: str) -> str | None:
    """Where a server starts: mlxpaged's in the folder holding this harness's own package, since
    `python -m mlxpaged.cli` imports the package of its working folder first, and a harness run
    from another checkout (a worktree) would otherwise time that checkout's code under this
    one's provenance (`report.git_state`)."""
    from .report import PACKAGE_ROOT

    return str(PACKAGE_ROOT) if name == "mlxpaged" else None


def start_server(name: str, model_path: str, extra: list[str]) -> ServerProc:
    port = free_port()
    return ServerProc(name, server_command(name, model_path, port, extra), port, cwd=server_cwd(name))


# -- one run: Poisson arrivals at `rate` -----------------------------------------------------------
def request_body(server: str, model: str, req: Req, n: int, eos: list[int]) -> dict:
    """The chat request `server` gets for `req` of a load with n samples per request (mlx_lm.server
    gets n copies of it, without `n`); both sample at the same temperature."""
    messages = req.messages or ([{"role": "system", "content": req.system}] if req.system else []) + [
        {"role": "user", "content": req.prompt}
    ]
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": req.max_tokens,
        "temperature": 0.0 if n == 1 else 0.8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.tools:
        body["tools"] = req.tools
    if server == "mlxpaged":
        body["ignore_eos"] = True
        if n > 1:
            body["n"] = n
    else:  # mlx_lm.server and vllm-mlx have no ignore_eos: an EOS token can never be drawn at -100
        body["logit_bias"] = {str(t): -100.0 for t in eos}
    return body


async def stream_one(client, url: str, body: dict, on_text=None) -> Part:
    """Stream one chat request; `on_text(str)` (if given) gets each content delta."""
    import httpx

    part = Part(t0=time.perf_counter())
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                part.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                part.end = time.perf_counter()
                return part
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("error"):
                    part.error = str(obj["error"])[:200]
                if obj.get("usage"):
                    part.completion_tokens = obj["usage"]["completion_tokens"]
                    part.prompt_tokens = obj["usage"].get("prompt_tokens") or 0
                    part.cached_tokens = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if on_text is not None:
                    for c in obj.get("choices", []):
                        on_text((c.get("delta") or {}).get("content") or "")
                if any((c.get("delta") or {}).get("content") for c in obj.get("choices", [])):
                    part.last = time.perf_counter()
                    part.first = part.first or part.last
    except httpx.HTTPError as e:
        part.error = f"{type(e).__name__}: {e}"[:200]
    part.end = time.perf_counter()
    part.ok = not part.error and part.first is not None
    return part


def record(res: RunResult, i: int, req: Req, parts: list[Part], n: int) -> None:
    """Fold the parts of logical request `i` (one for mlxpaged, n for mlx_lm's fan-out) into `res`."""
    tokens = sum(p.completion_tokens for p in parts)
    if not all(p.ok for p in parts):
        res.failed += 1
        res.errors += [p.error or "no token" for p in parts if not p.ok]
        return
    res.output_tokens[i] = tokens
    if tokens != n * req.max_tokens:  # unmatched stopping would bias the comparison: fail loudly
        res.failed += 1
        res.length_mismatches += 1
        res.errors.append(f"request {i}: {tokens} tokens, expected {n * req.max_tokens}")
        return
    t0 = min(p.t0 for p in parts)
    first, last, end = min(p.first for p in parts), max(p.last for p in parts), max(p.end for p in parts)
    res.completed += 1
    res.cached_tokens += sum(p.cached_tokens for p in parts)  # mlx_lm's fan-out: each of its requests prefills
    res.ttft.append(first - t0)
    if req.max_tokens > 1:
        res.itl.append((last - first) / (req.max_tokens - 1))
    res.norm_latency.append((end - t0) / req.max_tokens)


async def run_load(
    server: ServerProc,
    model: str,
    reqs: list[Req],
    rate: float,
    n: int,
    load: str,
    eos: list[int],
    seed: int = 0,
    repeat: int = 0,
) -> RunResult:
    """Send `reqs` at Poisson arrivals of `rate`/s (arrival times seeded by `seed`, the same for
    both servers); an n-sample request goes to a peer as n requests at the same instant."""
    import httpx

    res = RunResult(server.name, load, rate, repeat, n, output_tokens=[None] * len(reqs))
    rng = random.Random(seed)
    fan = n if server.name != "mlxpaged" else 1  # neither peer has `n` (vllm-mlx 0.6's request model lacks it)
    stop = asyncio.Event()

    async def watch_rss():
        while not stop.is_set():
            res.peak_rss_mb = max(res.peak_rss_mb, server.rss_mb())
            await asyncio.sleep(0.05)

    async def one(i: int, req: Req):
        body = request_body(server.name, model, req, n, eos)
        parts = await asyncio.gather(*[stream_one(client, server.url, body) for _ in range(fan)])
        record(res, i, req, list(parts), n)

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        watcher = asyncio.create_task(watch_rss())
        t0 = time.perf_counter()
        tasks = []
        for i, req in enumerate(reqs):
            tasks.append(asyncio.create_task(one(i, req)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        res.duration_s = time.perf_counter() - t0
        stop.set()
        await watcher
    return res


def measure(
    name: str,
    path: str,
    extra: list[str],
    warm: list[Req],
    reqs: list[Req],
    rate: float,
    n: int,
    load: str,
    eos: list[int],
    seed: int,
    repeat: int,
    settle_s: float = 3.0,
) -> RunResult:
    """One fresh server: warm it, read its idle RSS, run the load, read its RSS `settle_s` after."""
    server = start_server(name, path, extra)
    try:
        asyncio.run(run_load(server, path, warm, 8.0, n, load, eos))  # warm-up, not recorded
        time.sleep(settle_s)
        idle = server.rss_mb()
        res = asyncio.run(run_load(server, path, reqs, rate, n, load, eos, seed=seed, repeat=repeat))
        time.sleep(settle_s)
        res.idle_rss_mb, res.after_rss_mb = idle, server.rss_mb()
        res.peak_rss_mb = max(res.peak_rss_mb, idle)
        return res
    finally:
        server.stop()


# -- the sweep -------------------------------------------------------------------------------------
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
        weights.update(
            {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in mx.load(str(f)).items()}
        )
    mx.save_safetensors(str(dst / "model.tmp.safetensors"), weights)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, dst / f.name)
    cfg["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    (dst / "model.tmp.safetensors").rename(dst / "model.safetensors")
    return str(dst)


def server_order(servers, case: int, repeat: int) -> list[str]:
    """The order the servers run in: who goes first turns with every (load, rate) case and repeat."""
    i = (case + repeat) % len(servers)
    return list(servers[i:]) + list(servers[:i])


def sweep(
    path: str,
    rates: list[float],
    loads: list[str],
    num_requests: int,
    max_prompt: int,
    max_output: int,
    repeats: int,
    mlxpaged_args: list[str],
    trace: str = "sharegpt",
    bound: float = 1.0,
    extend: int = 0,
    settle_s: float = 3.0,
    progress=print,
    servers=("mlxpaged", "mlx_lm"),
) -> list[dict]:
    """Every (load, rate, repeat) on a fresh server of each kind in `servers`, rotating which goes first.

    After the listed rates, up to `extend` more rates (each double the last) are swept for a
    load while either server still meets `bound` at the highest rate (sweep until both fail).
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from .http_stats import meets

    tok = load_tokenizer(Path(path))
    eos = eos_ids(tok)
    every = build_requests(tok, trace, num_requests + WARMUP, max_prompt, max_output)
    warm, reqs = every[:WARMUP], every[WARMUP:]
    system = shared_system_prompt(tok) if "system" in loads else None
    rows, case = [], 0
    for load in loads:
        with_sys = lambda rs: [Req(r.prompt, r.max_tokens, system) for r in rs] if load == "system" else rs  # noqa: E731
        todo, extra_left = sorted(rates), extend
        while todo:
            rate = todo.pop(0)
            for rep in range(repeats):
                order = server_order(servers, case, rep)
                a = order[0]
                for name in order:
                    # vllm-mlx's flags are fixed in `server_command`
                    args = {"mlxpaged": mlxpaged_args, "mlx_lm": PEER_ARGS.get(load, [])}.get(name, [])
                    res = measure(
                        name,
                        path,
                        args,
                        with_sys(warm),
                        with_sys(reqs),
                        rate,
                        LOADS[load],
                        load,
                        eos,
                        seed=rep,
                        repeat=rep,
                        settle_s=settle_s,
                    )
                    rows.append({**res.summary(), "first": a, "server_args": args})
                    progress(_line(rows[-1]))
            case += 1
            if not todo and extra_left > 0:
                here = [r for r in rows if r["load"] == load and r["rate"] == rate]
                if any(meets(here, s, bound) for s in servers):
                    todo.append(rate * 2)
                    extra_left -= 1
    return rows


def _line(r: dict) -> str:
    f = lambda x, spec: "   n/a" if x is None else format(x, spec)  # noqa: E731
    return (
        f"{r['server']:>8} {r['load']:>8} rate {r['rate']:5.2f} rep {r['repeat']}: {r['req_per_s']:5.2f} req/s, "
        f"TTFT {f(r['ttft_ms_median'], '7.0f')} ms, ITL {f(r['itl_ms_median'], '6.1f')} ms, norm mean/median "
        f"{f(r['norm_latency_mean'], '6.3f')}/{f(r['norm_latency_median'], '6.3f')} s/tok, RSS idle/peak/after "
        f"{r['idle_rss_mb']:5.0f}/{r['peak_rss_mb']:5.0f}/{r['after_rss_mb']:5.0f} MB, cached "
        f"{r['cached_prompt_tokens']}, failed {r['failed']}"
    )


def add_command(bench_group, with_common, write_plot) -> None:
    """Register `mlxpaged bench serve` on the bench group."""
    import click

    @bench_group.command("serve")
    @with_common
    @click.option("--rates", default="0.25,0.5,1,2,4", show_default=True, help="Request rates (req/s) to sweep.")
    @click.option(
        "--extend",
        default=3,
        show_default=True,
        help="Extra rates (each double the last) while either server still meets the bound.",
    )
    @click.option("--num-requests", default=16, show_default=True, help="Requests per run.")
    @click.option("--max-prompt", default=256, show_default=True, help="Cap on the traced prompt length (tokens).")
    @click.option("--max-output", default=32, show_default=True, help="Cap on the traced output length (tokens).")
    @click.option(
        "--loads",
        default="sharegpt,system,n4",
        show_default=True,
        help=f"sharegpt, system ({SYSTEM_PROMPT_TOKENS}-token shared system prompt), n4 (n=4 each).",
    )
    @click.option(
        "--trace", default="sharegpt", type=click.Choice(["sharegpt", "alpaca", "builtin"]), show_default=True
    )
    @click.option(
        "--repeats", default=3, show_default=True, help="Runs of each case, alternating which server goes first."
    )
    @click.option(
        "--bound",
        default=1.0,
        show_default=True,
        help="Mean normalized-latency bound (s/token) for the sustainable rate.",
    )
    @click.option(
        "--settle", default=3.0, show_default=True, help="Seconds before reading idle RSS and after the load."
    )
    @click.option("--num-blocks", default=None, type=int, help="mlxpaged's KV pool (default: grown on demand).")
    @click.option(
        "--servers",
        default="mlxpaged,mlx_lm",
        show_default=True,
        help="Comma-separated, of mlxpaged,mlx_lm,vllm_mlx (vllm_mlx: MLXPAGED_VLLM_MLX names its venv's Python).",
    )
    @click.option("--allow-dirty", is_flag=True, help="Run from a tree with uncommitted changes (the result says so).")
    def serve_cmd(
        model,
        tiny,
        dtype,
        out_dir,
        plot,
        rates,
        extend,
        num_requests,
        max_prompt,
        max_output,
        loads,
        trace,
        repeats,
        bound,
        settle,
        num_blocks,
        servers,
        allow_dirty,
    ):
        """mlxpaged serve vs mlx_lm.server over HTTP: Poisson arrivals, TTFT, ITL, normalized latency, RSS."""
        from .http_stats import report, write_figure
        from .report import git_state, write_result

        git = git_state()
        if git["dirty"] and not allow_dirty:
            click.echo(
                "error: the tree has uncommitted changes; commit them (a result names its commit) "
                "or pass --allow-dirty",
                err=True,
            )
            sys.exit(1)
        try:
            rate_list = [float(r) for r in rates.split(",") if r]
        except ValueError:
            click.echo(f"error: --rates must be numbers separated by commas, got {rates!r}", err=True)
            sys.exit(1)
        load_list = [x for x in loads.split(",") if x]
        bad = set(load_list) - set(LOADS)
        if bad or not rate_list or min(rate_list) <= 0:
            click.echo(
                f"error: unknown load(s) {sorted(bad)}; choose from {sorted(LOADS)}"
                if bad
                else "error: --rates needs at least one positive rate",
                err=True,
            )
            sys.exit(1)
        server_list = tuple(x for x in servers.split(",") if x)
        if "mlxpaged" not in server_list or set(server_list) - {"mlxpaged", "mlx_lm", "vllm_mlx"}:
            click.echo(f"error: --servers takes mlxpaged and any of mlx_lm,vllm_mlx, got {servers!r}", err=True)
            sys.exit(1)
        if "vllm_mlx" in server_list:
            try:
                vllm_mlx_python()
            except ValueError as e:
                click.echo(f"error: {e}", err=True)
                sys.exit(1)
        path = float32_copy(model_path(model, tiny)) if dtype in ("auto", "float32") else model_path(model, tiny)
        extra = ["--dtype", dtype] + (["--num-blocks", str(num_blocks)] if num_blocks else [])
        rows = sweep(
            path,
            rate_list,
            load_list,
            num_requests,
            max_prompt,
            max_output,
            repeats,
            extra,
            trace,
            bound,
            extend,
            settle,
            progress=lambda s: click.echo(s, err=True),
            servers=server_list,
        )
        summary = report(rows, load_list, bound, echo=click.echo)
        out = write_result(
            out_dir,
            "serve",
            Path(path).name,
            {
                "rates": rate_list,
                "extend": extend,
                "num_requests": num_requests,
                "max_prompt": max_prompt,
                "max_output": max_output,
                "trace": trace,
                "repeats": repeats,
                "warmup_requests": WARMUP,
                "system_prompt_tokens": SYSTEM_PROMPT_TOKENS if "system" in load_list else None,
                "prompt_text": f"{trace} text, cut to max_prompt tokens",
                "bound_s_per_token": bound,
                "mlxpaged_args": extra,
                "servers": list(server_list),
                "peer_args": PEER_ARGS,
                "fairness": [
                    "fresh server per (load, rate, repeat, server)",
                    "equal output tokens per request asserted",
                    "no seed to either server",
                    "first server alternates per (load, rate) and repeat",
                ],
                "git_at_start": git,
                "rows": rows,
                **summary,
            },
        )
        click.echo(f"results: {out}")
        if plot:
            try:
                click.echo(f"plot: {write_figure(out.with_suffix('.png'), summary['per_rate'], load_list, bound)}")
            except ImportError:
                click.echo("plot skipped: pip install 'mlxpaged[plot]' for matplotlib", err=True)
