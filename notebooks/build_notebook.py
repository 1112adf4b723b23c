"""Write ``paged_attention.ipynb`` from the cells below (the readable source of the notebook).

The notebook is saved without outputs, so it stays small and diffs stay readable; run it in
Jupyter, or let ``tests/test_notebooks.py`` execute it. Edit this file, not the ``.ipynb``,
then::

    python notebooks/build_notebook.py
"""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
OUT = HERE / "paged_attention.ipynb"


def md(text: str) -> tuple[str, str]:
    return "markdown", dedent(text).strip()


def code(text: str) -> tuple[str, str]:
    return "code", dedent(text).strip()


CELLS = [
    md("""
    # PagedAttention, step by step, with mlxpaged's own code

    This notebook retells the argument of Kwon et al., *Efficient Memory Management for Large
    Language Model Serving with PagedAttention* (SOSP 2023), with mlxpaged's code and data:

    1. how much KV memory each way of reserving it wastes, on ShareGPT and Alpaca length traces;
    2. what the block size trades: waste against table length and prefix sharing;
    3. the block tables of two sequences decoded together, interleaved in one pool;
    4. four samples of one prompt sharing its blocks, with copy-on-write;
    5. the prefix cache reusing the blocks of an earlier request;
    6. the cost of the paged-attention kernel by block size.

    Sections 1, 2 and 6 use tables (`mlxpaged.waste`, `scripts/data/*_lengths.json`,
    `scripts/kernel.py`'s output); sections 3 to 5 run the real engine. By default the engine
    runs a tiny random-weight Qwen2 written by `tests/tiny_model.py`, so the whole notebook
    runs in seconds on a CPU; its text is gibberish, but the blocks, tables and counts depend
    only on how many tokens there are, so they are those a real model would show. Set `MLXPAGED_NOTEBOOK_MODEL` to a
    checkpoint directory, a `.gguf` file or a Hugging Face repo id to use a real model.
    """),
    code("""
    import json
    import os
    import sys
    import tempfile
    import warnings
    from pathlib import Path

    # mlx-lm imports tqdm.auto, which warns when ipywidgets is missing; nothing here shows a bar.
    warnings.filterwarnings("ignore", message="IProgress not found")

    import mlxpaged  # first: it points MLX at the system OpenBLAS before MLX loads
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from mlxpaged import EngineConfig, LLMEngine, SamplingParams, waste
    from mlxpaged.loader import load


    def find_root() -> Path:
        \"\"\"The checkout: the traces and the tiny-model writer live there, not in the package.\"\"\"
        for p in [Path.cwd(), *Path.cwd().parents]:
            if (p / "scripts" / "data").is_dir() and (p / "mlxpaged").is_dir():
                return p
        return Path(mlxpaged.__file__).resolve().parent.parent


    ROOT = find_root()
    TRACE_DIR = ROOT / "scripts" / "data"
    NOTEBOOK_DATA = ROOT / "notebooks" / "data"

    MODEL = os.environ.get("MLXPAGED_NOTEBOOK_MODEL")
    if MODEL:
        loaded = load(MODEL)
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_model import write_tiny_qwen2

        # Kept in a variable: the directory is removed when the kernel exits.
        _tiny_dir = tempfile.TemporaryDirectory(prefix="mlxpaged-notebook-")
        loaded = load(str(write_tiny_qwen2(Path(_tiny_dir.name) / "tiny-qwen2")), "float32")
    tok = loaded.tokenizer
    print(f"model: {MODEL or 'tiny random-weight Qwen2 (tests/tiny_model.py)'}, {loaded.dtype}")

    # Prompt text for the engine runs (the tiny model's tokenizer was trained on these words).
    TEXTS = [
        "The KV cache stores the keys and values of every token a sequence has seen.",
        "Paged attention borrows an idea from operating systems: virtual memory and paging.",
    ]
    """),
    code("""
    def draw_grid(ax, kinds, labels, colors, title):
        \"\"\"Cells colored by `kinds` (ints indexing `colors`), with `labels` written in them.\"\"\"
        kinds = np.asarray(kinds)
        ax.imshow(kinds, cmap=ListedColormap(colors), vmin=-0.5, vmax=len(colors) - 0.5)
        for (r, c), text in np.ndenumerate(np.asarray(labels, dtype=object)):
            if text:
                ax.text(c, r, text, ha="center", va="center", fontsize=8)
        ax.set_xticks(np.arange(kinds.shape[1] + 1) - 0.5, minor=True)
        ax.set_yticks(np.arange(kinds.shape[0] + 1) - 0.5, minor=True)
        ax.grid(which="minor", color="white", linewidth=2)
        ax.tick_params(which="both", length=0)
        ax.set_title(title, fontsize=10)
    """),
    md("""
    ## 1. The waste of each reservation scheme

    A server that gives each request one contiguous KV region must reserve it on arrival, for a
    final length it does not know. The paper compares three such schemes with paging:

    - **max**: the model's whole context window (2,048 slots), whatever the request;
    - **pow2**: the prompt plus a power-of-two bucket for the answer (up to 2x over);
    - **oracle**: exactly the final length, as if it were known in advance;
    - **paged**: blocks of 16 slots for the tokens present now; only the last block is partly empty.

    The measure is real tokens as a share of reserved slots, summed over every step of every
    request (`mlxpaged/waste.py` defines it). Even the oracle wastes about half the answer's
    slots, reserved from the first step and filled one per step. Grey bars are the seed design
    doc's figures (`waste.SEED_REAL_SHARE`), beside ours on our traces
    (`scripts/data/*_lengths.json`, built by `scripts/lengths.py`).
    """),
    code("""
    TRACES = {"sharegpt": "ShareGPT", "alpaca": "Alpaca"}
    pairs = {name: waste.load_pairs(TRACE_DIR / f"{name}_lengths.json") for name in TRACES}
    tables = {name: waste.waste_table(p, ("max", "pow2", "oracle"), block_size=16) for name, p in pairs.items()}


    def seed_share(trace, scheme):
        return waste.SEED_REAL_SHARE[trace]["paged" if scheme.startswith("paged") else scheme]


    for name, rows in tables.items():
        print(f"{TRACES[name]}: {len(pairs[name])} requests")
        for r in rows:
            print(f"  {r.scheme:<9} real/reserved {100 * r.real_share:5.1f}% (seed {seed_share(name, r.scheme):4.1f}%), "
                  f"{r.requests_in_flight:5.1f} requests at once in {waste.CAPACITY_SLOTS:,} slots")

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, (name, rows) in zip(axes, tables.items()):
        x = np.arange(len(rows))
        ours = ax.bar(x - 0.2, [100 * r.real_share for r in rows], 0.4, label="ours (mlxpaged.waste)")
        seed = ax.bar(x + 0.2, [seed_share(name, r.scheme) for r in rows], 0.4, color="0.75", label="seed design doc")
        ax.bar_label(ours, fmt="%.1f", fontsize=8)
        ax.bar_label(seed, fmt="%.1f", fontsize=8, color="0.4")
        ax.set_xticks(x, [r.scheme for r in rows])
        ax.set_ylim(0, 110)
        ax.set_title(f"{TRACES[name]} ({len(pairs[name])} requests)")
    axes[0].set_ylabel("real tokens / reserved slots (%)")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle("KV slots holding a token, by reservation scheme")
    fig.tight_layout()
    plt.show()
    """),
    md("""
    ## 2. The block-size trade-off

    Small blocks waste less (only the last block of a sequence is partly empty) but a sequence
    needs more of them: longer block tables, more allocator work, and less contiguous memory per
    gather in the kernel. Large blocks waste the tail of every sequence and share less of a
    prefix, since only full blocks are cached: of an 85-token system prompt, blocks of 16 reuse
    80 tokens, blocks of 64 reuse 64 and blocks of 128 reuse nothing. mlxpaged's default is 16.
    """),
    code("""
    SIZES = [2**i for i in range(9)]  # 1 .. 256
    paged = {name: [waste.paged_row(p, bs) for bs in SIZES] for name, p in pairs.items()}
    reuse = [waste.prefix_reuse(waste.SHARED_PREFIX, bs) for bs in SIZES]

    print(f"{'block':>5} | {'ShareGPT real':>13} {'blocks/req':>10} | {'Alpaca real':>11} {'blocks/req':>10} | reuse of {waste.SHARED_PREFIX}")
    for i, bs in enumerate(SIZES):
        s, a = paged["sharegpt"][i], paged["alpaca"][i]
        print(f"{bs:>5} | {100 * s.real_share:>12.1f}% {s.blocks_per_request:>10.1f} | "
              f"{100 * a.real_share:>10.1f}% {a.blocks_per_request:>10.1f} | {reuse[i]:>3}")

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, rows in paged.items():
        axes[0].plot(SIZES, [100 * r.real_share for r in rows], "o-", label=TRACES[name])
        axes[1].plot(SIZES, [r.blocks_per_request for r in rows], "o-", label=TRACES[name])
    axes[2].step(SIZES, reuse, "o-", where="post", color="tab:green")
    axes[2].axhline(waste.SHARED_PREFIX, color="0.6", linestyle=":", label=f"whole prefix ({waste.SHARED_PREFIX})")
    axes[0].set_ylabel("real tokens / reserved slots (%)")
    axes[1].set_ylabel("blocks per running request")
    axes[1].set_yscale("log")
    axes[2].set_ylabel(f"prefix tokens reusable (of {waste.SHARED_PREFIX})")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(SIZES, [str(s) for s in SIZES])
        ax.set_xlabel("block size (tokens)")
        ax.axvline(16, color="0.85", zorder=0)
        ax.legend(fontsize=8)
    fig.suptitle("Block size: memory waste against table length and prefix sharing")
    fig.tight_layout()
    plt.show()
    """),
    md("""
    ## 3. Two sequences, interleaved in one pool

    Two prompts go into one engine and decode together, one token each per step. Whenever a
    sequence fills its last block, the block manager hands it the next free block, whoever's
    neighbour that is, so the two tables interleave in the pool: neither sequence needs
    contiguous memory, and neither holds a slot it is not about to fill. Blocks of 4 tokens here,
    to show many blocks on a small grid; each cell is one pool block, labelled with its owner
    and its index in the owner's block table
    (`engine.scheduler.running[i].seqs[0].block_ids`).
    """),
    code("""
    POOL3, BS3, STEPS3 = 32, 4, 40
    engine = LLMEngine(loaded, EngineConfig(block_size=BS3, num_blocks=POOL3))
    greedy = SamplingParams(temperature=0.0, max_tokens=STEPS3, ignore_eos=True)
    engine.add_request("The KV cache stores", greedy, request_id="A")
    engine.add_request("Paged attention borrows an idea from operating systems:", greedy, request_id="B")

    snapshots = {}  # step -> {request id: block ids}, while both requests run
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        engine.check_invariants()
        tables3 = {r.request_id: r.seqs[0].block_ids for r in engine.scheduler.running}
        if len(tables3) == 2:
            snapshots[step] = tables3

    shown = [min(snapshots), sorted(snapshots)[len(snapshots) // 2], max(snapshots)]
    for s in shown:
        print(f"step {s:>2}: " + "; ".join(f"{rid} -> {ids}" for rid, ids in snapshots[s].items()))
    last = snapshots[shown[-1]]
    assert not set(last["A"]) & set(last["B"]), "two live sequences never share a block here"

    OWNERS = {"A": 1, "B": 2}
    fig, axes = plt.subplots(1, len(shown), figsize=(4.3 * len(shown), 2.6))
    for ax, s in zip(axes, shown):
        kinds, labels = np.zeros(POOL3, int), np.full(POOL3, "", dtype=object)
        for rid, ids in snapshots[s].items():
            for logical, block in enumerate(ids):
                kinds[block], labels[block] = OWNERS[rid], f"{rid}{logical}"
        draw_grid(ax, kinds.reshape(-1, 8), labels.reshape(-1, 8), ["0.92", "tab:blue", "tab:orange"],
                  f"after step {s}: {sum(map(len, snapshots[s].values()))} of {POOL3} blocks")
        ax.set_xticks(range(8), range(8))
        ax.set_yticks(range(POOL3 // 8), [f"{8 * r}" for r in range(POOL3 // 8)])
    axes[0].set_ylabel("pool block id (row start)")
    fig.legend(handles=[Patch(color=c, label=l) for c, l in [("tab:blue", "A"), ("tab:orange", "B"), ("0.92", "free")]],
               loc="lower center", ncol=3, fontsize=8, bbox_to_anchor=(0.5, -0.08))
    fig.suptitle(f"The pool ({POOL3} blocks of {BS3} tokens), colored by owner", y=1.04)
    plt.show()
    """),
    md("""
    ## 4. Four samples share a prompt's blocks, with copy-on-write

    One 44-token prompt, `SamplingParams(n=4, ...)`, 64 tokens per sample, blocks of 16. The
    prompt is prefilled once; the other three samples fork from it and share its 3 blocks
    (reference count 4). The 3rd block is only partly filled (44 = 2 x 16 + 12), so when a sample
    first writes its own token there, the block manager copies the block first (copy-on-write);
    the last sample to write finds the count back at 1 and writes in place: 3 copies, not 4.
    From then on each sample takes its own blocks. At the end each sample stores 44 + 63 = 107
    tokens in 7 blocks: 28 blocks without sharing, 2 + 4 x 5 = 22 with it.
    """),
    code("""
    prompt4 = tok.encode(" ".join(TEXTS) * 3)[:44]
    assert len(prompt4) == 44
    N, MAX4 = 4, 64
    params4 = SamplingParams(n=N, temperature=0.9, top_p=0.95, top_k=50, seed=7, max_tokens=MAX4, ignore_eos=True)
    engine = LLMEngine(loaded, EngineConfig(block_size=16, num_blocks=64))
    engine.add_request(prompt4, params4, request_id="n4")
    pool = engine.block_manager.pool

    history = []  # (step, blocks in use, blocks if nothing were shared)
    tables4 = {}  # step -> [(block id, ref count) per table entry] per sample
    step, done = 0, []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
        step += 1
        engine.check_invariants()
        seqs = [s for r in engine.scheduler.running for s in r.live_seqs()]
        if seqs:
            history.append((step, pool.num_used, sum(len(s.block_table) for s in seqs)))
            tables4[step] = [[(b.block_id, b.ref_cnt) for b in s.block_table] for s in seqs]
    samples = [c.token_ids for c in done[0].outputs]

    st = engine.stats_dict()
    print(f"{len(prompt4)}-token prompt, {N} samples of {MAX4} tokens: {st['blocks_in_use_peak']} blocks in use at peak, "
          f"{st['blocks_without_sharing']} without sharing, {st['cow_copies']} copy-on-write copies")
    print(f"distinct samples: {len({tuple(t) for t in samples})} of {N}")
    first, final = min(tables4), max(tables4)
    for s in (first, first + 1, final):
        print(f"step {s:>2}: " + " | ".join(" ".join(f"{b}" for b, _ in t) for t in tables4[s]))
    """),
    code("""
    # Kinds of table entry: shared (ref count > 1); the partly filled prompt block, copied on
    # write, or kept in place by the last sample; a block of the sample's own.
    KIND_COLORS = ["tab:purple", "tab:orange", "tab:olive", "tab:green", "1.0"]
    KIND_NAMES = ["shared (ref count > 1)", "copy-on-write copy", "prompt block kept (ref count fell to 1)", "own block", ""]
    partial = len(prompt4) // 16  # table index of the partly filled prompt block
    prompt_block = tables4[first][0][partial][0]


    def kind(index, block, ref):
        if ref > 1:
            return 0
        if index == partial:
            return 2 if block == prompt_block else 1
        return 3


    fig, axes = plt.subplots(1, 3, figsize=(14, 2.9), gridspec_kw={"width_ratios": [1, 1, 1.3]})
    width = max(len(t) for t in tables4[final])
    for ax, s, what in ((axes[0], first, "after the prefill"), (axes[1], final, "at the last step")):
        kinds = np.full((N, width), 4)
        labels = np.full((N, width), "", dtype=object)
        for row, table in enumerate(tables4[s]):
            for i, (block, ref) in enumerate(table):
                kinds[row, i], labels[row, i] = kind(i, block, ref), str(block)
        draw_grid(ax, kinds, labels, KIND_COLORS, f"block tables {what} (step {s})")
        ax.set_yticks(range(N), [f"sample {i}" for i in range(N)] if ax is axes[0] else [])
        ax.set_xticks(range(width), range(width))
        ax.set_xlabel("index in the block table")
    axes[0].legend(handles=[Patch(color=c, label=n) for c, n in zip(KIND_COLORS[:4], KIND_NAMES[:4])],
                   loc="upper center", bbox_to_anchor=(1.1, -0.35), ncol=4, fontsize=8)

    steps, used, unshared = zip(*history)
    axes[2].plot(steps, unshared, label="without sharing (sum of table lengths)", color="0.5")
    axes[2].plot(steps, used, label="in use (shared blocks once)", color="tab:purple")
    axes[2].annotate(f"{st['blocks_in_use_peak']} vs {st['blocks_without_sharing']}", (steps[-1], used[-1]),
                     xytext=(-60, 20), textcoords="offset points", arrowprops={"arrowstyle": "->"})
    axes[2].set_xlabel("engine step")
    axes[2].set_ylabel("blocks")
    axes[2].legend(fontsize=8)
    axes[2].set_title(f"{N} samples: blocks in use", fontsize=10)
    plt.show()
    """),
    md("""
    ## 5. Prefix reuse across requests

    Every full block is named by a hash of all the tokens up to its end, so a later request
    that starts with the same tokens finds those blocks in the cache, even after their first
    owner has finished (freed blocks keep their contents until they are taken again).

    - **A**: 96 tokens, run first: nothing to reuse.
    - **B**: A's first 85 tokens, then different ones: A's first 5 blocks (80 tokens) match; the
      6th holds tokens 80 to 95, which differ after the 85th, so reuse stops at a whole block:
      `waste.prefix_reuse(85, 16)` = 80.
    - **C**: A with its 3rd token changed: its first block misses, and since each block's hash
      covers every token before it, so does every later one: 0.

    The counts are `RequestOutput.num_cached_tokens`.
    """),
    code("""
    a = tok.encode(" ".join(TEXTS) * 4)[:96]
    b = a[:85] + tok.encode(" Copy-on-write lets many samples share the blocks of one prompt.")[: 96 - 85]
    assert len(a) == len(b) == 96 and b[85] != a[85]
    c = list(a)
    c[2] = a[2] + 1 if a[2] + 1 < loaded.model.args.vocab_size else a[2] - 1
    prompts5 = {"A": a, "B": b, "C": c}

    engine = LLMEngine(loaded, EngineConfig(block_size=16, num_blocks=64))
    cached = {}
    for rid, ids in prompts5.items():  # one after another: B and C arrive after A has finished
        engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=8), request_id=rid)
        while engine.has_unfinished_requests():
            cached.update({o.request_id: o.num_cached_tokens for o in engine.step() if o.finished})
    for rid, ids in prompts5.items():
        print(f"{rid}: {len(ids)} prompt tokens, {cached[rid]} reused from the prefix cache")
    print(f"waste.prefix_reuse({waste.SHARED_PREFIX}, 16) = {waste.prefix_reuse(waste.SHARED_PREFIX, 16)}")

    fig, ax = plt.subplots(figsize=(8, 2.2))
    names = list(prompts5)[::-1]
    hits = [cached[n] for n in names]
    ax.barh(names, hits, color="tab:green", label="reused from the prefix cache")
    ax.barh(names, [len(prompts5[n]) - h for n, h in zip(names, hits)], left=hits, color="0.75", label="computed")
    ax.axvline(85, color="tab:red", linestyle=":", label="B leaves A after 85 tokens")
    for x in range(16, 96, 16):
        ax.axvline(x, color="white", linewidth=1)  # block boundaries
    ax.set_xlabel("prompt tokens (white lines: blocks of 16)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title("Prefix cache: prompt tokens reused per request", fontsize=10)
    plt.show()
    """),
    md("""
    ## 6. The kernel's cost by block size

    `scripts/kernel.py` runs the Metal paged-attention kernel at Qwen2.5-1.5B decode shapes
    (12 query heads, 2 KV heads, head_dim 128, fp16) for block sizes 1 to 256, with each
    sequence's blocks in order or scattered over the pool. On a Mac it times the kernel against
    contiguous `mx.fast.scaled_dot_product_attention`; save that as
    `python scripts/kernel.py --json > notebooks/data/kernel_mac.json` and this cell plots it.
    Without one, the cell plots the table of the MSL emulator, which runs the kernel's exact
    source on the CPU and counts the bytes it reads, as a multiple of the minimum (each K/V row
    once, the queries, the block-table entries, the lengths); it comes from
    `python scripts/kernel.py --json > notebooks/data/kernel_emulator.json` (4 sequences x 1,024
    tokens), for the path the kernel's planner chose (split over the context, then merged) and
    for the one-pass kernel on the same inputs. In the saved table scattered blocks cost the
    emulated kernel nothing extra, and the reads stay within a few percent of the minimum at
    every block size; timings need an Apple GPU.
    """),
    code("""
    def kernel_rows(path):
        doc = json.loads(path.read_text())
        return doc["rows"] if isinstance(doc, dict) else doc  # a bare list is kernel.py --json


    found = [p for p in (NOTEBOOK_DATA / "kernel_mac.json", NOTEBOOK_DATA / "kernel_emulator.json") if p.exists()]
    if not found:
        print("no kernel table in notebooks/data: run scripts/kernel.py --json (see above)")
    else:
        source = found[0]
        rows6 = kernel_rows(source)
        timed = "paged_ms" in rows6[0]  # a GPU run; the emulator counts bytes instead
        print(f"from {source.relative_to(ROOT)}:")
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
        for scattered, style in ((False, "o-"), (True, "s--")):
            rs = sorted((r for r in rows6 if r["scattered"] == scattered), key=lambda r: r["block_size"])
            bs = [r["block_size"] for r in rs]
            layout = "scattered" if scattered else "in order"
            if timed:
                axes[0].plot(bs, [r["paged_ms"] for r in rs], style, label=f"paged kernel, {layout}")
                axes[0].plot(bs, [r["sdpa_ms"] for r in rs], style, color="0.6", label=f"contiguous SDPA ({layout} run)")
            else:
                axes[0].plot(bs, [r["ratio"] for r in rs], style, color="tab:blue", label=f"chosen path, {layout}")
                if "single_pass_ratio" in rs[0]:  # newer tables also run the one-pass kernel
                    axes[0].plot(bs, [r["single_pass_ratio"] for r in rs], style, color="tab:orange",
                                 label=f"single pass, {layout}")
                axes[0].set_ylim(1.0, max(1.05, 1.01 * max(r["ratio"] for r in rows6)))  # 1 = the minimum
            axes[1].plot(bs, [r["max_error"] for r in rs], style, label=layout)
            for r in rs:
                cost = f"{r['paged_ms']:.3f} ms vs SDPA {r['sdpa_ms']:.3f} ms" if timed else f"bytes read {r['ratio']:.4f}x the minimum"
                print(f"  block {r['block_size']:>3} {layout:>9}: {cost}, max error {r['max_error']:.2g}")
        axes[0].set_ylabel("milliseconds" if timed else "bytes read / minimum")
        axes[0].set_title("time per call (Apple GPU)" if timed else "bytes read by the emulated kernel", fontsize=10)
        axes[1].set_ylabel("max |kernel - reference|")
        axes[1].set_yscale("log")
        axes[1].set_title("error against the pure-MLX reference", fontsize=10)
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(bs, [str(s) for s in bs])
            ax.set_xlabel("block size (tokens)")
            ax.legend(fontsize=8)
        fig.tight_layout()
        plt.show()
    """),
    md("""
    ## Where to look next

    - `mlxpaged/block_pool.py` and `mlxpaged/block_manager.py`: the allocator behind sections 3 to 5.
    - `scripts/waste.py`, `scripts/blocksize.py`, `scripts/kernel.py`: the tables of sections 1, 2
      and 6 as text or JSON.
    - `mlxpaged bench`: throughput, concurrency and waste on a real model.
    """),
]


def build() -> nbformat.NotebookNode:
    nb = new_notebook(metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    })
    for i, (kind, source) in enumerate(CELLS):
        cell = new_markdown_cell(source) if kind == "markdown" else new_code_cell(source)
        cell["id"] = f"cell-{i:02d}"  # fixed ids: rebuilding gives the same file
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def main() -> None:
    nbformat.write(build(), OUT)
    print(f"wrote {OUT.relative_to(HERE.parent)} ({len(CELLS)} cells)")


if __name__ == "__main__":
    main()
