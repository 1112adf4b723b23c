"""Speculative decoding benchmark: mlxpaged with `--speculative ngram` (and `--speculative draft`,
given a draft model) against mlxpaged without speculation and against mlx-lm's `generate` loop,
on the same token-id prompts, greedy.

Workloads:
- edit: "rewrite this file with one identifier renamed" over a Python file of about 400 tokens
  (`SOURCE`); batch b renames b different identifiers, so the prompts are distinct. The answer
  quotes most of its prompt: the best case for prompt lookup.
- sharegpt: the first ShareGPT prompts that pass vLLM's length filter; answers have little
  overlap with their prompts: the off-switch's case.

Draft: `--draft-model PATH`, or `--draft-layers L` for the target's first L layers
(`truncated_checkpoint`: an early-exit draft, the only smaller model with the offline model's
tokenizer on this machine).

Each configuration (workload x batch) runs `repeats` times; within a repeat the systems run in
an order that rotates by one each repeat. What is timed: from submitting the prompts to the
last token (prefill included), in this process; EOS ends a sequence (greedy, so with and without
speculation the tokens are the same), `max_tokens` caps it. mlx-lm runs `generate_step` (the loop
of `mlx_lm.generate`) one prompt after another for batch 1, and its `BatchGenerator` for larger
batches. `mlxpaged bench spec` and `scripts/bench_spec.py` run this module.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

from .repeat import fmt, spread

SOURCE = '''"""Inventory bookkeeping for a small warehouse."""

from dataclasses import dataclass, field


@dataclass
class StockItem:
    sku: str
    name: str
    quantity: int = 0
    unit_price: float = 0.0
    tags: list[str] = field(default_factory=list)

    def total_value(self) -> float:
        return self.quantity * self.unit_price


class Inventory:
    def __init__(self, warehouse_name: str):
        self.warehouse_name = warehouse_name
        self.items: dict[str, StockItem] = {}

    def add_item(self, item: StockItem) -> None:
        if item.sku in self.items:
            raise ValueError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item

    def remove_item(self, sku: str) -> StockItem:
        return self.items.pop(sku)

    def restock(self, sku: str, amount: int) -> int:
        if amount <= 0:
            raise ValueError("amount must be positive")
        item = self.items[sku]
        item.quantity += amount
        return item.quantity

    def sell(self, sku: str, amount: int) -> float:
        item = self.items[sku]
        if amount > item.quantity:
            raise ValueError(f"only {item.quantity} of {item.name} left")
        item.quantity -= amount
        return amount * item.unit_price

    def low_stock(self, threshold: int = 5) -> list[StockItem]:
        return [item for item in self.items.values() if item.quantity < threshold]

    def total_value(self) -> float:
        return sum(item.total_value() for item in self.items.values())

    def find_by_tag(self, tag: str) -> list[StockItem]:
        return [item for item in self.items.values() if tag in item.tags]
'''

# (old, new) identifiers: request i of a batch renames RENAMES[i].
RENAMES = [
    ("restock", "replenish"),
    ("unit_price", "price_each"),
    ("low_stock", "running_low"),
    ("warehouse_name", "site_name"),
    ("find_by_tag", "items_tagged"),
    ("total_value", "stock_value"),
    ("remove_item", "discard_item"),
    ("quantity", "count"),
]


def edit_prompts(tokenizer, batch: int) -> list[list[int]]:
    from ..engine.chat import chat_ids

    out = []
    for old, new in (RENAMES * (batch // len(RENAMES) + 1))[:batch]:
        text = (
            f"Rewrite this Python file with the identifier `{old}` renamed to `{new}` everywhere. "
            f"Reply with the whole file only, in one code block.\n\n```python\n{SOURCE}```"
        )
        out.append(chat_ids(tokenizer, [{"role": "user", "content": text}]))
    return out


def sharegpt_prompts(tokenizer, batch: int) -> list[list[int]]:
    from ..engine.chat import chat_ids
    from .datasets import sample_requests

    count = lambda texts: [len(tokenizer.encode(t)) for t in texts]  # noqa: E731
    reqs = sample_requests("sharegpt", count, batch)
    return [chat_ids(tokenizer, [{"role": "user", "content": p}]) for p, _, _ in reqs]


def run_mlxpaged(
    loaded, prompts: list[list[int]], max_tokens: int, spec: bool | dict, engine_kwargs: dict | None = None
) -> dict:
    """One timed run. `spec`: False (no speculation), True (n-gram) or the EngineConfig fields of
    a proposer (`{"speculative": "draft", "draft_model": PATH}`)."""
    from ..config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..engine.sampling_params import SamplingParams

    bs = 16
    need = sum(-(-(len(p) + max_tokens) // bs) for p in prompts) + 8
    kw = {
        "num_blocks": need,
        "enable_prefix_caching": False,
        **(spec if isinstance(spec, dict) else {"speculative": "ngram" if spec else None}),
        **(engine_kwargs or {}),
    }
    engine = LLMEngine(loaded, EngineConfig.of(**kw))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    tokens = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                tokens.append(o.outputs[0].token_ids)
    wall = time.perf_counter() - start
    st = engine.stats_dict()
    n = sum(len(t) for t in tokens)
    return {
        "system": engine.config.speculative.method or "plain",
        "tokens": n,
        "wall_s": wall,
        "tps": n / wall,
        "acceptance_rate": st["spec_acceptance_rate"],
        "mean_accepted_length": st["spec_mean_accepted_length"],
        "proposed": st["spec_proposed_tokens"],
        "accepted": st["spec_accepted_tokens"],
        "steps": engine.stats.steps,
        **(
            {"draft_passes": engine.drafter.passes, "draft_s": engine.drafter.seconds}
            if engine.drafter is not None
            else {}
        ),
    }


def run_mlx_lm(model, prompts: list[list[int]], max_tokens: int, eos: set[int]) -> dict:
    from mlx_lm.generate import BatchGenerator, generate_step

    start = time.perf_counter()
    n = 0
    if len(prompts) == 1:
        for p in prompts:
            for tok, _ in generate_step(mx.array(p), model, max_tokens=max_tokens):
                n += 1
                if int(tok) in eos:
                    break
    else:
        gen = BatchGenerator(
            model, stop_tokens=[[e] for e in eos], completion_batch_size=len(prompts), prefill_batch_size=len(prompts)
        )
        gen.insert(prompts, [max_tokens] * len(prompts))
        while responses := gen.next_generated():
            n += len(responses)
        gen.close()
    wall = time.perf_counter() - start
    return {"system": "mlx_lm", "tokens": n, "wall_s": wall, "tps": n / wall}


def truncated_checkpoint(src, layers: int, dst) -> str:
    """A draft for `src`: its first `layers` decoder layers, with its embeddings, final norm, output
    layer and tokenizer (an early-exit draft; the only smaller model with the offline model's
    tokenizer this machine can have). Written to `dst`; returns its path."""
    import json
    import shutil
    from pathlib import Path

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise ValueError(f"--draft-layers must be from 1 to {config['num_hidden_layers'] - 1}, got {layers}")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, w in mx.load(str(f)).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                continue
            weights[name] = w
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dst / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    return str(dst)


def benchmark(
    loaded,
    ref,
    *,
    workloads: list[str],
    batches: list[int],
    repeats: int,
    max_tokens: dict[str, int],
    draft_model: str | None = None,
    progress=None,
) -> dict:
    """Rows per (workload, batch): each proposer (n-gram, and the draft model if given) against
    mlxpaged without speculation and against mlx-lm, ratios formed within each repeat."""
    eos = set(getattr(loaded.tokenizer, "eos_token_ids", None) or [])
    proposers = {"ngram": {"speculative": "ngram"}}
    if draft_model is not None:
        proposers["draft"] = {"speculative": "draft", "draft_model": draft_model}
    warm = edit_prompts(loaded.tokenizer, 1)
    for how in proposers.values():
        run_mlxpaged(loaded, warm, 4, how)
    run_mlx_lm(ref, warm, 4, eos)
    rows = []
    for wl in workloads:
        for b in batches:
            prompts = edit_prompts(loaded.tokenizer, b) if wl == "edit" else sharegpt_prompts(loaded.tokenizer, b)
            systems = {
                name: (lambda how=how: run_mlxpaged(loaded, prompts, max_tokens[wl], how))
                for name, how in proposers.items()
            }
            systems["plain"] = lambda: run_mlxpaged(loaded, prompts, max_tokens[wl], False)
            systems["mlx_lm"] = lambda: run_mlx_lm(ref, prompts, max_tokens[wl], eos)
            order = list(systems)
            runs = []
            for i in range(repeats):
                rot = order[i % len(order) :] + order[: i % len(order)]
                runs.append({name: systems[name]() for name in rot} | {"order": rot})
                if progress:
                    progress()
            plain, lm = ([r[k] for r in runs] for k in ("plain", "mlx_lm"))
            row = {
                "workload": wl,
                "batch": b,
                "max_tokens": max_tokens[wl],
                "prompt_tokens": [len(p) for p in prompts],
                "plain_tps": spread([r["tps"] for r in plain]),
                "mlx_lm_tps": spread([r["tps"] for r in lm]),
                "same_tokens": len({r["tokens"] for r in plain + [r[p] for r in runs for p in proposers]}) == 1,
                "runs": runs,
            }
            for name in proposers:
                spec = [r[name] for r in runs]
                row[name] = {
                    "tps": spread([r["tps"] for r in spec]),
                    "speedup_vs_plain": spread([s["tps"] / p["tps"] for s, p in zip(spec, plain)]),
                    "speedup_vs_mlx_lm": spread([s["tps"] / m["tps"] for s, m in zip(spec, lm)]),
                    "acceptance_rate": statistics.median(r["acceptance_rate"] for r in spec),
                    "mean_accepted_length": statistics.median(r["mean_accepted_length"] for r in spec),
                }
            rows.append(row)
    return {
        "dtype": str(loaded.dtype),
        "repeats": repeats,
        "draft_model": draft_model,
        "rows": rows,
        "timed_span": TIMED,
    }


TIMED = (
    "clock: from submitting the prompts to the last token (prefill included), engines built before; greedy, "
    "EOS ends a sequence; prefix caching off; mlx-lm: generate_step (batch 1) or BatchGenerator"
)


def table(rows: list[dict]) -> list[str]:
    out = [
        f"{'workload':>9} | {'batch':>5} | {'proposer':>8} | {'tok/s':>7} | {'plain tok/s':>11} | "
        f"{'mlx-lm tok/s':>12} | {'vs plain median (range)':>23} | {'vs mlx-lm':>17} | {'accept':>6} | {'mean len':>8}"
    ]
    for r in rows:
        for name in ("ngram", "draft"):
            if name not in r:
                continue
            p = r[name]
            out.append(
                f"{r['workload']:>9} | {r['batch']:>5} | {name:>8} | {p['tps']['median']:7.1f} | "
                f"{r['plain_tps']['median']:11.1f} | {r['mlx_lm_tps']['median']:12.1f} | "
                f"{fmt(p['speedup_vs_plain']):>23} | {fmt(p['speedup_vs_mlx_lm']):>17} | "
                f"{p['acceptance_rate']:6.2f} | {p['mean_accepted_length']:8.2f}"
            )
    return out


def parse_list(text: str, option: str, allowed: set[str] | None = None) -> list:
    """'1,8' -> [1, 8] (or names, checked against `allowed`); a one-line error naming the option."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if not items or bad:
            raise ValueError(f"{option} takes a comma-separated subset of {sorted(allowed)}, got '{text}'")
        return items
    try:
        vals = [int(x) for x in items]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise ValueError(f"{option} must be comma-separated positive integers, got '{text}'")
    return vals


def run_cli(
    model,
    tiny,
    dtype,
    workloads,
    batches,
    repeats,
    edit_tokens,
    sharegpt_tokens,
    echo=print,
    progress=None,
    draft_model: str | None = None,
    draft_layers: int | None = None,
) -> dict:
    """Load, run and print; returns the payload (what `scripts/bench_spec.py` and `mlxpaged bench spec` share)."""
    import tempfile

    from .models import load_models, model_label

    wls = parse_list(workloads, "--workloads", {"edit", "sharegpt"})
    levels = parse_list(batches, "--batches")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if draft_model is not None and draft_layers is not None:
        raise ValueError("give --draft-model or --draft-layers, not both")
    loaded, ref = load_models(model, tiny, dtype)
    label = model_label(loaded, model, tiny)
    if draft_layers is not None:
        draft_model = truncated_checkpoint(loaded.path, draft_layers, tempfile.mkdtemp(prefix="mlxpaged-draft-"))
    draft = (
        f", draft {draft_model}" + (f" (first {draft_layers} layers)" if draft_layers else "") if draft_model else ""
    )
    echo(
        f"model {label} ({loaded.dtype}), device {mx.default_device()}, mlx {mx.__version__}, {repeats} repeats{draft}"
    )
    payload = benchmark(
        loaded,
        ref,
        workloads=wls,
        batches=levels,
        repeats=repeats,
        max_tokens={"edit": edit_tokens, "sharegpt": sharegpt_tokens},
        draft_model=draft_model,
        progress=progress,
    )
    echo("\n".join(table(payload["rows"])))
    echo(payload["timed_span"])
    return {"label": label, **payload}


def add_command(bench, with_common, plot_fn) -> None:
    """`mlxpaged bench spec`."""
    import sys

    import click

    @bench.command()
    @with_common
    @click.option("--workloads", default="edit,sharegpt", show_default=True)
    @click.option("--batches", default="1,8", show_default=True)
    @click.option(
        "--repeats", default=3, show_default=True, help="Runs of each case; the order of the three systems rotates."
    )
    @click.option("--edit-tokens", default=512, show_default=True, help="max_tokens of the edit workload.")
    @click.option("--sharegpt-tokens", default=128, show_default=True, help="max_tokens of the ShareGPT workload.")
    @click.option("--draft-model", default=None, help="Also measure --speculative draft with this draft model.")
    @click.option("--draft-layers", type=int, default=None, help="Also measure a draft of the model's first N layers.")
    def spec(
        model,
        tiny,
        dtype,
        out_dir,
        plot,
        workloads,
        batches,
        repeats,
        edit_tokens,
        sharegpt_tokens,
        draft_model,
        draft_layers,
    ):
        """Speculative decoding (n-gram, draft): tokens/s against no speculation and mlx-lm; acceptance."""
        from ..errors import MlxPagedError
        from .report import write_result

        try:
            payload = run_cli(
                model,
                tiny,
                dtype,
                workloads,
                batches,
                repeats,
                edit_tokens,
                sharegpt_tokens,
                echo=click.echo,
                draft_model=draft_model,
                draft_layers=draft_layers,
            )
        except (MlxPagedError, ValueError, FileNotFoundError) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        path = write_result(out_dir, "spec", payload.pop("label"), payload)
        click.echo(f"results: {path}")
        if plot:
            rows = payload["rows"]

            def draw(ax):
                bars = [
                    (f"{r['workload']} b{r['batch']} {p}", r[p]) for r in rows for p in ("ngram", "draft") if p in r
                ]
                ax.bar([n for n, _ in bars], [v["speedup_vs_plain"]["median"] for _, v in bars])
                ax.axhline(1.0, color="gray", lw=0.8)
                ax.set_ylabel("tokens/s with / without speculation")

            plot_fn(path, draw)
