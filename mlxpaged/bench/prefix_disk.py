"""Time to first token of a long shared prefix plus a short question: cold, warm in memory, and
after a restart from the prefix cache's disk tier (worker/prefix_store.py).

Each run asks a different question (its own `question_tokens` tokens) after the same prefix, so
a hit covers the prefix's full blocks and the question is computed. Cold: a new engine with no
cache. Warm: one engine that has served the prefix once. Disk: a new engine (a restart: new pool,
nothing in memory) over a store the prefix was written to. Engines are built outside the clock;
the clock runs from `add_request` to the first token (`max_tokens=1`). Disk reads come from the
OS page cache when the files are recent, as on a laptop that restarts its server.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .repeat import fmt, spread


def prompt_ids(
    tokenizer, vocab_size: int, prefix_tokens: int, question_tokens: int, run: int
) -> tuple[list[int], list[int]]:
    """(the shared prefix, question number `run`): text tokens from the calibration text, so the
    model sees language; the question is a slice that starts elsewhere for every run."""
    from importlib.resources import files

    text = files("mlxpaged.data").joinpath("kv_calibration.txt").read_text()
    ids = [t for t in tokenizer.encode(text) if t < vocab_size]
    need = prefix_tokens + question_tokens * (run + 2)
    ids = (ids * (need // len(ids) + 1))[:need]
    start = prefix_tokens + question_tokens * (run + 1)
    return ids[:prefix_tokens], ids[start : start + question_tokens]


def _ttft(engine, prompt: list[int]) -> tuple[float, int, list[int]]:
    from ..engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return time.perf_counter() - t0, out.num_cached_tokens, out.outputs[0].token_ids


def benchmark(
    loaded,
    *,
    prefix_tokens: int = 2000,
    question_tokens: int = 50,
    repeats: int = 3,
    store_dir: str | None = None,
    progress=lambda: None,
) -> dict:
    from ..config import EngineConfig
    from ..engine.llm_engine import LLMEngine

    tok, vocab = loaded.tokenizer, loaded.model.args.vocab_size
    prefix, _ = prompt_ids(tok, vocab, prefix_tokens, question_tokens, 0)
    questions = [prompt_ids(tok, vocab, prefix_tokens, question_tokens, r)[1] for r in range(3 * repeats + 1)]
    num_blocks = -(-(prefix_tokens + question_tokens + 16) // 16) * 2
    store = Path(store_dir or tempfile.mkdtemp(prefix="mlxpaged-prefix-disk-"))

    def config(disk: bool) -> EngineConfig:
        return EngineConfig.of(num_blocks=num_blocks, prefix_cache_dir=str(store) if disk else None)

    rows: dict[str, list] = {"cold": [], "warm": [], "disk": []}
    tokens: dict[str, list] = {"cold": [], "warm": [], "disk": []}
    cached: dict[str, list] = {"cold": [], "warm": [], "disk": []}
    q = iter(questions)
    writer = LLMEngine(loaded, config(True))  # writes the prefix's blocks once, untimed
    _ttft(writer, prefix + next(q))
    writer.prefix_store.flush()
    store_stats = writer.prefix_store.stats
    file_nbytes, block_size = writer.prefix_store.file_nbytes, writer.config.cache.block_size
    warm = LLMEngine(loaded, config(False))
    _ttft(warm, prefix + questions[-1])  # the warm engine's first serving of the prefix, untimed
    read_s_per_block = []
    for i in range(repeats):
        question = next(q)
        for case in ("cold", "warm", "disk") if i % 2 == 0 else ("disk", "warm", "cold"):
            engine = warm if case == "warm" else LLMEngine(loaded, config(case == "disk"))
            dt, hits, toks = _ttft(engine, prefix + question)
            rows[case].append(dt)
            cached[case].append(hits)
            tokens[case].append(toks)
            if case == "disk":
                s = engine.prefix_store.stats
                read_s_per_block.append(s.read_seconds / max(s.hit_blocks, 1))
            progress()
    cold_per_token = [t / (prefix_tokens + question_tokens) for t in rows["cold"]]
    return {
        "prefix_tokens": prefix_tokens,
        "question_tokens": question_tokens,
        "repeats": repeats,
        "ttft_s": {case: spread(v) for case, v in rows.items()},
        "cached_tokens": cached,
        "same_first_tokens": all(tokens["cold"][i] == tokens["warm"][i] == tokens["disk"][i] for i in range(repeats)),
        "disk_over_cold": spread([d / c for d, c in zip(rows["disk"], rows["cold"])]),
        "disk_bytes_per_token": file_nbytes / block_size,
        "disk_bytes_written": store_stats.written_bytes,
        # The crossover: reading a block pays while it costs less than computing its tokens.
        "read_ms_per_block": spread([1e3 * r for r in read_s_per_block]),
        "cold_compute_ms_per_block": spread([1e3 * block_size * c for c in cold_per_token]),
        # The disk read speed below which recomputing a block would be faster than reading it.
        "break_even_read_mb_per_s": spread([file_nbytes / (block_size * c) / 1e6 for c in cold_per_token]),
        "store_dir": str(store),
    }


def table(p: dict) -> list[str]:
    t = p["ttft_s"]
    lines = [
        f"time to first token, {p['prefix_tokens']}-token prefix + {p['question_tokens']}-token question "
        f"(median (min-max) of {p['repeats']} runs, seconds):"
    ]
    for case, label in (
        ("cold", "cold (no cache)"),
        ("warm", "warm in memory"),
        ("disk", "after a restart, from disk"),
    ):
        lines.append(f"  {label:28s} {fmt(t[case], 3)}   cached tokens {p['cached_tokens'][case]}")
    lines.append(
        f"disk / cold: {fmt(p['disk_over_cold'], 4)}; same first tokens in all three: {p['same_first_tokens']}"
    )
    lines.append(
        f"disk bytes per token: {p['disk_bytes_per_token']:.0f}; "
        f"read {fmt(p['read_ms_per_block'], 2)} ms per block vs computing it cold "
        f"{fmt(p['cold_compute_ms_per_block'], 1)} ms; reading pays down to "
        f"{fmt(p['break_even_read_mb_per_s'], 1)} MB/s"
    )
    return lines
