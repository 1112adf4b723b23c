"""Coding-agent conversations over the OpenAI chat API with `tools`: K concurrent
conversations of T turns, each turn appending the previous answer, a tool call, a tool result of
real text (stdlib and mlx_lm sources, read by path with a fixed seed) and a short instruction.

Reuses the HTTP harness (`http.py`): fresh servers per case, `server_order` alternation, the
equal-output-length rule (`request_body`: `ignore_eos` / EOS `logit_bias`), the RSS sampler's
approach, `write_result` provenance. The restart variant stops the server after turn T/2 and
starts it again (mlxpaged with `--prefix-cache-dir`; mlx_lm.server recomputes).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from . import http

SERVERS = ("mlxpaged", "mlx_lm", "vllm_mlx")  # vllm_mlx from its own venv (http.vllm_mlx_python)
DEFAULT_SERVERS = ("mlxpaged", "mlx_lm")
STAGGER_S = 0.5  # conversation k starts k * STAGGER_S after the first
ANSWER_HEAD = 40  # characters of each answer kept in the records


# mlx_lm.server's prompt cache must hold every conversation's growing prefix (one entry each,
# plus room for the LRU's other kinds): 4 * K + 8 entries.
def peer_args(k: int) -> list[str]:
    return ["--prompt-cache-size", str(4 * k + 8)]


def _tool(name, desc, props, required):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


_S = {"type": "string"}
_I = {"type": "integer"}
_B = {"type": "boolean"}
TOOLS = [
    _tool(
        "read_file",
        "Read a file of the repository. Returns its text with line numbers. Use offset and limit "
        "for large files; never read binary files.",
        {
            "path": {**_S, "description": "Path relative to the repository root."},
            "offset": {**_I, "description": "First line (1-based)."},
            "limit": {**_I, "description": "Most lines to return (default 400)."},
        },
        ["path"],
    ),
    _tool(
        "write_file",
        "Create or overwrite a file with the given content. Parent folders are created. Prefer "
        "apply_patch for edits of existing files.",
        {"path": _S, "content": {**_S, "description": "The whole new content."}},
        ["path", "content"],
    ),
    _tool(
        "apply_patch",
        "Apply a unified diff to the working tree. Fails without change if any hunk does not "
        "apply; then read the file again and retry.",
        {"patch": {**_S, "description": "A unified diff with --- and +++ headers and @@ hunks."}},
        ["patch"],
    ),
    _tool(
        "run_shell",
        "Run a shell command in the repository root and return its exit status, stdout and "
        "stderr (each cut to 10,000 characters). Commands time out after the given seconds.",
        {
            "command": _S,
            "timeout_s": {**_I, "description": "Seconds before the command is killed."},
            "cwd": {**_S, "description": "Folder to run in, relative to the root."},
        },
        ["command"],
    ),
    _tool(
        "grep",
        "Search file contents with a regular expression (ripgrep syntax). Returns matching lines "
        "with file and line number.",
        {
            "pattern": _S,
            "path": {**_S, "description": "Folder or file to search."},
            "glob": {**_S, "description": "Only files matching this glob, e.g. '*.py'."},
            "ignore_case": _B,
            "context": {**_I, "description": "Lines of context around each match."},
        },
        ["pattern"],
    ),
    _tool(
        "list_dir",
        "List a folder's entries with their kinds and sizes.",
        {"path": _S, "recursive": _B, "max_depth": _I},
        ["path"],
    ),
    _tool("find_files", "Find files whose path matches a glob.", {"glob": _S, "path": _S}, ["glob"]),
    _tool(
        "run_tests",
        "Run the test suite or a part of it with pytest and return the summary and failures.",
        {
            "paths": {"type": "array", "items": _S, "description": "Test files or node ids."},
            "keyword": {**_S, "description": "pytest -k expression."},
            "fail_fast": _B,
        },
        [],
    ),
    _tool(
        "git_diff",
        "Show the working tree's changes against HEAD or a given revision.",
        {"revision": _S, "paths": {"type": "array", "items": _S}, "stat": _B},
        [],
    ),
    _tool("git_log", "Show recent commits with their messages.", {"max_count": _I, "path": _S}, []),
    _tool(
        "git_commit",
        "Stage the given paths (all changes when empty) and commit them.",
        {"message": _S, "paths": {"type": "array", "items": _S}},
        ["message"],
    ),
    _tool(
        "python_eval",
        "Evaluate a short Python snippet in a fresh interpreter and return what it prints.",
        {"code": _S, "timeout_s": _I},
        ["code"],
    ),
    _tool(
        "search_symbols",
        "Find definitions of a function, class or variable by name across the code base.",
        {"name": _S, "kind": {"type": "string", "enum": ["function", "class", "variable", "any"]}},
        ["name"],
    ),
    _tool(
        "read_docs",
        "Read the documentation of an installed Python package's module or function.",
        {"target": {**_S, "description": "Dotted name, e.g. json.dumps."}},
        ["target"],
    ),
    _tool(
        "web_fetch",
        "Fetch a URL and return its text (no JavaScript). Use only for documentation.",
        {"url": _S, "max_chars": _I},
        ["url"],
    ),
    _tool(
        "ask_user",
        "Ask the user a question when the task is ambiguous; use sparingly.",
        {"question": _S, "options": {"type": "array", "items": _S}},
        ["question"],
    ),
]
SYSTEM = (
    "You are a coding agent working in a Python repository. You can call the tools listed. Work in small "
    "steps: read the relevant code before changing it, make the smallest change that solves the task, run "
    "the tests that cover it, and report what you did. Rules:\n"
    "1. Never guess a file's content: read it first. Quote line numbers when you refer to code.\n"
    "2. Prefer apply_patch over write_file for an existing file; keep the file's style.\n"
    "3. Run commands that finish quickly; never start servers or watchers that do not exit.\n"
    "4. When a test fails, read its output fully, find the cause, and fix the cause, not the test.\n"
    "5. Do not add dependencies. Do not touch files unrelated to the task.\n"
    "6. Explain your plan in one or two sentences before the first tool call, then act.\n"
    "7. When done, summarize the change, the tests you ran and their results, and anything left open.\n"
    "8. If the task cannot be done as asked, say why and propose the nearest thing that can.\n"
    "\nRepository conventions:\n"
    "- The code is formatted with ruff (line length 120) and checked with ruff check; imports are sorted, "
    "standard library first, then third-party packages, then the project's own modules.\n"
    "- Tests live in tests/ and are named test_<module>.py; each test asserts one behaviour and names it. A "
    "test must be able to fail: never assert only that a call returned.\n"
    "- Public functions have a docstring whose first line says what the function returns or does, in the "
    "imperative mood. Comments say why, not what.\n"
    "- Errors raised to the user name the bad input and the accepted values. Never swallow an exception "
    "without logging it, and never catch a bare Exception where a narrower class is known.\n"
    "- Keep functions short; when one grows past fifty lines, look for the piece that has its own name.\n"
    "- Configuration is read once at start-up into a frozen dataclass and passed down explicitly; no module "
    "reads environment variables at import time.\n"
    "- Commit messages start with the area touched, then a colon and a sentence in the present tense.\n"
    "\nHow to answer:\n"
    "- Be brief. Show code only for the lines you change, as a unified diff, unless asked for the whole file.\n"
    "- When you call a tool, give exactly one call per step and wait for its result before the next.\n"
    "- When a tool result is long, quote only the lines that matter and give their line numbers.\n"
    "- If you are unsure of a fact about the code base, read the code or run a command to check it; say "
    "what you checked.\n"
    "- Never invent file paths, function names or command output. When a search finds nothing, say so.\n"
    "- Before finishing, run the tests of the area you touched and the linter on the files you changed, and "
    "report the exact commands and their results.\n"
    "- Keep the user informed of anything surprising you noticed but left alone, such as unrelated failing "
    "tests, dead code or suspicious behaviour, in a short list at the end of your answer.\n"
)
INSTRUCTIONS = [
    "Look at this and tell me what the function does; then find where it is called.",
    "There is a failing test about this. Find the likely bug and propose a patch.",
    "Refactor this so it is easier to test; keep the behaviour.",
    "Add a docstring and type hints where they are missing.",
    "Run the tests for this module and summarize the result.",
    "Is there an edge case this code gets wrong? Show one input.",
]


def corpus_files() -> list[Path]:
    """Fixed source files of installed packages: the stdlib's and mlx_lm's `.py` files, sorted."""
    import json as _json

    import mlx_lm

    roots = [Path(_json.__file__).parents[1], Path(mlx_lm.__file__).parent]
    out = []
    for r in roots:
        out += sorted(p for p in r.glob("*.py") if p.stat().st_size > 2000) + sorted(
            p for p in (r / "models").glob("*.py") if p.is_file() and p.stat().st_size > 2000
        )
    return out


def tool_results(tokenizer, count: int, seed: int, lo: int = 100, hi: int = 600) -> list[tuple[str, str]]:
    """`count` (path, text) of lo..hi tokens each, the same for a seed: a window of a corpus file."""
    rng, files = random.Random(seed), corpus_files()
    out = []
    for _ in range(count):
        f = files[rng.randrange(len(files))]
        ids = tokenizer.encode(f.read_text(errors="replace"))
        n = rng.randint(lo, hi)
        start = rng.randrange(max(1, len(ids) - n))
        out.append((f.name, tokenizer.decode(ids[start : start + n])))
    return out


def turn_messages(conv: int, turn: int, history: list, result: tuple[str, str]) -> list:
    """The messages appended for `turn`: an assistant tool call and its result, then an instruction."""
    path, text = result
    call_id = f"call_{conv}_{turn}"
    return history + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "read_file", "arguments": json.dumps({"path": path})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": text},
        {"role": "user", "content": INSTRUCTIONS[(conv + turn) % len(INSTRUCTIONS)]},
    ]


async def _conversation(
    server_box, model, k, turns, results, max_tokens, eos, rows, t_start, restart_at, barrier, system, tools
):
    import httpx

    history = [{"role": "system", "content": system}, {"role": "user", "content": "Start with the file below."}]
    await asyncio.sleep(k * STAGGER_S)
    for t in range(turns):
        if restart_at is not None and t == restart_at:
            await barrier(k)
        history = turn_messages(k, t, history, results[k * turns + t])
        req = http.Req("", max_tokens, messages=history, tools=tools)
        srv = server_box["server"]
        body = http.request_body(srv.name, model, req, 1, eos)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
            part, text = await _stream_text(client, srv.url, body)
        rows.append(
            {
                "conv": k,
                "turn": t,
                "ok": part.ok,
                "error": part.error,
                "sent_s": part.t0 - t_start,
                "ttft_s": (part.first - part.t0) if part.ok else None,
                # how the answer began: a server may hold back text that may still become a tool
                # call, so what an answer starts with says when its first text can come
                "answer_head": text[:ANSWER_HEAD],
                "prompt_tokens": part.prompt_tokens,
                "cached_tokens": part.cached_tokens,
                "completion_tokens": part.completion_tokens,
                "server_generation": server_box["generation"],
                "end_s": part.end - t_start,
            }
        )
        history = history + [{"role": "assistant", "content": text}]


async def _stream_text(client, url, body):
    """http.stream_one plus the answer's text (the next turn appends it)."""
    text: list[str] = []
    part = await http.stream_one(client, url, body, on_text=text.append)
    return part, "".join(text)


def replay(name, path, extra, k, turns, max_tokens, eos, results, restart: bool, system=SYSTEM, tools=TOOLS) -> dict:
    """One replay of K conversations on a fresh server; with `restart`, the server is stopped once
    every conversation has finished turn T/2 and started again before the second half."""
    box = {"server": http.start_server(name, path, extra), "generation": 0}
    rows: list = []
    peak = [box["server"].rss_mb()]
    restart_at = turns // 2 if restart else None
    waiting: set = set()
    ready = None

    async def main():
        nonlocal ready
        ready = asyncio.Event()
        stop = asyncio.Event()

        async def barrier(conv):
            waiting.add(conv)
            if len(waiting) == k:
                box["server"].stop()
                box["server"] = await asyncio.to_thread(http.start_server, name, path, extra)
                box["generation"] += 1
                ready.set()
            await ready.wait()

        async def watch():
            while not stop.is_set():
                peak[0] = max(peak[0], box["server"].rss_mb())
                await asyncio.sleep(0.05)

        w = asyncio.create_task(watch())
        t0 = time.perf_counter()
        await asyncio.gather(
            *[
                _conversation(
                    box, path, c, turns, results, max_tokens, eos, rows, t0, restart_at, barrier, system, tools
                )
                for c in range(k)
            ]
        )
        wall = time.perf_counter() - t0
        stop.set()
        await w
        return wall

    try:
        wall = asyncio.run(main())
        final = box["server"].rss_mb()
    finally:
        box["server"].stop()
    rows.sort(key=lambda r: (r["conv"], r["turn"]))
    return summarize(name, k, turns, rows, wall, peak[0], final, restart_at)


def _q(xs, p):
    if not xs:
        return None
    return statistics.quantiles(xs, n=10)[p - 1] if len(xs) >= 2 else xs[0]


def summarize(name, k, turns, rows, wall, peak, final, restart_at) -> dict:
    ok = [r for r in rows if r["ok"]]
    per_turn = []
    for t in range(turns):
        xs = [r["ttft_s"] * 1e3 for r in ok if r["turn"] == t]
        per_turn.append({"turn": t, "ttft_ms_median": statistics.median(xs) if xs else None, "ttft_ms_p90": _q(xs, 9)})
    later = [r["ttft_s"] * 1e3 for r in ok if r["turn"] > 0]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    res = {
        "server": name,
        "k": k,
        "turns": turns,
        "restart_at_turn": restart_at,
        "failed": len(rows) - len(ok),
        "errors": [r["error"] for r in rows if not r["ok"]][:5],
        "ttft_per_turn": per_turn,
        "ttft_ms_first_turn_median": per_turn[0]["ttft_ms_median"],
        "ttft_ms_later_median": statistics.median(later) if later else None,
        "ttft_ms_later_p90": _q(later, 9),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_prompt_tokens": prompt - cached,
        "cached_tokens_source": "usage.prompt_tokens_details.cached_tokens",
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / wall if wall else 0.0,
        "peak_rss_mb": peak,
        "final_rss_mb": final,
        "turns_detail": rows,
    }
    if restart_at is not None:
        first_after = [r["ttft_s"] * 1e3 for r in ok if r["turn"] == restart_at]
        res["ttft_ms_after_restart_median"] = statistics.median(first_after) if first_after else None
    return res


def server_extra(name: str, k: int, restart: bool, cache_dir: str | None, mlxpaged_args: list[str]) -> list[str]:
    """Each server's flags: mlxpaged's disk tier and vllm-mlx's SSD cache for the restart variant
    (mlx_lm.server keeps nothing on disk); mlx_lm.server's prompt cache sized for every conversation."""
    if name == "mlxpaged":
        return mlxpaged_args + (["--prefix-cache-dir", cache_dir] if restart and cache_dir else [])
    if name == "vllm_mlx":  # its prefix cache is sized by memory (its default); on disk for the restart
        return ["--ssd-cache-dir", cache_dir] if restart and cache_dir else []
    return peer_args(k)


def run(
    path,
    ks,
    turns,
    repeats,
    max_tokens,
    seed=0,
    restart=False,
    servers=DEFAULT_SERVERS,
    mlxpaged_args=(),
    progress=print,
    system=SYSTEM,
    tools=TOOLS,
    result_tokens=(100, 600),
    *,
    restart_only=False,
) -> dict:
    """Every (K, variant, repeat) on a fresh server of each kind, alternating which goes first."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(Path(path))
    eos = http.eos_ids(tok)
    rows, case = [], 0
    for k in ks:
        results = tool_results(tok, k * turns, seed, *result_tokens)
        variants = [True] if restart_only else [False, True] if restart else [False]
        for rs in variants:
            for rep in range(repeats):
                order = http.server_order(servers, case, 0)  # each (K, variant, repeat) is a case
                a = order[0]
                for name in order:
                    cache_dir = tempfile.mkdtemp(prefix="mlxpaged-agents-disk-") if rs else None
                    extra = server_extra(name, k, rs, cache_dir, list(mlxpaged_args))
                    r = replay(name, path, extra, k, turns, max_tokens, eos, results, rs, system, tools)
                    r.update({"repeat": rep, "first": a, "restart": rs, "server_args": extra})
                    rows.append(r)
                    progress(
                        f"{name:>8} K={k} T={turns} restart={rs} rep {rep}: wall {r['wall_s']:.1f} s, "
                        f"TTFT later {r['ttft_ms_later_median']} ms, cached {r['cached_tokens']}/{r['prompt_tokens']}, "
                        f"failed {r['failed']}"
                    )
                case += 1
    return {
        "rows": rows,
        "ratios": ratios(rows),
        "system_prompt_tokens": len(
            tok.apply_chat_template([{"role": "system", "content": system}], tools=tools, tokenize=True)
        ),
        "tools": len(tools),
        "result_tokens": list(result_tokens),
        "max_tokens": max_tokens,
        "stagger_s": STAGGER_S,
        "peer_args_note": "mlx_lm.server runs with --prompt-cache-size 4*K+8, enough for every conversation; "
        "vllm-mlx with --continuous-batching --use-paged-cache --enable-prefix-cache --timeout 86400 (and "
        "--ssd-cache-dir for the restart)",
    }


def _ratio(me: dict, peer: dict, field: str) -> float | None:
    return me[field] / peer[field] if me.get(field) and peer.get(field) else None


def ratios(rows) -> list[dict]:
    """mlxpaged / peer of wall time, later-turn TTFT and (restart variant) the first turn after the
    restart, formed within each (K, restart, repeat)."""
    out = []
    keyf = lambda r: (r["k"], r["restart"], r["repeat"])  # noqa: E731
    by = {}
    for r in rows:
        by.setdefault(keyf(r), {})[r["server"]] = r
    for key, group in sorted(by.items()):
        me = group.get("mlxpaged")
        for peer, p in group.items():
            if peer == "mlxpaged" or me is None:
                continue
            out.append(
                {
                    "k": key[0],
                    "restart": key[1],
                    "repeat": key[2],
                    "peer": peer,
                    "wall_ratio": me["wall_s"] / p["wall_s"],
                    "ttft_later_ratio": _ratio(me, p, "ttft_ms_later_median"),
                    # the first turn after the restart: mlx_lm.server recomputes the whole history
                    # there, so its time is the cold time the disk tier is measured against
                    "ttft_after_restart_ratio": _ratio(me, p, "ttft_ms_after_restart_median") if key[1] else None,
                }
            )
    return out


def write_plot(out: Path, rows: list[dict]) -> Path:
    """TTFT per turn (median over repeats of each replay's median), one panel per K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({r["k"] for r in rows})
    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 4), squeeze=False)
    for ax, k in zip(axes[0], ks):
        for server, rs in sorted({(r["server"], r["restart"]) for r in rows if r["k"] == k}):
            reps = [r for r in rows if r["k"] == k and r["server"] == server and r["restart"] == rs]
            ys = []
            for t in range(reps[0]["turns"]):
                xs = [r["ttft_per_turn"][t]["ttft_ms_median"] for r in reps if r["ttft_per_turn"][t]["ttft_ms_median"]]
                ys.append(statistics.median(xs) if xs else float("nan"))
            ax.plot(range(len(ys)), ys, marker="o", label=f"{server}{' (restart)' if rs else ''}")
        ax.set_title(f"K={k}")
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT median (ms)")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    return out


def main(argv: list[str]) -> int:
    import argparse

    from .report import git_state, write_result

    ap = argparse.ArgumentParser(prog="bench_agents.py", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="Checkpoint folder (default: the offline Qwen2.5-Coder-0.5B).")
    ap.add_argument("--tiny", action="store_true", help="A tiny random model (smoke runs).")
    ap.add_argument("--ks", default="1,4,8", help="Concurrent conversations, comma-separated.")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--restart", action="store_true", help="Also the variant restarting the server after T/2.")
    ap.add_argument(
        "--restart-only", action="store_true", help="Only the variant restarting the server (e.g. for another peer)."
    )
    ap.add_argument(
        "--servers",
        default=",".join(DEFAULT_SERVERS),
        help="Comma-separated, of mlxpaged,mlx_lm,vllm_mlx (vllm_mlx: MLXPAGED_VLLM_MLX names its venv's Python).",
    )
    ap.add_argument(
        "--mlxpaged-args", default="", help="Extra flags for `mlxpaged serve`, one string (e.g. a scheduling setting)."
    )
    ap.add_argument("--out-dir", default="bench_results")
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--allow-dirty", action="store_true")
    a = ap.parse_args(argv)
    git = git_state()
    if git["dirty"] and not a.allow_dirty:
        print("error: the tree has uncommitted changes; commit them or pass --allow-dirty", file=sys.stderr)
        return 1
    servers = tuple(s for s in a.servers.split(",") if s)
    bad = set(servers) - set(SERVERS)
    if bad:
        print(f"error: unknown server(s) {sorted(bad)}; choose from {list(SERVERS)}", file=sys.stderr)
        return 1
    if "vllm_mlx" in servers:
        try:
            http.vllm_mlx_python()
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    path = http.float32_copy(http.model_path(a.model, a.tiny))
    ks = [int(x) for x in a.ks.split(",") if x]
    res = run(
        path,
        ks,
        a.turns,
        a.repeats,
        a.max_tokens,
        a.seed,
        a.restart,
        servers,
        a.mlxpaged_args.split(),
        progress=print,
        restart_only=a.restart_only,
    )
    out = write_result(
        a.out_dir,
        "agents",
        Path(path).name,
        {
            "ks": ks,
            "turns": a.turns,
            "repeats": a.repeats,
            "restart": a.restart or a.restart_only,
            "restart_only": a.restart_only,
            "git_at_start": git,
            **res,
        },
    )
    print(f"system prompt with tools: {res['system_prompt_tokens']} tokens; {res['peer_args_note']}")
    print(f"results: {out}")
    if a.plot:
        print(f"plot: {write_plot(out.with_suffix('.png'), res['rows'])}")
    return 0
