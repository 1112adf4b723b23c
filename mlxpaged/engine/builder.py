"""The one way to build an engine: `generate`, `serve` and `LLM` all come through here.

A plain process loads the whole model and gets an `LLMEngine`; one rank of a tensor-parallel
group (started by `mlx.launch`) loads only its shard and gets a `TPEngine`, built once every
rank agrees on the pool size, the checkpoint and the settings. The engine's parts (pools, block
manager, runner, scheduler, step layers) come from `parts.build_parts`. Pool sizing is
`worker.kv_cache.pool_blocks` in both cases. The only door to `distributed/`: the commands and
`LLM` find their group (`launched_group`, `init_group`) and the server's ranks talk
(`broadcast_json`, `RankFailure`) through the names it re-exports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import EngineConfig

# The rest of mlxpaged reaches tensor parallelism through this module only (engine/'s import rule):
# the group, rank 0's broadcasts to the followers and the failure that ends a rank.
from ..distributed.collectives import RankFailure, broadcast_json, init_group, launched_group  # noqa: F401
from ..distributed.shard_loading import load_shard
from ..distributed.tp_engine import tp_engine
from ..loading.loader import LoadedModel, load
from .llm_engine import LLMEngine
from .parts import build_parts

if TYPE_CHECKING:
    import mlx.core as mx


def load_model(
    model: str | None, dtype: str | None = None, weights: str | None = None, group: mx.distributed.Group | None = None
) -> LoadedModel:
    """The whole model, or this rank's shard of it when `group` is a tensor-parallel group."""
    return load(model, dtype, weights) if group is None else load_shard(model, dtype, weights, group)


def build_engine(
    model: str | LoadedModel | None,
    config: EngineConfig | None = None,
    *,
    dtype: str | None = None,
    weights: str | None = None,
    group: mx.distributed.Group | None = None,
    adapters: dict[str, str] | None = None,
    adapter_dir: str | None = None,
) -> LLMEngine:
    """An engine over `model` (a path, repo id, `.gguf` file, `LoadedModel`, or None for the
    offline default), tensor-parallel over `group` when it is given; `adapters`: LoRA adapters
    by name -> their folder (models/lora.py), which requests name in `SamplingParams.adapter`;
    `adapter_dir`: a folder of adapter folders a request may name, each loaded on first use."""
    config = config or EngineConfig()
    if (adapters or adapter_dir) and group is not None:
        raise ValueError("LoRA adapters are not served under tensor parallelism yet; run on one process")
    if isinstance(model, LoadedModel):
        if group is not None and getattr(model.model, "tp_group", None) is None:
            raise ValueError(
                "a tensor-parallel engine needs a model path (each rank loads its shard), not a loaded model"
            )
        loaded = model
    else:
        loaded = load_model(model, dtype, weights, group)
    if group is not None:
        return tp_engine(loaded, config, group)
    return LLMEngine(loaded, config, parts=build_parts(loaded, config, adapters=adapters, adapter_dir=adapter_dir))
