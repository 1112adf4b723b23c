"""Time to first token of `bench_http.py`'s agent load, request by request, on one fresh server:
a cold request (the 2,000-token system prompt computed), two alone over the cached prefix, four
arriving together and a fifth 4 s later, and one prompt without the system prompt. It says what a
sweep's median hides: how long one prefill over a long cached prefix takes, and how it grows
when several arrive at once. The same requests as the sweep (ShareGPT user turns cut to 256
tokens, 32 output tokens, the float32 copy of the offline 0.5B); one run, no repeats: a
diagnosis, not a benchmark.

    python scripts/probe_agent_ttft.py --server mlxpaged
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import mlxpaged  # noqa: F401  (first: OpenBLAS must load before MLX, mlxpaged/_blas.py)

# isort: split
from mlxpaged.bench import http


async def probe(srv, name: str, path: str, tok, system: str, reqs: list) -> None:
    import httpx

    eos = http.eos_ids(tok)
    agent = [http.Req(r.prompt, r.max_tokens, system) for r in reqs]

    async def one(client, req, label: str, t_start: float):
        p = await http.stream_one(client, srv.url, http.request_body(name, path, req, 1, eos))
        if not p.ok:
            print(f"{label:>16}: failed: {p.error}")
            return
        print(
            f"{label:>16}: user turn {len(tok.encode(req.prompt)):4d} tokens, sent +{p.t0 - t_start:4.1f} s, "
            f"TTFT {p.first - p.t0:6.2f} s, total {p.end - p.t0:6.2f} s, cached {p.cached_tokens}, "
            f"{p.completion_tokens} tokens",
            flush=True,
        )

    async with httpx.AsyncClient(timeout=None) as c:
        await one(c, agent[0], "cold", time.perf_counter())
        for i in (1, 2):
            await one(c, agent[i], f"alone {i}", time.perf_counter())
        t = time.perf_counter()
        tasks = [asyncio.create_task(one(c, agent[3 + k], f"together {k}", t)) for k in range(4)]
        await asyncio.sleep(4)
        tasks.append(asyncio.create_task(one(c, agent[7], "4 s later", t)))
        await asyncio.gather(*tasks)
        await one(c, reqs[8], "no system prompt", time.perf_counter())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", choices=("mlxpaged", "mlx_lm"), default="mlxpaged")
    a = ap.parse_args()
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    path = http.float32_copy(http.model_path(None, False))
    tok = load_tokenizer(Path(path))
    reqs = http.build_requests(tok, "sharegpt", 9, 256, 32)
    reqs = [http.Req(r.prompt, 32) for r in reqs]  # 32 tokens each, as the sweep's longest answers
    args = ["--dtype", "float32"] if a.server == "mlxpaged" else http.PEER_ARGS["system"]
    srv = http.start_server(a.server, path, args)
    try:
        asyncio.run(probe(srv, a.server, path, tok, http.shared_system_prompt(tok), reqs))
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
