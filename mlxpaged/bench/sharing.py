"""Memory saved by sharing blocks: parallel sampling and beam search (the paper's §6.3).

For each step of a run, the allocator's blocks in use are compared with the blocks every live
sequence would hold alone (its table length): memory saved = 1 - in use / alone. The figure is
the mean over the steps, as the paper measures it. Prefix caching is off, so only sharing within
a request counts.
"""

from __future__ import annotations

import statistics

from ..config import EngineConfig
from ..engine.beam_search import BeamSearchParams
from ..engine.llm_engine import LLMEngine
from ..engine.sampling_params import SamplingParams

# §6.3 of Kwon et al. (OPT-13B): memory saved, (min, max) over the settings they ran.
PAPER = {
    ("parallel", "alpaca"): (6.1, 9.8),
    ("parallel", "sharegpt"): (16.2, 30.5),
    ("beam", "alpaca"): (37.6, 55.2),
    ("beam", "sharegpt"): (44.3, 66.3),
}


def measure(
    loaded, prompts: list[list[int]], mode: str, width: int, max_tokens: int, block_size: int = 16, seed: int = 0
) -> dict:
    """Run every prompt with `width` parallel samples (temperature 1) or beams; return the
    mean memory saved over the steps, with the allocator's counters."""
    if mode not in ("parallel", "beam"):
        raise ValueError(f"mode must be 'parallel' or 'beam', got {mode!r}")
    alone_max = sum(width * -(-(len(p) + max_tokens) // block_size) for p in prompts)
    engine = LLMEngine(
        loaded,
        EngineConfig.of(
            block_size=block_size,
            num_blocks=alone_max + 1,
            enable_prefix_caching=False,
            max_num_seqs=len(prompts) * width,
            max_num_batched_tokens=4096,
        ),
    )
    for i, p in enumerate(prompts):
        if mode == "parallel":
            engine.add_request(p, SamplingParams(n=width, temperature=1.0, seed=seed + i, max_tokens=max_tokens))
        else:
            engine.add_beam_request(p, BeamSearchParams(beam_width=width, max_tokens=max_tokens))
    saved = []
    while engine.has_unfinished_requests():
        engine.step()
        alone = sum(len(s.block_table) for s in engine.live_sequences())
        if alone:
            saved.append(1.0 - engine.block_manager.pool.num_used / alone)
    st = engine.stats_dict()
    return {
        "mode": mode,
        "width": width,
        "num_prompts": len(prompts),
        "max_tokens": max_tokens,
        "block_size": block_size,
        "memory_saved_pct": 100 * statistics.fmean(saved),
        "steps": len(saved),
        "generation_tokens": st["generation_tokens"],
        "blocks_in_use_peak": st["blocks_in_use_peak"],
        "blocks_without_sharing_peak": st["blocks_without_sharing"],
        "cow_copies": st["cow_copies"],
        "beam_forks": st["beam_forks"],
        "beam_frees": st["beam_frees"],
    }


def run(
    loaded,
    datasets: list[str],
    modes: list[str],
    widths: list[int],
    num_prompts: int,
    max_tokens: int,
    done: list[dict] | None = None,
    on_row=None,
) -> list[dict]:
    """Every (data set, mode, width) row, `num_prompts` real prompts each (chat-wrapped).

    Rows already in `done` (same data set, mode, width, prompts and cap) are kept, not rerun,
    so a long run that was stopped resumes; `on_row(rows)` sees the list after each new row.
    """
    from .datasets import sample_requests
    from .prompts import encode_chat

    tok = loaded.tokenizer
    rows = list(done or [])
    key = lambda r: (r["dataset"], r["mode"], r["width"], r["num_prompts"], r["max_tokens"])  # noqa: E731
    have = {key(r) for r in rows}
    for ds in datasets:
        texts = [p for p, _, _ in sample_requests(ds, lambda ts: [len(tok.encode(t)) for t in ts], num_prompts)]
        prompts = encode_chat(tok, texts)
        for mode in modes:
            for w in widths:
                if (ds, mode, w, num_prompts, max_tokens) in have:
                    continue
                r = measure(loaded, prompts, mode, w, max_tokens)
                r["dataset"] = ds
                rows.append(r)
                if on_row is not None:
                    on_row(rows)
    order = {(d, m, w): i for i, (d, m, w) in enumerate((d, m, w) for d in datasets for m in modes for w in widths)}
    return sorted(rows, key=lambda r: order.get((r["dataset"], r["mode"], r["width"]), len(order)))


def table(rows: list[dict]) -> str:
    """The measured savings beside the paper's, one line per (data set, mode, width)."""
    out = [
        f"{'data set':>9} | {'mode':>8} | {'width':>5} | {'saved %':>7} | {'paper % (OPT-13B)':>17} | "
        f"{'peak blocks (shared / alone)':>28} | {'copy-on-write':>13} | {'forks':>5}"
    ]
    for r in rows:
        lo, hi = PAPER[(r["mode"], r["dataset"])]
        out.append(
            f"{r['dataset']:>9} | {r['mode']:>8} | {r['width']:>5} | {r['memory_saved_pct']:7.1f} | "
            f"{f'{lo}-{hi}':>17} | {r['blocks_in_use_peak']:>13} / {r['blocks_without_sharing_peak']:<12} | "
            f"{r['cow_copies']:>13} | {r['beam_forks']:>5}"
        )
    return "\n".join(out)
