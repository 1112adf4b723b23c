"""The walkthrough's figures: one function per figure, from data to a matplotlib ``Figure``.

The single home of the drawing code: ``paged_attention.ipynb`` shows these figures inline and
``scripts/figures.py`` saves them as PNGs under ``docs/``. A function only draws: it takes data
already computed (``mlxpaged.bench.waste`` rows, ``engine_runs`` records, benchmark JSON) and
returns the figure without showing or saving it, so either caller decides what to do with it.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from mlxpaged.bench import waste

TRACE_NAMES = {"sharegpt": "ShareGPT", "alpaca": "Alpaca"}
OURS, PEER = "tab:blue", "0.6"  # mlxpaged and mlx-lm in the benchmark figure


def seed_share(trace: str, scheme: str) -> float:
    """The seed design doc's real/reserved share (%) for a scheme (``paged-16`` -> ``paged``)."""
    return waste.SEED_REAL_SHARE[trace]["paged" if scheme.startswith("paged") else scheme]


def draw_grid(ax, kinds, labels, colors, title):
    """Cells colored by ``kinds`` (ints indexing ``colors``), with ``labels`` written in them."""
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


def waste_figure(tables: dict, num_requests: dict):
    """Real tokens / reserved slots by scheme, ours beside the seed's; ``tables``: trace -> WasteRows."""
    fig, axes = plt.subplots(1, len(tables), figsize=(11, 3.8), sharey=True, squeeze=False)
    for ax, (name, rows) in zip(axes[0], tables.items()):
        x = np.arange(len(rows))
        ours = ax.bar(x - 0.2, [100 * r.real_share for r in rows], 0.4, label="ours (mlxpaged.bench.waste)")
        seed = ax.bar(x + 0.2, [seed_share(name, r.scheme) for r in rows], 0.4, color="0.75", label="seed design doc")
        ax.bar_label(ours, fmt="%.1f", fontsize=8)
        ax.bar_label(seed, fmt="%.1f", fontsize=8, color="0.4")
        ax.set_xticks(x, [r.scheme for r in rows])
        ax.set_xlabel("reservation scheme")
        ax.set_ylim(0, 110)
        ax.set_title(f"{TRACE_NAMES.get(name, name)} ({num_requests[name]:,} requests)")
    axes[0][0].set_ylabel("real tokens / reserved slots (%)")
    axes[0][0].legend(loc="upper left", fontsize=8)
    fig.suptitle("KV slots holding a token, by reservation scheme (higher is better)")
    fig.tight_layout()
    return fig


def blocksize_figure(sizes: list[int], paged: dict, reuse: list[int], shared: int):
    """Waste, table length and prefix reuse by block size; ``paged``: trace -> paged WasteRow per size."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, rows in paged.items():
        axes[0].plot(sizes, [100 * r.real_share for r in rows], "o-", label=TRACE_NAMES.get(name, name))
        axes[1].plot(sizes, [r.blocks_per_request for r in rows], "o-", label=TRACE_NAMES.get(name, name))
    axes[2].step(sizes, reuse, "o-", where="post", color="tab:green", label="reusable (full blocks only)")
    axes[2].axhline(shared, color="0.6", linestyle=":", label=f"whole prefix ({shared})")
    axes[0].set_ylabel("real tokens / reserved slots (%)")
    axes[1].set_ylabel("blocks per running request")
    axes[1].set_yscale("log")
    axes[2].set_ylabel(f"prefix tokens reusable (of {shared})")
    titles = ["memory used by real tokens", "block-table length", f"reuse of a {shared}-token system prompt"]
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("block size (tokens)")
        ax.axvline(16, color="0.85", zorder=0)  # the default
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("Block size: memory waste against table length and prefix sharing (grey line: default 16)")
    fig.tight_layout()
    return fig


def pool_figure(snapshots: dict, shown: list[int], num_blocks: int, block_size: int, columns: int = 8):
    """The pool's blocks colored by owner at the ``shown`` steps; ``snapshots``: step -> {label: block ids}."""
    owners = sorted({label for tables in snapshots.values() for label in tables})
    colors = ["0.92", "tab:blue", "tab:orange", "tab:green", "tab:red"][: len(owners) + 1]
    fig, axes = plt.subplots(1, len(shown), figsize=(4.3 * len(shown), 2.9), squeeze=False)
    for ax, s in zip(axes[0], shown):
        kinds, labels = np.zeros(num_blocks, int), np.full(num_blocks, "", dtype=object)
        for label, ids in snapshots[s].items():
            for logical, block in enumerate(ids):
                kinds[block], labels[block] = owners.index(label) + 1, f"{label}{logical}"
        used = sum(map(len, snapshots[s].values()))
        draw_grid(
            ax,
            kinds.reshape(-1, columns),
            labels.reshape(-1, columns),
            colors,
            f"after step {s}: {used} of {num_blocks} blocks in use",
        )
        ax.set_xticks(range(columns), range(columns))
        ax.set_yticks(range(num_blocks // columns), [f"{columns * r}" for r in range(num_blocks // columns)])
        ax.set_xlabel("pool block id (row start + column)")
    axes[0][0].set_ylabel("row start")
    handles = [Patch(color=c, label=f"sequence {o}") for c, o in zip(colors[1:], owners)]
    fig.legend(
        handles=handles + [Patch(color=colors[0], label="free")],
        loc="lower center",
        ncol=len(owners) + 1,
        fontsize=8,
        bbox_to_anchor=(0.5, -0.14),
    )
    fig.suptitle(
        f"Two sequences decoded together, interleaved in one pool ({num_blocks} blocks of {block_size} "
        "tokens; label = owner and index in its block table)",
        y=1.02,
    )
    fig.tight_layout()
    return fig


# Kinds of block-table entry in the copy-on-write figure.
KIND_COLORS = ["tab:purple", "tab:orange", "tab:olive", "tab:green", "1.0"]
KIND_NAMES = ["shared (ref count > 1)", "copy-on-write copy", "prompt block kept (ref count fell to 1)", "own block"]


def fork_figure(run):
    """The n samples' block tables after the prefill and at the end, and blocks in use per step."""
    first, final = min(run.tables), max(run.tables)
    partial = len(run.prompt) // run.block_size  # table index of the partly filled prompt block
    prompt_block = run.tables[first][0][partial][0]

    def kind(index, block, ref):
        if ref > 1:
            return 0
        if index == partial:
            return 2 if block == prompt_block else 1
        return 3

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.2), gridspec_kw={"width_ratios": [1, 1, 1.3]})
    width = max(len(t) for t in run.tables[final])
    for ax, s, what in ((axes[0], first, "after the prefill"), (axes[1], final, "at the last step")):
        kinds = np.full((run.n, width), 4)
        labels = np.full((run.n, width), "", dtype=object)
        for row, table in enumerate(run.tables[s]):
            for i, (block, ref) in enumerate(table):
                kinds[row, i], labels[row, i] = kind(i, block, ref), str(block)
        draw_grid(ax, kinds, labels, KIND_COLORS, f"block tables {what} (step {s})")
        ax.set_yticks(range(run.n), [f"sample {i}" for i in range(run.n)] if ax is axes[0] else [])
        ax.set_xticks(range(width), range(width))
        ax.set_xlabel("index in the block table (cell: pool block id)")
    axes[0].legend(
        handles=[Patch(color=c, label=n) for c, n in zip(KIND_COLORS, KIND_NAMES)],
        loc="upper center",
        bbox_to_anchor=(1.1, -0.4),
        ncol=4,
        fontsize=8,
    )

    steps, used, unshared = zip(*run.history)
    st = run.stats
    axes[2].plot(steps, unshared, label="without sharing (sum of table lengths)", color="0.5")
    axes[2].plot(steps, used, label="in use (shared blocks counted once)", color="tab:purple")
    axes[2].annotate(
        f"peak {st['blocks_in_use_peak']} vs {st['blocks_without_sharing']}",
        (steps[-1], used[-1]),
        xytext=(-90, 25),
        textcoords="offset points",
        arrowprops={"arrowstyle": "->"},
    )
    axes[2].set_xlabel("engine step")
    axes[2].set_ylabel(f"blocks of {run.block_size} tokens")
    axes[2].legend(fontsize=8)
    axes[2].set_title(f"{run.n} samples: blocks in use", fontsize=10)
    fig.suptitle(
        f"Copy-on-write: {run.n} samples of one {len(run.prompt)}-token prompt share its blocks "
        f"({st['cow_copies']} copies of the partly filled block)",
        y=1.03,
    )
    return fig


def prefix_figure(prompts: dict, cached: dict, shared: int, block_size: int):
    """Prompt tokens reused from the prefix cache, per request, with block boundaries."""
    fig, ax = plt.subplots(figsize=(9, 2.4))
    names = list(prompts)[::-1]
    hits = [cached[n] for n in names]
    ax.barh(names, hits, color="tab:green", label="reused from the prefix cache")
    ax.barh(names, [len(prompts[n]) - h for n, h in zip(names, hits)], left=hits, color="0.75", label="computed")
    ax.axvline(shared, color="tab:red", linestyle=":", label=f"B leaves A after {shared} tokens")
    longest = max(map(len, prompts.values()))
    for x in range(block_size, longest, block_size):
        ax.axvline(x, color="white", linewidth=1)
    ax.set_xlabel(f"prompt tokens (white lines: blocks of {block_size})")
    ax.set_ylabel("request")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title("Prefix cache: prompt tokens reused per request", fontsize=10)
    fig.tight_layout()
    return fig


def kernel_figure(rows: list[dict]):
    """``scripts/kernel.py --json`` rows: time per call (Mac) or bytes read / minimum (emulator), and error."""
    timed = "paged_ms" in rows[0]  # a GPU run; the emulator counts bytes instead
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for scattered, style in ((False, "o-"), (True, "s--")):
        rs = sorted((r for r in rows if r["scattered"] == scattered), key=lambda r: r["block_size"])
        bs = [r["block_size"] for r in rs]
        layout = "scattered" if scattered else "in order"
        if timed:
            axes[0].plot(bs, [r["paged_ms"] for r in rs], style, label=f"paged kernel, {layout}")
            axes[0].plot(bs, [r["sdpa_ms"] for r in rs], style, color="0.6", label=f"contiguous SDPA ({layout} run)")
        else:
            axes[0].plot(bs, [r["ratio"] for r in rs], style, color="tab:blue", label=f"chosen path, {layout}")
            if "single_pass_ratio" in rs[0]:  # newer tables also run the one-pass kernel
                axes[0].plot(
                    bs, [r["single_pass_ratio"] for r in rs], style, color="tab:orange", label=f"single pass, {layout}"
                )
            axes[0].set_ylim(1.0, max(1.05, 1.01 * max(r["ratio"] for r in rows)))  # 1 = the minimum
        axes[1].plot(bs, [r["max_error"] for r in rs], style, label=layout)
    axes[0].set_ylabel("milliseconds per call" if timed else "bytes read / minimum")
    axes[0].set_title("time per call (Apple GPU)" if timed else "bytes read by the emulated kernel", fontsize=10)
    axes[1].set_ylabel("max |kernel - reference|")
    axes[1].set_yscale("log")
    axes[1].set_title("error against the pure-MLX reference", fontsize=10)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(s) for s in bs])
        ax.set_xlabel("block size (tokens)")
        ax.legend(fontsize=8)
    fig.suptitle(
        "The Metal paged-attention kernel by block size, "
        + ("timed on an Apple GPU" if timed else "run by the MSL emulator (no Apple GPU here)")
    )
    fig.tight_layout()
    return fig


# -- benchmark JSON (scripts/bench_decode.py / bench_serving.py --json) --------------------------------
def measure(side, key: str) -> tuple[float, float, float] | None:
    """(median, min, max) of ``key`` in one system's result, or None.

    Accepts a plain number, ``{"median", "min", "max"}``, ``key_median`` / ``key_min`` /
    ``key_max`` fields, or a list of repeats (under ``repeats`` / ``runs``, or the side itself).
    """
    if isinstance(side, list):
        vals = [m[0] for m in (measure(s, key) for s in side) if m]
        return (statistics.median(vals), min(vals), max(vals)) if vals else None
    if not isinstance(side, dict):
        return None
    v = side.get(key)
    if isinstance(v, (int, float)):
        return float(v), float(side.get(f"{key}_min", v)), float(side.get(f"{key}_max", v))
    if isinstance(v, dict) and "median" in v:
        return float(v["median"]), float(v.get("min", v["median"])), float(v.get("max", v["median"]))
    if f"{key}_median" in side:
        med = side[f"{key}_median"]
        return float(med), float(side.get(f"{key}_min", med)), float(side.get(f"{key}_max", med))
    for repeats in ("repeats", "runs"):
        if isinstance(side.get(repeats), list):
            return measure(side[repeats], key)
    return None


def bench_rows(doc) -> list[dict]:
    """The per-case rows of a benchmark JSON document (a list, or a dict holding one)."""
    if isinstance(doc, list):
        return doc
    for k in ("rows", "runs", "results", "cases"):
        if isinstance(doc.get(k), list):
            return doc[k]
    return []


SYSTEMS = {"mlxpaged": ("mlxpaged", "ours"), "mlx_lm": ("mlx_lm", "mlx-lm", "peer", "theirs")}


def row_measure(row: dict, system: str, key: str) -> tuple[float, float, float] | None:
    """(median, min, max) of ``key`` for ``system`` ("mlxpaged" or "mlx_lm") in one benchmark row.

    Finds ``row[system][key]``, ``row[f"{system}_{key}"]``, ``row[key][system]``, or else the
    ``runs`` (repeats) each holding ``{system: {key: ...}}``.
    """
    for name in SYSTEMS[system]:
        for found in (
            {key: row.get(f"{name}_{key}")},
            {key: row[key].get(name)} if isinstance(row.get(key), dict) else None,
            row.get(name),
        ):
            m = measure(found, key) if found else None
            if m:
                return m
    if isinstance(row.get("runs"), list):
        return measure([r.get(n) for r in row["runs"] for n in SYSTEMS[system] if isinstance(r, dict) and n in r], key)
    return None


def _paired_bars(ax, rows: list[dict], key: str, fmt: str):
    """mlxpaged vs mlx-lm bars per case with min-max whiskers; above each pair the median ratio
    (the row's ``ratio_{key}`` or ``ratio[key]``, formed within each repeat, else the ratio of the medians)."""
    cases, ours, theirs, ratios = [], [], [], []
    for r in rows:
        a, b = row_measure(r, "mlxpaged", key), row_measure(r, "mlx_lm", key)
        if a and b:
            cases.append(str(r.get("case") or r.get("run") or r.get("name") or len(cases)))
            ours.append(a)
            theirs.append(b)
            within = measure({key: r.get(f"ratio_{key}")}, key) or measure(r.get("ratio"), key)
            ratios.append(within[0] if within else a[0] / b[0] if b[0] else None)
    x = np.arange(len(cases))
    for dx, vals, color, label in ((-0.2, ours, OURS, "mlxpaged"), (0.2, theirs, PEER, "mlx-lm")):
        med = np.array([v[0] for v in vals])
        err = np.array([[v[0] - v[1] for v in vals], [v[2] - v[0] for v in vals]])
        bars = ax.bar(x + dx, med, 0.4, color=color, label=label, yerr=err if err.any() else None, capsize=3)
        ax.bar_label(bars, fmt=fmt, fontsize=7, padding=2)
    for i, (a, b, ratio) in enumerate(zip(ours, theirs, ratios)):
        if ratio is not None:
            ax.annotate(
                f"{ratio:.2f}x",
                (x[i], max(a[2], b[2])),
                xytext=(0, 16),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                weight="bold",
            )
    ax.set_xticks(x, [c.replace(", ", "\n") for c in cases], fontsize=8)
    ax.margins(y=0.25)
    return len(cases)


def bench_figure(decode: dict | list | None, serving: dict | list | None):
    """Throughput and memory of mlxpaged against mlx-lm, from whichever benchmark JSON is given."""
    panels = [
        (doc, title)
        for doc, title in (
            (decode, "batch decode (scripts/bench_decode.py)"),
            (serving, "serving replay (scripts/bench_serving.py)"),
        )
        if doc
    ]
    if not panels:
        raise ValueError("no benchmark JSON to plot")
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 4.2 * len(panels)), squeeze=False)
    for (doc, title), (ax_tps, ax_mem) in zip(panels, axes):
        rows = bench_rows(doc)
        if not _paired_bars(ax_tps, rows, "output_tps", "%.1f"):
            raise ValueError(f"{title}: no rows with output_tps for both systems")
        _paired_bars(ax_mem, rows, "peak_memory_gb", "%.3f")
        ax_tps.set_ylabel("output tokens / s")
        ax_tps.set_title(f"{title}\nthroughput, higher is better (ratio = ours / mlx-lm)", fontsize=10)
        ax_mem.set_ylabel("peak memory above the weights (GB)")
        ax_mem.set_title(f"{title}\nKV cache + activations, lower is better (ratio = ours / mlx-lm)", fontsize=10)
        ax_tps.legend(fontsize=8, loc="upper left")
    model = next((Path(str(d["model"])).name for d, _ in panels if isinstance(d, dict) and d.get("model")), None)
    fig.suptitle(
        "mlxpaged against mlx-lm, same weights, same process"
        + (f" ({model})" if model else "")
        + "; bars: median, whiskers: min-max",
        fontsize=11,
    )
    fig.tight_layout()
    return fig
