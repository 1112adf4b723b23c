"""The flags `mlxpaged generate` and `mlxpaged serve` share: the model and the engine's
settings, declared once so both commands spell, default and document them alike."""

from __future__ import annotations

import click

from ..config import EngineConfig

# Flag (python name) -> EngineConfig field; what `engine_config` takes out of a command's kwargs.
ENGINE_FIELDS = {
    "block_size": "block_size",
    "num_blocks": "num_blocks",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "prefix_caching": "enable_prefix_caching",
    "attention_impl": "attention_impl",
    "kv_bits": "kv_bits",
    "kv_group_size": "kv_group_size",
    "async_scheduling": "async_scheduling",
    "prefix_cache_dir": "prefix_cache_dir",
    "prefix_cache_disk_gb": "prefix_cache_disk_gb",
    "speculative": "speculative",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
    "speculative_max_batch_size": "speculative_max_batch_size",
    "draft_model": "draft_model",
}


def model_and_engine_options(num_blocks_help: str):
    """Decorator adding --model, --dtype, --weights and the engine flags to a click command;
    `num_blocks_help` says how the command sizes the pool by default."""
    options = [
        click.option(
            "--model",
            "-m",
            default=None,
            help=(
                "Checkpoint directory, .gguf file or Hugging Face repo id "
                "(default: the offline Qwen2.5-Coder-0.5B-Instruct)."
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
            default=2048,
            show_default=True,
            help="Tokens computed per step (prefill chunk size).",
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


def engine_config(kwargs: dict) -> EngineConfig:
    """The `EngineConfig` of a command's engine flags, removing them from `kwargs`."""
    return EngineConfig(**{field: kwargs.pop(flag) for flag, field in ENGINE_FIELDS.items()})
