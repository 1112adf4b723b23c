"""Each tensor-parallel rank loads only its shard of a checkpoint (sharding.py says how it is cut).

The model is built lazily, sharded, then filled with the slices this rank reads through memory
maps of the checkpoint's safetensors (`loading.loader.read_slice`), so no rank ever holds the whole model.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxPagedError
from ..loading.encoder import is_encoder
from ..loading.loader import (
    DTYPES,
    WEIGHTS,
    LoadedModel,
    default_dtype,
    default_weights,
    read_slice,
    resolve_model_path,
    safetensors_index,
)
from .collectives import barrier
from .sharding import check_shardable, shard_axis, shard_model


def load_shard(model: str | None, dtype: str | None, weights: str | None, group) -> LoadedModel:
    """This rank's tensor-parallel shard of a checkpoint of a supported family (see sharding.py).

    The model is built lazily (its random initial weights are never evaluated), sharded, and
    filled with the slices this rank reads from the checkpoint's safetensors, so a rank never
    holds more than its shard plus the replicated embedding, norms and output layer. A GGUF is
    converted first (rank 0 converts while the others wait, then they read the cached copy).
    """
    from mlx_lm.utils import load_tokenizer

    from ..models import paged_adapter

    if dtype not in (None, "auto") and dtype not in DTYPES:
        raise MlxPagedError(f"unknown dtype '{dtype}': use auto, {', '.join(DTYPES)}")
    if weights not in (None, *WEIGHTS):
        raise MlxPagedError(f"unknown weights '{weights}': use {', '.join(WEIGHTS)}")
    explicit = weights not in (None, "auto")
    rank, world = group.rank(), group.size()
    if rank == 0:  # one converter at a time: the others find its cached output
        path = resolve_model_path(model, weights if explicit else default_weights())
    barrier(group)
    if rank != 0:
        path = resolve_model_path(model, weights if explicit else default_weights())
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MlxPagedError(f"cannot read {path / 'config.json'}: {e}") from None
    if is_encoder(config):
        raise MlxPagedError(f"{path} is an encoder model: tensor parallelism runs decoders only; run it on one process")
    paged_adapter.check_family(config.get("model_type"), config, path / "config.json")
    paged_adapter.check_tensor_parallel(config.get("model_type"))
    check_shardable(config, world)
    index = safetensors_index(path)
    model_class, args_class = paged_adapter.model_classes(config)
    net = paged_adapter.prepare(model_class(args_class.from_dict(config)), config, path / "config.json")
    quant = config.get("quantization")
    if quant:
        if explicit and weights == "float":
            raise MlxPagedError(
                f"{path} holds quantized weights; tensor parallelism loads them as stored (drop --weights float)"
            )
        per_layer = {k: v for k, v in quant.items() if isinstance(v, dict)}
        nn.quantize(
            net,
            group_size=quant["group_size"],
            bits=quant["bits"],
            mode=quant.get("mode", "affine"),
            class_predicate=lambda p, m: per_layer.get(p, f"{p}.scales" in index),
        )
    elif explicit and weights == "quantized":
        raise MlxPagedError(
            f"--weights quantized needs a GGUF file or a quantized MLX checkpoint; {path} holds float weights"
        )
    shard_model(net, group)
    dt = default_dtype(config) if dtype in (None, "auto") else DTYPES[dtype]

    def read(name: str) -> mx.array:
        a = read_slice(*index[name], shard_axis(name), rank, world)
        if mx.issubdtype(a.dtype, mx.floating) and a.dtype != dt:
            a = a.astype(dt)  # one tensor at a time (as set_dtype would, without a second copy of all)
            mx.eval(a)
        return a

    names = net.sanitize(dict.fromkeys(index))  # drops a tied lm_head and rotary buffers
    try:
        net.load_weights([(n, read(n)) for n in names], strict=True)
    except ValueError as e:
        raise MlxPagedError(f"cannot load checkpoint {path}: {str(e).splitlines()[0][:200]}") from None
    net.eval()
    mx.eval(net.parameters())
    mx.clear_cache()  # the read buffers go back to the system, not to MLX's cache
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return LoadedModel(net, tokenizer, config, path, dt, "quantized" if quant else "float")
