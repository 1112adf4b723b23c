"""Write ``paged_attention.ipynb`` from the cells below (the readable source of the notebook).

Edit this file, not the ``.ipynb``. The committed notebook carries the outputs of a run on the
offline Qwen2.5-Coder-0.5B (float32, CPU), so a visitor sees the figures without running it::

    python notebooks/build_notebook.py --execute              # the real model (a few minutes)
    python notebooks/build_notebook.py                        # cells only, no outputs
    python notebooks/build_notebook.py --execute --model tiny # quick check on the tiny model

``tests/test_notebooks.py`` checks the committed cells are this file's and executes a copy on the
tiny model (never writing it back).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from pathlib import Path
from textwrap import dedent

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
OUT = HERE / "paged_attention.ipynb"
CELL_TIMEOUT_S = 900  # the real model on two busy CPU cores


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

    Sections 1, 2 and 6 use tables (`mlxpaged.bench.waste`, `mlxpaged/data/*_lengths.json`,
    `scripts/kernel.py`'s output); sections 3 to 5 run the real engine
    (`notebooks/engine_runs.py`). The figures are drawn by `notebooks/figures_lib.py`, which
    `scripts/figures.py` also uses to write the PNGs under `docs/`.

    The saved outputs come from Qwen2.5-Coder-0.5B-Instruct in float32 on a CPU
    (`MLXPAGED_NOTEBOOK_MODEL=default`). Without that variable the engine runs a tiny
    random-weight Qwen2 written by `mlxpaged/tiny_model.py`, so the whole notebook runs in seconds;
    its text is gibberish, but the blocks, tables and counts depend only on how many tokens
    there are, so they are those a real model shows. `MLXPAGED_NOTEBOOK_MODEL` also takes a
    checkpoint directory, a `.gguf` file or a Hugging Face repo id.
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

    from mlxpaged.bench import waste
    from mlxpaged.data import TRACE_DIR
    from mlxpaged.loading.loader import load
    from mlxpaged.testing.tiny_model import write_tiny_qwen2


    def find_root() -> Path:
        \"\"\"The checkout: the figure code and the kernel tables live there, not in the package.\"\"\"
        for p in [Path.cwd(), *Path.cwd().parents]:
            if (p / "notebooks" / "figures_lib.py").is_file() and (p / "mlxpaged").is_dir():
                return p
        return Path(mlxpaged.__file__).resolve().parent.parent


    ROOT = find_root()
    NOTEBOOK_DATA = ROOT / "notebooks" / "data"
    sys.path.insert(0, str(ROOT / "notebooks"))
    import engine_runs
    import figures_lib

    MODEL = os.environ.get("MLXPAGED_NOTEBOOK_MODEL")
    if MODEL:
        loaded = load(None if MODEL == "default" else MODEL)  # "default": the offline Qwen2.5-Coder-0.5B
        model_name = engine_runs.model_label(loaded)
    else:
        # Kept in a variable: the directory is removed when the kernel exits.
        _tiny_dir = tempfile.TemporaryDirectory(prefix="mlxpaged-notebook-")
        loaded = load(str(write_tiny_qwen2(Path(_tiny_dir.name) / "tiny-qwen2")), "float32")
        model_name = "tiny random-weight Qwen2 (mlxpaged/tiny_model.py)"
    tok = loaded.tokenizer
    print(f"model: {model_name}, {loaded.dtype}")
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
    (`mlxpaged/data/*_lengths.json`, built by `scripts/lengths.py`).
    """),
    code("""
    TRACES = figures_lib.TRACE_NAMES
    pairs = {name: waste.load_pairs(TRACE_DIR / f"{name}_lengths.json") for name in TRACES}
    tables = {name: waste.waste_table(p, ("max", "pow2", "oracle"), block_size=16) for name, p in pairs.items()}

    for name, rows in tables.items():
        print(f"{TRACES[name]}: {len(pairs[name])} requests")
        for r in rows:
            print(f"  {r.scheme:<9} real/reserved {100 * r.real_share:5.1f}% "
                  f"(seed {figures_lib.seed_share(name, r.scheme):4.1f}%), "
                  f"{r.requests_in_flight:5.1f} requests at once in {waste.CAPACITY_SLOTS:,} slots")

    figures_lib.waste_figure(tables, {name: len(p) for name, p in pairs.items()})
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

    figures_lib.blocksize_figure(SIZES, paged, reuse, waste.SHARED_PREFIX)
    plt.show()
    """),  # noqa: E501 (a notebook cell's source: wrapping it would change the committed notebook)
    md("""
    ## 3. Two sequences, interleaved in one pool

    Two prompts go into one engine and decode together, one token each per step. Whenever a
    sequence fills its last block, the block manager hands it the next free block, whoever's
    neighbour that is, so the two tables interleave in the pool: neither sequence needs
    contiguous memory, and neither holds a slot it is not about to fill. Blocks of 4 tokens here,
    to show many blocks on a small grid; each cell is one pool block, labelled with its owner
    and its index in the owner's block table (`Sequence.block_ids` of
    `engine.live_sequences()`, recorded after every step by `engine_runs.interleaved`).
    """),
    code("""
    POOL3, BS3 = 32, 4
    snapshots = engine_runs.interleaved(loaded, block_size=BS3, num_blocks=POOL3, steps=40)

    shown = [min(snapshots), sorted(snapshots)[len(snapshots) // 2], max(snapshots)]
    for s in shown:
        print(f"step {s:>2}: " + "; ".join(f"{rid} -> {ids}" for rid, ids in snapshots[s].items()))
    last = snapshots[shown[-1]]
    assert not set(last["A"]) & set(last["B"]), "two live sequences never share a block here"

    figures_lib.pool_figure(snapshots, shown, POOL3, BS3)
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
    prompt4 = engine_runs.cow_prompt(tok, 44)
    N, MAX4 = 4, 64
    run4 = engine_runs.fork_n(loaded, prompt4, n=N, max_tokens=MAX4, block_size=16, num_blocks=64)

    st = run4.stats
    print(f"{len(prompt4)}-token prompt, {N} samples of {MAX4} tokens: {st['blocks_in_use_peak']} blocks in use at peak, "
          f"{st['blocks_without_sharing']} without sharing, {st['cow_copies']} copy-on-write copies")
    print(f"distinct samples: {len({tuple(t) for t in run4.samples})} of {N}")
    first, final = min(run4.tables), max(run4.tables)
    for s in (first, first + 1, final):
        print(f"step {s:>2}: " + " | ".join(" ".join(f"{b}" for b, _ in t) for t in run4.tables[s]))
    for i, ids in enumerate(run4.samples[:2]):
        print(f"sample {i}: {tok.decode(ids[:24])!r} ...")

    figures_lib.fork_figure(run4)
    plt.show()
    """),  # noqa: E501 (a notebook cell's source: wrapping it would change the committed notebook)
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
    prompts5 = engine_runs.prefix_prompts(tok, loaded.model.args.vocab_size, length=96, shared=waste.SHARED_PREFIX)
    cached = engine_runs.prefix_reuse(loaded, prompts5, block_size=16)
    for rid, ids in prompts5.items():
        print(f"{rid}: {len(ids)} prompt tokens, {cached[rid]} reused from the prefix cache")
    print(f"waste.prefix_reuse({waste.SHARED_PREFIX}, 16) = {waste.prefix_reuse(waste.SHARED_PREFIX, 16)}")

    figures_lib.prefix_figure(prompts5, cached, waste.SHARED_PREFIX, 16)
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
        rows6 = kernel_rows(found[0])
        timed = "paged_ms" in rows6[0]
        print(f"from {found[0].relative_to(ROOT)}:")
        for r in sorted(rows6, key=lambda r: (r["scattered"], r["block_size"])):
            layout = "scattered" if r["scattered"] else "in order"
            cost = f"{r['paged_ms']:.3f} ms vs SDPA {r['sdpa_ms']:.3f} ms" if timed else f"bytes read {r['ratio']:.4f}x the minimum"
            print(f"  block {r['block_size']:>3} {layout:>9}: {cost}, max error {r['max_error']:.2g}")
        figures_lib.kernel_figure(rows6)
        plt.show()
    """),  # noqa: E501 (a notebook cell's source: wrapping it would change the committed notebook)
    md("""
    ### What the kernel computes per token

    On Linux the emulator also counts the operations that bound a compute-bound decode kernel,
    per K/V token row (one token of one KV head): SIMD reductions (`simd_sum`/`simd_max`, about
    5 shuffle-and-add steps each) and shuffles, which together give the shuffle steps; `exp2`
    calls (SIMD-wide, per token and query head); threadgroup barriers per 256 tokens (all, and
    those of the token loop alone); device loads by width in bytes; and the register estimate
    per thread. The shapes are Qwen2.5-0.5B's (7 query heads per KV head, head_dim 64) and
    Qwen2.5-7B's (7, 128), fp16 KV, one pass over 2 sequences x 1,000 tokens:
    `python scripts/kernel.py --cost --json > notebooks/data/kernel_cost.json`. Lanes form
    sub-groups of head_dim/8, one token each; a token's 7 scores are summed over its sub-group
    and handed back by one butterfly (no `simd_sum`): 3.5 shuffle steps per token at head_dim 64
    and 7.5 at 128, where 7 `simd_sum`s took 35.
    """),
    code("""
    cost_path = NOTEBOOK_DATA / "kernel_cost.json"
    if not cost_path.exists():
        print("no cost table in notebooks/data: run scripts/kernel.py --cost --json (see above)")
    else:
        cost = json.loads(cost_path.read_text())
        print(f"from {cost_path.relative_to(ROOT)} ({cost['seqs']} sequences x {cost['tokens']} tokens):")
        print(f"{'model':>13} {'G':>2} {'hd':>4} {'reductions':>10} {'shuffles':>8} {'steps':>6} "
              f"{'exp2/head':>9} {'barriers':>8} {'loop':>5} {'regs':>4}  loads by width")
        for r in cost["rows"]:
            steps = 5 * r["simd_reductions_per_token"] + r["simd_shuffles_per_token"]
            loads = " ".join(f"{w}B:{n:.2f}" for w, n in r["device_loads_per_token"].items())
            print(f"{r['model']:>13} {r['group']:>2} {r['head_dim']:>4} "
                  f"{r['simd_reductions_per_token']:>10.2f} {r['simd_shuffles_per_token']:>8.2f} {steps:>6.2f} "
                  f"{r['exp_per_token_head']:>9.3f} {r['barriers_per_256_tokens']:>8.2f} "
                  f"{r['loop_barriers_per_256_tokens']:>5.2f} {r['registers']:>4}  {loads}")
        print("per K/V token row; exp2 per token and query head; barriers per 256 tokens")
    """),
    md("""
    ## Where to look next

    - `mlxpaged/block_pool.py` and `mlxpaged/block_manager.py`: the allocator behind sections 3 to 5.
    - `scripts/waste.py`, `scripts/blocksize.py`, `scripts/kernel.py`: the tables of sections 1, 2
      and 6 as text or JSON.
    - `scripts/figures.py`: these figures, and mlxpaged against mlx-lm, as PNGs under `docs/`.
    - `mlxpaged bench`: throughput, concurrency and waste on a real model.
    """),
]


def build() -> nbformat.NotebookNode:
    nb = new_notebook(
        metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python"},
        }
    )
    for i, (kind, source) in enumerate(CELLS):
        cell = new_markdown_cell(source) if kind == "markdown" else new_code_cell(source)
        cell["id"] = f"cell-{i:02d}"  # fixed ids: rebuilding gives the same file
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def sources_digest(nb: nbformat.NotebookNode) -> str:
    """A hash of the cells' kinds and sources: the executed notebook records the one it ran."""
    text = "\0".join(f"{c.cell_type}\0{c.source}" for c in nb.cells)
    return hashlib.sha256(text.encode()).hexdigest()


def execute(nb: nbformat.NotebookNode, model: str | None, timeout: int = CELL_TIMEOUT_S) -> nbformat.NotebookNode:
    """Run every cell of ``nb`` in place (cwd = notebooks/) on ``model`` (None: the tiny model)."""
    from nbclient import NotebookClient

    env = {k: v for k, v in os.environ.items() if k != "MLXPAGED_NOTEBOOK_MODEL"}
    if model:
        env["MLXPAGED_NOTEBOOK_MODEL"] = model
    # No timing metadata: re-running changes only what the cells print and draw.
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", record_timing=False, resources={"metadata": {"path": str(HERE)}}
    )
    client.execute(env=env)
    return nb


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--execute", action="store_true", help="run the cells and save their outputs")
    ap.add_argument(
        "--model",
        default="default",
        help="with --execute: 'default' (offline Qwen2.5-Coder-0.5B), 'tiny', or a path / repo id",
    )
    ap.add_argument("--out", type=Path, default=OUT, help="where to write the notebook")
    args = ap.parse_args(argv)
    nb = build()
    if args.execute:
        from nbclient.exceptions import CellExecutionError

        try:
            execute(nb, None if args.model == "tiny" else args.model)
            nb.metadata["mlxpaged"] = {"executed_sources_sha256": sources_digest(nb)}
        except CellExecutionError as e:
            last = re.sub(r"\x1b\[[0-9;]*m", "", str(e).strip().splitlines()[-1])  # no terminal colors
            print(f"error: a cell failed: {last}", file=sys.stderr)
            return 1
    nbformat.write(nb, args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({len(CELLS)} cells, {'executed, ' if args.execute else ''}{size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
