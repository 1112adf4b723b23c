"""The command-line side of building an engine, which `mlxpaged generate` and `mlxpaged serve`
share (as vLLM's `engine/arg_utils.py` serves its CLI and its server): the model and engine flags,
declared once so both commands spell, default and document them alike; the one-line failure of a
bad flag or input (`fail`, `user_errors`); and which rank this process is (`launched_rank`).
"""

from __future__ import annotations

import contextlib
import sys

import click

from ..config import EngineConfig
from ..errors import MlxPagedError

SERVE_CPU_CHUNK = 256  # serve's prefill chunk on the CPU: as fast a token there, and short steps beside decodes


def model_and_engine_options(num_blocks_help: str, serving: bool = False):
    """Decorator adding --model, --dtype, --weights and the engine flags to a click command;
    `num_blocks_help` says how the command sizes the pool by default. `serving` (`mlxpaged serve`)
    gives two defaults meant for interactive clients: the shortest prefill first, and on the CPU
    chunks of SERVE_CPU_CHUNK tokens (`max_num_batched_tokens` None until `serve` resolves it)."""
    options = [
        click.option(
            "--model",
            "-m",
            default=None,
            multiple=serving,
            help=(
                "Checkpoint directory, .gguf file or Hugging Face repo id "
                "(default: the offline Qwen2.5-Coder-0.5B-Instruct)."
                + (
                    " Repeat it to serve several models, each loaded when a request names it; "
                    "NAME=PATH_OR_REPO serves it as NAME."
                    if serving
                    else ""
                )
            ),
        ),
        click.option(
            "--dtype", default="auto", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), show_default=True
        ),
        click.option(
            "--weights",
            default="auto",
            type=click.Choice(["auto", "quantized", "float"]),
            show_default=True,
            help=(
                "GGUF block weights kept quantized (MLX quantized layers) or dequantized; "
                "auto: quantized on a GPU, float on the CPU (faster there)."
            ),
        ),
        click.option("--block-size", default=16, show_default=True, help="Tokens per KV block (power of two, 1..256)."),
        click.option(
            "--num-blocks", default=None, type=int, help=f"KV blocks in the pool (default: {num_blocks_help})."
        ),
        click.option("--max-num-seqs", default=64, show_default=True, help="Sequences running at once."),
        click.option(
            "--max-num-batched-tokens",
            default=None if serving else 2048,
            type=int,
            show_default=not serving,
            help="Tokens computed per step (prefill chunk size)"
            + (
                f" (default: 2048; {SERVE_CPU_CHUNK} on the CPU, where a smaller chunk is computed as fast and "
                "keeps each step beside running decodes short)."
                if serving
                else "."
            ),
        ),
        click.option(
            "--prefill-order",
            default="shortest" if serving else "fcfs",
            type=click.Choice(["fcfs", "shortest"]),
            show_default=True,
            help="Which waiting prompt is computed first: in arrival order, or the one with the fewest tokens left "
            "after its prefix hit (short follow-up turns are not queued behind long prompts).",
        ),
        click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True),
        click.option(
            "--attention",
            "attention_impl",
            default="auto",
            type=click.Choice(["auto", "reference", "metal"]),
            show_default=True,
        ),
        click.option(
            "--kv-bits",
            default=None,
            type=int,
            metavar="{4,8}",
            help="Store K/V quantized at this many bits (default: the model's dtype).",
        ),
        click.option(
            "--kv-group-size",
            default=64,
            show_default=True,
            metavar="{32,64}",
            help="Values sharing one scale and bias in a quantized K/V row.",
        ),
        click.option(
            "--prefix-cache-dir",
            default=None,
            metavar="DIR",
            help=(
                "Keep full KV blocks on disk under DIR too, by hash: a later run (or a restart) reads a repeated "
                "prefix instead of recomputing it (docs/prefix-cache.md)."
            ),
        ),
        click.option(
            "--prefix-cache-disk-gb",
            default=None,
            type=float,
            metavar="N",
            help="Cap the --prefix-cache-dir store at N GB; least recently used blocks go first "
            "(default: 8 GB, or a quarter of the free disk space if less).",
        ),
        click.option(
            "--async-scheduling/--no-async-scheduling",
            default=True,
            show_default=True,
            help="Launch each step before reading back the previous one's tokens (outputs are the same either way).",
        ),
        click.option(
            "--speculative",
            default=None,
            type=click.Choice(["ngram", "draft"]),
            help=(
                "Speculative decoding: 'ngram' proposes tokens found earlier in the prompt or output (prompt "
                "lookup), 'draft' the greedy tokens of --draft-model; the step's forward pass verifies them and "
                "outputs are unchanged."
            ),
        ),
        click.option(
            "--draft-model",
            default=None,
            help="With --speculative draft: a smaller checkpoint (directory or .gguf) with the model's tokenizer.",
        ),
        click.option(
            "--num-speculative-tokens",
            default=5,
            show_default=True,
            help="Proposals per step at most (adapted per sequence).",
        ),
        click.option(
            "--prompt-lookup-min", default=2, show_default=True, help="Shortest n-gram the ngram proposer matches."
        ),
        click.option(
            "--prompt-lookup-max", default=5, show_default=True, help="Longest n-gram the ngram proposer matches."
        ),
        click.option(
            "--speculative-max-batch-size",
            default=8,
            show_default=True,
            help="No speculation while more samples than this run (larger batches are not bandwidth-bound).",
        ),
    ]

    def wrap(f):
        for opt in reversed(options):  # the first listed ends up first in --help
            f = opt(f)
        return f

    return wrap


# A flag whose python name is not its EngineConfig field's; every other engine flag is named as its field.
RENAMED = {"prefix_caching": "enable_prefix_caching"}
MODEL_FLAGS = ("model", "dtype", "weights")


@model_and_engine_options("")
def _declared(**kwargs):
    """Never called: the options above, applied once to read their names."""


# Flag (python name) -> EngineConfig field: what `engine_config` takes out of a command's kwargs,
# read off the declarations themselves (no second list to keep in step).
ENGINE_FIELDS = {
    p.name: RENAMED.get(p.name, p.name) for p in reversed(_declared.__click_params__) if p.name not in MODEL_FLAGS
}


def engine_config(kwargs: dict) -> EngineConfig:
    """The `EngineConfig` of a command's engine flags, removing them from `kwargs`."""
    return EngineConfig.of(**{field: kwargs.pop(flag) for flag, field in ENGINE_FIELDS.items()})


def fail(msg: str) -> None:
    """End the command with one line on stderr and exit status 1 (no traceback)."""
    click.echo(f"error: {msg}", err=True)
    sys.exit(1)


@contextlib.contextmanager
def user_errors():
    """Bad input, a bad setting or a failed load (`MlxPagedError`, `ValueError`) ends the command in one line."""
    try:
        yield
    except (MlxPagedError, ValueError) as e:
        fail(str(e))


def launched_rank():
    """(group, follower): the tensor-parallel group when `mlx.launch` started this process as one
    of several ranks (else None), and whether this is a rank other than 0, which computes but
    neither prints nor serves."""
    from .builder import launched_group  # loads MLX: only once a command runs

    group = launched_group()
    return group, group is not None and group.rank() != 0
