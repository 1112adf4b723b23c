"""`mlxpaged bench`: the paper's measurements on this machine, each beside its peer, as JSON and plots."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

from ..errors import MlxPagedError


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


def _out_dir(ctx, param, value: str) -> str:
    """The results' folder, made now: a folder that cannot be written ends the command in one line
    before the benchmark runs, not with a traceback after it."""
    try:
        Path(value).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=value):
            pass
    except OSError as e:
        click.echo(f"error: cannot write results to {value}: {e.strerror}", err=True)
        sys.exit(1)
    return value


def out_option(**kw):
    return click.option("--out", "out_dir", default="bench-results", show_default=True, callback=_out_dir, **kw)


common = [
    click.option("--model", "-m", default=None, help="Checkpoint, .gguf or repo id (default: the offline model)."),
    click.option("--tiny", is_flag=True, help="A tiny random-weight Qwen2 instead (seconds, for a smoke run)."),
    click.option("--dtype", default="auto", show_default=True),
    out_option(help="Folder for the JSON (and PNG)."),
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
@click.option("--repeats", default=3, show_default=True, help="Runs of each case, alternating which system goes first.")
def throughput(model, tiny, dtype, out_dir, plot, concurrency, samples, max_tokens, repeats):
    """mlxpaged vs mlx-lm batch generation: tokens/s, time to first token, inter-token latency, memory."""
    from tqdm import tqdm

    from .models import load_models, model_label
    from .report import write_result
    from .throughput import benchmark, parse_levels, table

    try:
        levels = parse_levels(concurrency, "--concurrency")
        loaded, ref = load_models(model, tiny, dtype)
        with tqdm(total=len(levels) + bool(samples), desc="throughput", file=sys.stderr) as bar:
            payload = benchmark(
                loaded,
                ref,
                levels=levels,
                samples=samples,
                temperature=0.7,
                max_tokens=max_tokens,
                repeats=repeats,
                progress=bar.update,
            )
    except (MlxPagedError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    rows = payload["rows"]
    click.echo("\n".join(table(rows)))
    click.echo(payload["timed_span"])
    path = write_result(out_dir, "throughput", model_label(loaded, model, tiny), payload)
    click.echo(f"results: {path}")
    if plot:

        def draw(ax):
            x = range(len(rows))
            for dx, key, label in ((-0.2, "mlxpaged_output_tps", "mlxpaged"), (0.2, "mlx_lm_output_tps", "mlx-lm")):
                med = [r[key]["median"] for r in rows]
                err = [[m - r[key]["min"] for m, r in zip(med, rows)], [r[key]["max"] - m for m, r in zip(med, rows)]]
                ax.bar([i + dx for i in x], med, 0.4, yerr=err, capsize=3, label=label)
            ax.set_xticks(list(x), [r["case"] for r in rows], rotation=20)
            ax.set_ylabel(f"output tokens / s (median, min-max of {repeats})")
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

    from ..data import load_trace
    from .concurrency import compare, headline, table
    from .models import load_models, model_label
    from .report import write_result

    try:
        loaded, _ = load_models(model, tiny or model is None, dtype, reference=False)
    except (MlxPagedError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    pairs = [(p, a) for p, a in load_trace(trace) if a > 0][:num_requests]
    try:
        with tqdm(total=len(pairs), desc="engine", unit="req", file=sys.stderr) as bar:
            rows = compare(loaded, pairs, capacity=capacity, block_size=block_size, progress=bar.update)
    except (MlxPagedError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    click.echo("\n".join(table(rows)))
    path = write_result(
        out_dir,
        f"concurrency-{trace}",
        model_label(loaded, model, tiny or model is None),
        {
            "capacity": capacity,
            "block_size": block_size,
            "num_requests": len(pairs),
            "rows": [r.as_dict() for r in rows],
            "headline_vs_oracle": headline(rows),
        },
    )
    click.echo(f"results: {path}")
    if plot:

        def draw(ax):
            ax.bar([r.scheme for r in rows], [r.saturated_running for r in rows])
            ax.set_ylabel(f"requests running in {capacity} slots")

        _plot(path, draw)


@bench.command()
@with_common
@click.option("--num-prompts", default=32, show_default=True, help="Real prompts per data set.")
@click.option("--max-tokens", default=128, show_default=True, help="Cap on each answer.")
@click.option("--widths", default="2,4,6", show_default=True, help="n of parallel sampling and beam widths.")
@click.option("--datasets", default="alpaca,sharegpt", show_default=True)
@click.option("--modes", default="parallel,beam", show_default=True)
def sharing(model, tiny, dtype, out_dir, plot, num_prompts, max_tokens, widths, datasets, modes):
    """Memory saved by sharing blocks (parallel sampling, beam search) beside the paper's §6.3."""
    from tqdm import tqdm

    from .models import load_models, model_label
    from .report import write_result
    from .sharing import PAPER, run, table

    try:
        ws = [int(w) for w in widths.split(",")]
        ds, ms = datasets.split(","), modes.split(",")
        bad = [m for m in ms if m not in ("parallel", "beam")] + [d for d in ds if d not in ("alpaca", "sharegpt")]
        if bad or not ws or min(ws) < 1:
            raise ValueError(f"bad --modes/--datasets/--widths: {bad or widths}")
        loaded, _ = load_models(model, tiny, dtype, reference=False)
        with tqdm(total=len(ds) * len(ms) * len(ws), desc="sharing", file=sys.stderr) as bar:
            rows = run(loaded, ds, ms, ws, num_prompts, max_tokens, on_row=lambda _: bar.update())
    except (MlxPagedError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    click.echo(table(rows))
    path = write_result(out_dir, "sharing", model_label(loaded, model, tiny), {"rows": rows})
    click.echo(f"results: {path}")
    if plot:
        _plot(path, lambda ax: draw_sharing(ax, rows, PAPER))


def draw_sharing(ax, rows: list[dict], paper: dict) -> None:
    """Measured memory saved per width, one line per (data set, mode), the paper's range shaded."""
    colors = {"alpaca": "tab:blue", "sharegpt": "tab:orange"}
    for (mode, ds), (lo, hi) in paper.items():
        rs = sorted((r for r in rows if r["mode"] == mode and r["dataset"] == ds), key=lambda r: r["width"])
        if not rs:
            continue
        style = "-" if mode == "beam" else "--"
        ax.plot(
            [r["width"] for r in rs],
            [r["memory_saved_pct"] for r in rs],
            style,
            marker="o",
            color=colors[ds],
            label=f"{ds}, {mode} (measured)",
        )
        ax.axhspan(lo, hi, color=colors[ds], alpha=0.08 if mode == "parallel" else 0.16)
    ax.set_xticks(sorted({r["width"] for r in rows}))
    ax.set_xlabel("parallel samples n / beam width")
    ax.set_ylabel("memory saved by sharing (%)")
    ax.set_title("shaded: the paper's ranges (OPT-13B); light = parallel, dark = beam", fontsize=9)
    ax.legend(fontsize=8)


@bench.command()
@out_option()
@click.option("--plot", is_flag=True)
@click.option("--block-size", default=16, show_default=True)
@click.option("--slots", default=15_700, show_default=True)
def waste(out_dir, plot, block_size, slots):
    """The paper's waste table on the ShareGPT and Alpaca traces."""
    from ..data import TRACES, trace_path
    from . import waste as w
    from .report import write_result

    tables = {}
    for trace in TRACES:
        pairs = w.load_pairs(trace_path(trace))
        rows = w.waste_table(pairs, ("max", "pow2", "oracle"), block_size, w.WINDOW, slots)
        tables[trace] = [r.as_dict() for r in rows]
        seed = w.SEED_REAL_SHARE[trace]
        click.echo(f"{trace}:")
        for r in rows:
            key = "paged" if r.scheme.startswith("paged") else r.scheme
            s = f"{seed[key]:.1f}%" if key in seed and (key != "paged" or block_size == 16) else "-"
            click.echo(
                f"  {r.scheme:>9}: real/reserved {100 * r.real_share:5.1f}% (seed {s}), "
                f"{r.requests_in_flight:6.1f} running in {slots} slots"
            )
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
@out_option()
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
        click.echo(
            f"block {r['block_size']:>3} {'scattered' if r['scattered'] else 'in order ':>9}: "
            f"{key} {r[key]:.4f}, max error {r['max_error']:.2g}"
        )
    path = write_result(
        out_dir,
        "kernel-gpu" if gpu else "kernel-emulator",
        "qwen2.5-1.5b-shapes",
        {"seqs": seqs, "tokens": tokens, "rows": rows},
    )
    click.echo(f"results: {path}")
    if plot:

        def draw(ax):
            for scattered in (False, True):
                rs = [r for r in rows if r["scattered"] == scattered]
                ax.plot(
                    [r["block_size"] for r in rs],
                    [r[key] for r in rs],
                    marker="o",
                    label="scattered" if scattered else "in order",
                )
            ax.set_xscale("log", base=2)
            ax.set_xlabel("block size (tokens)")
            ax.set_ylabel("paged / contiguous time" if gpu else "bytes read / minimum")
            ax.legend()

        _plot(path, draw)


from .http import add_command as _add_serve_bench  # noqa: E402  (`mlxpaged bench serve`: HTTP, vs mlx_lm.server)

_add_serve_bench(bench, with_common, _plot)


@bench.command("prefix-disk")
@with_common
@click.option("--prefix-tokens", default=2000, show_default=True, help="Tokens of the shared prefix.")
@click.option("--question-tokens", default=50, show_default=True, help="Tokens of each run's own question.")
@click.option(
    "--repeats", default=3, show_default=True, help="Runs of each case (cold, warm, disk), alternating the order."
)
@click.option("--store-dir", default=None, help="Directory of the disk tier (default: a new temporary one).")
def prefix_disk(model, tiny, dtype, out_dir, plot, prefix_tokens, question_tokens, repeats, store_dir):
    """Time to first token of a long prefix: cold, warm in memory, after a restart from --prefix-cache-dir."""
    from tqdm import tqdm

    from .models import load_models, model_label
    from .prefix_disk import benchmark, table
    from .report import write_result

    try:
        loaded, _ = load_models(model, tiny, dtype, reference=False)
        with tqdm(total=3 * repeats, desc="prefix-disk", file=sys.stderr) as bar:
            payload = benchmark(
                loaded,
                prefix_tokens=prefix_tokens,
                question_tokens=question_tokens,
                repeats=repeats,
                store_dir=store_dir,
                progress=bar.update,
            )
    except (MlxPagedError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    click.echo("\n".join(table(payload)))
    path = write_result(out_dir, "prefix-disk", model_label(loaded, model, tiny), payload)
    click.echo(f"results: {path}")


from .spec import add_command as _add_spec_bench  # noqa: E402  (`mlxpaged bench spec`: speculative decoding)

_add_spec_bench(bench, with_common, _plot)
