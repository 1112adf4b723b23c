"""Each tensor-parallel rank loads only its shard of a checkpoint (sharding.py says how it is cut).

The model is built lazily, sharded, then filled with the slices this rank reads through memory
maps of the checkpoint's safetensors, so no rank ever holds the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxPagedError
from ..loading.loader import DTYPES, WEIGHTS, LoadedModel, default_dtype, default_weights, resolve_model_path
from .collectives import barrier
from .sharding import check_shardable, shard_axis, shard_model

_ST_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "U8": "uint8",
    "I8": "int8",
    "I64": "int64",
    "U16": "uint16",
}


def _safetensors_index(path: Path) -> dict[str, tuple[Path, int, dict]]:
    """name -> (file, data start, header entry) over every model*.safetensors in `path`."""
    index = {}
    for f in sorted(path.glob("model*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        index.update({name: (f, 8 + n, h) for name, h in header.items()})
    if not index:
        raise MlxPagedError(f"incomplete checkpoint {path}: no model*.safetensors in it")
    return index


def _read_slice(file: Path, start: int, entry: dict, axis: int | None, rank: int, world: int) -> mx.array:
    """Tensor `entry` of `file`, or only its `rank`-th of `world` equal slices along `axis`,
    read through a memory map so the other ranks' bytes are never copied."""
    import numpy as np

    kind = _ST_DTYPES.get(entry["dtype"])
    if kind is None:
        raise MlxPagedError(f"{file}: unsupported safetensors dtype {entry['dtype']}")
    shape, (b, e) = tuple(entry["shape"]), entry["data_offsets"]
    np_kind = "uint16" if kind == "bfloat16" else kind  # numpy has no bfloat16: read the bits
    full = (
        np.memmap(file, dtype=np_kind, mode="r", offset=start + b, shape=shape) if e > b else np.zeros(shape, np_kind)
    )
    if axis is not None:
        size = shape[axis]
        if size % world:
            raise MlxPagedError(f"{file}: a tensor of shape {shape} cannot be split in {world} along axis {axis}")
        idx = [slice(None)] * len(shape)
        idx[axis] = slice(rank * size // world, (rank + 1) * size // world)
        full = full[tuple(idx)]
    out = mx.array(np.ascontiguousarray(full))
    del full
    return out.view(mx.bfloat16) if kind == "bfloat16" else out


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
    paged_adapter.check_family(config.get("model_type"), config, path / "config.json")
    paged_adapter.check_tensor_parallel(config.get("model_type"))
    check_shardable(config, world)
    index = _safetensors_index(path)
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
        a = _read_slice(*index[name], shard_axis(name), rank, world)
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
