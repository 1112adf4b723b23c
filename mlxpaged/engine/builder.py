"""The one way to build an engine: `generate`, `serve` and `LLM` all come through here, and here
(with `loading.loader.load`) the model's kind decides the engine's.

A plain process loads the whole model and gets an `LLMEngine` (the server, given an encoder
checkpoint, an `EncoderEngine`); one rank of a tensor-parallel group (started by `mlx.launch`)
loads only its shard and gets a `TPEngine`, built once every rank agrees on the pool size, the
checkpoint and the settings. LoRA adapters are checked against the model as soon as it is
loaded; the engine's parts (pools, block manager, runner, scheduler, step layers) come from
`parts.build_parts`. Pool sizing is `worker.kv_cache.pool_blocks` in both cases. The only door
to `distributed/`: the commands and `LLM` find their group (`launched_group`, `init_group`) and
the server's ranks talk (`broadcast_json`, `RankFailure`) through the names it re-exports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import EngineConfig

# The rest of mlxpaged reaches tensor parallelism through this module only (engine/'s import rule):
# the group, rank 0's broadcasts to the followers and the failure that ends a rank.
from ..distributed.collectives import RankFailure, broadcast_json, init_group, launched_group  # noqa: F401
from ..distributed.shard_loading import load_shard
from ..distributed.tp_engine import TPEngine
from ..loading import loader
from ..loading.encoder import EncoderModel
from ..loading.loader import LoadedModel
from ..models.lora import AdapterSet
from .encoder import EncoderEngine
from .llm_engine import LLMEngine
from .parts import build_parts

if TYPE_CHECKING:
    import mlx.core as mx


def load_model(
    model: str | None,
    dtype: str | None = None,
    weights: str | None = None,
    group: mx.distributed.Group | None = None,
    *,
    encoders: bool = False,
) -> LoadedModel | EncoderModel:
    """The whole model, or this rank's shard of it when `group` is a tensor-parallel group; with
    `encoders`, an encoder checkpoint as mlx-embeddings' model (loading/encoder.py)."""
    if group is None:
        return loader.load(model, dtype, weights, encoders=encoders)
    return load_shard(model, dtype, weights, group)


def build_engine(
    model: str | LoadedModel | None,
    config: EngineConfig | None = None,
    *,
    dtype: str | None = None,
    weights: str | None = None,
    group: mx.distributed.Group | None = None,
    adapters: dict[str, str] | None = None,
    adapter_dir: str | None = None,
    encoders: bool = False,
) -> LLMEngine | TPEngine | EncoderEngine:
    """An engine over `model` (a path, repo id, `.gguf` file, `LoadedModel`, or None for the
    offline default), tensor-parallel over `group` when it is given; `adapters`: LoRA adapters
    by name -> their folder (models/lora.py), which requests name in `SamplingParams.adapter`;
    `adapter_dir`: a folder of adapter folders a request may name, each loaded on first use.
    With `encoders` (the server's), an encoder checkpoint gets an `EncoderEngine` (encoder.py).
    The model's kind, and so the engine's, is decided here and in `loading.loader.load` only."""
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
        loaded = load_model(model, dtype, weights, group, encoders=encoders)
    adapter_set = None
    if adapters or adapter_dir:  # checked against the model now, beside it
        if isinstance(loaded, EncoderModel):
            raise ValueError("--adapter: LoRA adapters apply to generative models, not to an encoder checkpoint")
        adapter_set = AdapterSet.load(loaded.model, adapters, loaded.config.get("model_type"), adapter_dir)
    if isinstance(loaded, EncoderModel):
        return EncoderEngine(loaded)
    if group is not None:
        return TPEngine(loaded, config, group)
    return LLMEngine(loaded, config, parts=build_parts(loaded, config, adapters=adapter_set))
