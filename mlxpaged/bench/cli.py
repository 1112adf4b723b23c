"""`mlxpaged bench`: the paper's measurements on this machine, each beside its peer, as JSON and plots."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import MlxPagedError

ROOT = Path(__file__).resolve().parents[2]




def _plot(path: Path, draw) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        click.echo("plot skipped: pip install 'mlxpaged[plot]' for matplotlib", err=True)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    draw(ax)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    click.echo(f"plot: {path.with_suffix('.png')}")


common = [
    click.option("--model", "-m", default=None, help="Checkpoint, .gguf or repo id (default: the offline model)."),
    click.option("--tiny", is_flag=True, help="A tiny random-weight Qwen2 instead (seconds, for a smoke run)."),
    click.option("--dtype", default="auto", show_default=True),
    click.option("--out", "out_dir", default="bench-results", show_default=True, help="Folder for the JSON (and PNG)."),
    click.option("--plot", is_flag=True, help="Also draw a PNG (needs matplotlib)."),
]


def with_common(f):
    for opt in reversed(common):
        f = opt(f)
    return f


@click.group()
def bench():
    """Benchmarks against peers in the same run; results as JSON named by machine, model and MLX version."""


@bench.command()
@with_common
@click.option("--concurrency", default="1,8,16,32", show_default=True, help="Prompts decoded at once.")
@click.option("--samples", default=8, show_default=True, help="n of the one-prompt run (0 skips it).")
@click.option("--max-tokens", default=64, show_default=True)
def throughput(model, tiny, dtype, out_dir, plot, concurrency, samples, max_tokens):
    """mlxpaged vs mlx-lm batch generation: tokens/s, time to first token, inter-token latency, memory."""
    from tqdm import tqdm

    from .models import load_models
    from .prompts import encode_chat, load_prompts
    from .report import write_result
    from .throughput import run_mlx_lm, run_mlxpaged

    try:
        levels = [int(c) for c in concurrency.split(",") if c]
        loaded, ref = load_models(model, tiny, dtype)
    except (MlxPagedError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    prompts = encode_chat(loaded.tokenizer, load_prompts(max(levels)))
    cases = [(f"concurrency {c}", prompts[:c], 1, 0.0) for c in levels]
    if samples:
        cases.append((f"1 prompt, n={samples}", prompts[:1], samples, 0.7))
    run_mlxpaged(loaded, prompts[:2], 4)
    run_mlx_lm(ref, prompts[:2], 4)
    rows = []
    for name, ps, n, temp in tqdm(cases, desc="throughput", file=sys.stderr):
        ours = run_mlxpaged(loaded, ps, max_tokens, n=n, temperature=temp)
        theirs = run_mlx_lm(ref, ps * n, max_tokens, temperature=temp)
        rows.append({"case": name, "mlxpaged": ours.as_dict(), "mlx_lm": theirs.as_dict(),
                     "ratio_output_tps": ours.output_tps / theirs.output_tps})
    click.echo(f"{'case':>18} | {'mlxpaged tok/s':>14} | {'mlx-lm tok/s':>12} | {'ratio':>5} | {'TTFT ms':>15} | "
               f"{'ITL ms':>13} | {'peak GB':>13}")
    for r in rows:
        a, b = r["mlxpaged"], r["mlx_lm"]
        click.echo(f"{r['case']:>18} | {a['output_tps']:14.1f} | {b['output_tps']:12.1f} | {r['ratio_output_tps']:5.2f} | "
                   f"{a['ttft_ms_median']:6.0f} / {b['ttft_ms_median']:6.0f} | {a['itl_ms_median']:5.1f} / {b['itl_ms_median']:5.1f} | "
                   f"{a['peak_memory_gb']:5.2f} / {b['peak_memory_gb']:5.2f}")
    path = write_result(out_dir, "throughput", loaded.path.name, {"max_tokens": max_tokens, "rows": rows})
    click.echo(f"results: {path}")
    if plot:
        def draw(ax):
            x = range(len(rows))
            ax.bar([i - 0.2 for i in x], [r["mlxpaged"]["output_tps"] for r in rows], 0.4, label="mlxpaged")
            ax.bar([i + 0.2 for i in x], [r["mlx_lm"]["output_tps"] for r in rows], 0.4, label="mlx-lm")
            ax.set_xticks(list(x), [r["case"] for r in rows], rotation=20)
            ax.set_ylabel("output tokens / s")
            ax.legend()
        _plot(path, draw)


@bench.command()
@with_common
@click.option("--trace", default="sharegpt", type=click.Choice(["sharegpt", "alpaca"]), show_default=True)
@click.option("--num-requests", default=400, show_default=True)
@click.option("--capacity", default=15_700, show_default=True, help="KV budget in token slots.")
@click.option("--block-size", default=16, show_default=True)
def concurrency(model, tiny, dtype, out_dir, plot, trace, num_requests, capacity, block_size):
    """Requests running at once in a fixed KV budget: the engine's allocator vs contiguous reservations."""
    from tqdm import tqdm

    from ..waste import load_pairs
    from .concurrency import contiguous_concurrency, engine_concurrency
    from .models import load_models
    from .report import write_result

    loaded, _ = load_models(model, tiny or model is None, dtype, reference=False)
    pairs = [(p, a) for p, a in load_pairs(ROOT / "scripts" / "data" / f"{trace}_lengths.json") if a > 0][:num_requests]
    with tqdm(total=len(pairs), desc="engine", unit="req", file=sys.stderr) as bar:
        paged = engine_concurrency(loaded, pairs, capacity=capacity, block_size=block_size, progress=bar.update)
    rows = [paged] + [contiguous_concurrency(pairs, s, capacity=capacity) for s in ("max", "pow2", "oracle")]
    for r in rows:
        click.echo(f"{r.scheme:>12}: real/reserved {100 * r.real_share:5.1f}%, running {r.saturated_running:6.1f} "
                   f"(saturated), ratio {paged.saturated_running / r.saturated_running:5.2f}")
    path = write_result(out_dir, f"concurrency-{trace}", loaded.path.name, {"capacity": capacity,
                                                                           "rows": [r.as_dict() for r in rows]})
    click.echo(f"results: {path}")
    if plot:
        def draw(ax):
            ax.bar([r.scheme for r in rows], [r.saturated_running for r in rows])
            ax.set_ylabel(f"requests running in {capacity} slots")
        _plot(path, draw)


@bench.command()
@click.option("--out", "out_dir", default="bench-results", show_default=True)
@click.option("--plot", is_flag=True)
@click.option("--block-size", default=16, show_default=True)
@click.option("--slots", default=15_700, show_default=True)
def waste(out_dir, plot, block_size, slots):
    """The paper's waste table on the ShareGPT and Alpaca traces."""
    from .. import waste as w
    from .report import write_result

    tables = {}
    for trace in ("sharegpt", "alpaca"):
        pairs = w.load_pairs(ROOT / "scripts" / "data" / f"{trace}_lengths.json")
        rows = w.waste_table(pairs, ("max", "pow2", "oracle"), block_size, w.WINDOW, slots)
        tables[trace] = [r.as_dict() for r in rows]
        seed = w.SEED_REAL_SHARE[trace]
        click.echo(f"{trace}:")
        for r in rows:
            key = "paged" if r.scheme.startswith("paged") else r.scheme
            s = f"{seed[key]:.1f}%" if key in seed and (key != "paged" or block_size == 16) else "-"
            click.echo(f"  {r.scheme:>9}: real/reserved {100 * r.real_share:5.1f}% (seed {s}), "
                       f"{r.requests_in_flight:6.1f} running in {slots} slots")
    path = write_result(out_dir, "waste", "traces", {"block_size": block_size, "slots": slots, "tables": tables})
    click.echo(f"results: {path}")
    if plot:
        def draw(ax):
            names = [r["scheme"] for r in tables["sharegpt"]]
            x = range(len(names))
            for k, (trace, rows) in enumerate(tables.items()):
                ax.bar([i + 0.4 * k - 0.2 for i in x], [100 * r["real_share"] for r in rows], 0.4, label=trace)
            ax.set_xticks(list(x), names)
            ax.set_ylabel("real tokens / reserved slots (%)")
            ax.legend()
        _plot(path, draw)


@bench.command()
@click.option("--out", "out_dir", default="bench-results", show_default=True)
@click.option("--plot", is_flag=True)
@click.option("--seqs", type=int, default=None, help="Sequences (default 16 on an Apple GPU, 4 emulated).")
@click.option("--tokens", type=int, default=None, help="Tokens each (default 4096 on an Apple GPU, 1024 emulated).")
@click.option("--max-block", default=256, show_default=True)
def kernel(out_dir, plot, seqs, tokens, max_block):
    """The Metal kernel by block size: time vs contiguous SDPA on a Mac, bytes read in the emulator elsewhere."""
    import os

    from ..attention import metal_native
    from .kernel import BLOCK_SIZES, emulator_rows, gpu_rows
    from .report import write_result

    gpu = metal_native() and os.environ.get("MLXPAGED_METAL") != "emulate"
    seqs = seqs or (16 if gpu else 4)
    tokens = tokens or (4096 if gpu else 1024)
    sizes = [b for b in BLOCK_SIZES if b <= max_block]
    from tqdm import tqdm

    if not gpu:
        click.echo("No Apple GPU: the emulator counts bytes read; timings need an Apple GPU.", err=True)
    measure = gpu_rows if gpu else emulator_rows
    rows = [r for bs in tqdm(sizes, desc="block sizes", file=sys.stderr) for r in measure(seqs, tokens, [bs])]
    key = "paged_over_sdpa" if gpu else "ratio"
    for r in rows:
        click.echo(f"block {r['block_size']:>3} {'scattered' if r['scattered'] else 'in order ':>9}: "
                   f"{key} {r[key]:.4f}, max error {r['max_error']:.2g}")
    path = write_result(out_dir, "kernel-gpu" if gpu else "kernel-emulator", "qwen2.5-1.5b-shapes",
                        {"seqs": seqs, "tokens": tokens, "rows": rows})
    click.echo(f"results: {path}")
    if plot:
        def draw(ax):
            for scattered in (False, True):
                rs = [r for r in rows if r["scattered"] == scattered]
                ax.plot([r["block_size"] for r in rs], [r[key] for r in rs], marker="o",
                        label="scattered" if scattered else "in order")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("block size (tokens)")
            ax.set_ylabel("paged / contiguous time" if gpu else "bytes read / minimum")
            ax.legend()
        _plot(path, draw)
