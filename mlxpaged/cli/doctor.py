"""`mlxpaged doctor`: what a bug report about the Metal kernel needs, printed and saved as JSON.

Reports the MLX version, the device (`mx.metal.device_info()` when Metal is available), the
GPU cores the split planner assumes and its partitions, the attention implementation `impl="auto"` picks at
Qwen2.5-0.5B shapes, each kernel shape
family's startup checks (`metal.check_family` for the decode kernels, `metal_varlen.check_varlen`
for the prefill/varlen kernel: built, run and compared with the reference), and
a small kernel table: on an Apple GPU, the kernel's time against contiguous SDPA (many launches
per `mx.eval`) in GB/s; elsewhere the kernels run in the MSL emulator, which says so and gives
bytes read against the minimum and the cost model's operation counts instead of timings.
Invariant: a failed check is reported, never raised (the user's engine falls back the same way).
"""

from __future__ import annotations

import json
import platform
import sys
import warnings

import click

from .. import settings
from ..engine.flags import fail

# Shape families checked: (query heads per kv head, head_dim) of Qwen2.5-0.5B, -1.5B and -7B.
FAMILIES = ((7, 64), (6, 128), (7, 128))
DTYPES = ("float16", "bfloat16", "float32")


def _device() -> dict:
    import mlx.core as mx

    from ..attention import metal_native

    info: dict = {"metal_available": metal_native()}
    if info["metal_available"]:
        try:
            info.update(
                {
                    k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                    for k, v in mx.metal.device_info().items()
                }
            )
        except Exception as e:  # an MLX without device_info: say so, carry on
            info["device_info_error"] = f"{type(e).__name__}: {e}"
    return info


def _checks(block_size: int, families=FAMILIES) -> list[dict]:
    """Each family's startup checks, decode then varlen: ok, or the warning the engine would give
    (a failed varlen check sends prefill chunks to the reference path, a failed decode check
    everything)."""
    import mlx.core as mx

    from ..attention import metal, metal_varlen

    rows = []
    for kernel, check, variant in (
        ("decode", metal.check_family, lambda hd, group, dt: metal._variant(hd, block_size, group)),
        (
            "varlen",
            metal_varlen.check_varlen,
            lambda hd, group, dt: metal_varlen.plan(hd, block_size, group, dt.size).variant,
        ),
    ):
        for dtype in DTYPES:
            for group, hd in families:
                pool = mx.zeros((1, 1, block_size, hd), dtype=getattr(mx, dtype))
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        ok = check(group, pool)
                        # The compiler's own message, first lines (the warning keeps one line).
                        error = metal.family_error(group, pool, varlen=kernel == "varlen") or "; ".join(
                            str(w.message) for w in caught
                        )
                    except Exception as e:  # strict mode, or the emulator's own report
                        ok, error = False, metal.error_text(e)
                rows.append(
                    dict(
                        kernel=kernel,
                        dtype=dtype,
                        group=group,
                        head_dim=hd,
                        block_size=block_size,
                        variant=variant(hd, group, pool.dtype),
                        ok=ok,
                        error=error or None,
                    )
                )
    return rows


def _table(gpu: bool, seqs: int, tokens: int, block_sizes) -> dict:
    from ..bench import kernel as kbench

    if gpu:
        rows = kbench.gpu_rows(seqs, tokens, block_sizes)
        return {"kind": "gpu", "note": "ms per call, 16 calls per mx.eval; ratio = paged / SDPA", "rows": rows}
    rows = kbench.emulator_rows(seqs, tokens, block_sizes)
    cost = [dict(model=m, **kbench.cost_model(g, hd, seqs=2, tokens=512)) for m, g, hd in kbench.COST_SHAPES]
    return {
        "kind": "emulator",
        "note": "no Apple GPU: kernels ran in the MSL emulator; bytes read vs the minimum "
        "and operation counts, no timings",
        "rows": rows,
        "cost_model": cost,
    }


def _planning() -> dict:
    """How the split planner sizes long contexts on this device: the GPU cores it assumes (from
    `mx.metal.device_info()`, else its default) and its partitions for one sequence at
    Qwen2.5-0.5B shapes (G 7, head_dim 64, 2 kv heads, float16 and 4-bit KV, block 16)."""
    import mlx.core as mx

    from ..attention import metal
    from ..attention.kv_quant import row_bytes

    info = metal.device_info()
    cores = metal.gpu_cores(info)
    parts = {}
    for label, bits in (("float16", None), ("4-bit", 4)):
        row = row_bytes(64, bits, 32, mx.float16)
        parts[label] = {
            ctx: metal.plan_partition_tokens(1, 2, ctx // 16, 16, group=7, head_dim=64, kv_row_bytes=row, device=info)
            for ctx in (1024, 4096, 32768)
        }
    return {
        "gpu_cores": cores,
        "from_device_info": bool(info),
        "threadgroup_target": cores * metal.THREADGROUPS_PER_CORE,
        "partition_tokens_one_sequence": parts,
    }


def collect(seqs: int | None = None, tokens: int | None = None, block_sizes=(16,), families=FAMILIES) -> dict:
    """The whole report as a JSON-ready dict; the kernel checks cover `families` ((group, head_dim) pairs)."""
    import mlx.core as mx

    from ..attention import metal_native, resolve_impl

    gpu = metal_native() and settings.metal_mode() != "emulate"
    q = mx.zeros((1, 14, 64), dtype=mx.float16)  # Qwen2.5-0.5B: 14 heads, 2 kv heads
    pool = mx.zeros((1, 2, 16, 64), dtype=mx.float16)
    seqs = seqs or (8 if gpu else 2)
    tokens = tokens or (2048 if gpu else 256)
    return {
        "mlx_version": mx.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": _device(),
        "kernels_run_on": "apple gpu" if gpu else "MSL emulator (CPU)",
        "attention_impl_auto": resolve_impl("auto", q, pool),
        "MLXPAGED_METAL": settings.metal_mode(),
        "checks": _checks(16, families),
        "split_planning": _planning(),
        "kernel_table": _table(gpu, seqs, tokens, list(block_sizes)),
        "latent_attention": _latent(),
    }


def _latent() -> str:
    """Whether the kernels take an MLA model's latent rows (DeepSeek-V3 / Kimi K2: one KV head of
    512 + 64 columns for 128 query heads; GLM-4.7-Flash: 20 heads), or why it runs the reference path."""
    from ..attention.metal import shape_problem

    why = [p for p in (shape_problem(576, 16, 128), shape_problem(576, 16, 20)) if p]
    return (
        "latent attention (MLA, rows of 576): the Metal kernels take it"
        if not why
        else f"latent attention (MLA, rows of 576) runs the reference path: {why[0].split(': ', 1)[-1]}"
    )


def _parse_family(text: str) -> tuple[int, int]:
    """'7x64' -> (7, 64); anything else ends the command in one line."""
    group, _, hd = text.lower().partition("x")
    try:
        pair = int(group), int(hd)
    except ValueError:
        pair = (0, 0)
    if min(pair) < 1:
        fail(f"--family takes GROUPxHEAD_DIM with positive integers (e.g. 7x64), got {text!r}")
    return pair


@click.command()
@click.option(
    "--out",
    "out_path",
    default="mlxpaged-doctor.json",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Where to write the JSON report.",
)
@click.option("--seqs", type=int, default=None, help="Kernel table: sequences (default 8 on a GPU, 2 emulated).")
@click.option(
    "--tokens", type=int, default=None, help="Kernel table: tokens each (default 2048 on a GPU, 256 emulated)."
)
@click.option(
    "--block-size",
    "block_sizes",
    type=int,
    multiple=True,
    default=(16,),
    show_default=True,
    help="Kernel table block sizes; repeatable.",
)
@click.option(
    "--family",
    "families",
    multiple=True,
    metavar="GROUPxHEAD_DIM",
    help="Check only this shape family (query heads per KV head x head_dim, e.g. 7x64); repeatable "
    "(default: " + ", ".join(f"{g}x{hd}" for g, hd in FAMILIES) + ").",
)
def doctor(out_path, seqs, tokens, block_sizes, families):
    """Check the Metal kernels on this machine and write a report to attach to a bug report."""
    families = tuple(_parse_family(f) for f in families) or FAMILIES
    if seqs is not None and seqs < 1 or tokens is not None and tokens < 1:
        fail("--seqs and --tokens must be positive")
    try:  # before the checks, which take minutes in the emulator: a bad path is known now
        open(out_path, "a").close()
    except OSError as e:
        fail(f"cannot write the report to {out_path}: {e.strerror}")
    report = collect(seqs, tokens, block_sizes, families)
    click.echo(f"MLX {report['mlx_version']} on {report['platform']}")
    click.echo(f"kernels run on: {report['kernels_run_on']}; impl='auto' picks {report['attention_impl_auto']}")
    dev = report["device"]
    if dev.get("metal_available"):
        click.echo("device: " + ", ".join(f"{k}={v}" for k, v in dev.items() if k != "metal_available"))
    plan = report["split_planning"]
    click.echo(
        f"split planning: {plan['gpu_cores']} GPU cores "
        f"({'from device_info' if plan['from_device_info'] else 'default: no device info'}), "
        f"target {plan['threadgroup_target']} threadgroups; partition tokens for one "
        f"sequence (0: single pass): "
        + "; ".join(
            f"{kv} " + ", ".join(f"{ctx}: {p}" for ctx, p in ps.items())
            for kv, ps in plan["partition_tokens_one_sequence"].items()
        )
    )
    click.echo(report["latent_attention"])
    failed = [c for c in report["checks"] if not c["ok"]]
    click.echo(f"kernel checks: {len(report['checks']) - len(failed)}/{len(report['checks'])} passed")
    for c in failed:
        lines = (c["error"] or "").splitlines() or [""]
        click.echo(f"  FAILED {c['kernel']} {c['dtype']} {c['variant']}: {lines[0]}")
        for ln in lines[1:]:  # the compiler's message, first lines
            click.echo(f"      {ln}")
    table = report["kernel_table"]
    click.echo(table["note"])
    for r in table["rows"]:
        layout = "scattered" if r["scattered"] else "in order"
        if table["kind"] == "gpu":
            click.echo(
                f"  block {r['block_size']:>3} {layout:>9}: paged {r['paged_ms']:.3f} ms, "
                f"SDPA {r['sdpa_ms']:.3f} ms, ratio {r['paged_over_sdpa']:.2f}, "
                f"{r['paged_gb_s']:.0f} GB/s"
            )
        else:
            click.echo(
                f"  block {r['block_size']:>3} {layout:>9}: bytes read {r['ratio']:.4f} x "
                f"the minimum, max error {r['max_error']:.2g}"
            )
    for c in table.get("cost_model", []):
        click.echo(
            f"  cost {c['model']} (G={c['group']}, head_dim {c['head_dim']}): "
            f"{c['exp_per_token_head']:.2f} exp per token per query head, "
            f"{c['simd_reductions_per_token']:.2f} SIMD reductions and "
            f"{c['simd_shuffles_per_token']:.2f} shuffles per token, "
            f"{c['loop_barriers_per_256_tokens']:.2f} loop barriers per 256 tokens"
        )
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    click.echo(f"report written to {out_path}")
    if failed:
        sys.exit(1)
