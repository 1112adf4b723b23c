"""Tensor parallelism for an mlx-lm family `Model`: shard its layers over an `mx.distributed` group.

A family whose mlx-lm module has its own `Model.shard()` (llama, mistral, qwen2, qwen3) is
sharded by it; the others with separate q/k/v and gate/up projections are sharded here, the same
way. Both are Megatron's split, with mlx.nn's sharded layers (`mlx.nn.layers.distributed.shard_linear`):
- q/k/v and gate/up are column-sharded ("all-to-sharded"): rank r computes heads
  [r*H/W, (r+1)*H/W) and KV heads [r*KV/W, (r+1)*KV/W), so grouped-query attention stays local
  (q head h reads KV head h // (H/KV), which lies on the same rank);
- o_proj and down_proj are row-sharded ("sharded-to-all"): each rank multiplies its slice and
  `all_sum` adds the partial products, so every rank holds the same hidden state afterwards;
- the embedding, norms and the output layer are replicated.

Invariant: after `shard_model`, every rank's residual stream, and therefore its logits, equal
the unsharded model's up to the order of the all_sum's additions. Each rank's attention layers
(and so its paged KV pool) hold only its `num_key_value_heads / W` heads.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

from ..errors import MlxPagedError

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features split
ROW = ("o_proj", "down_proj")  # input features split, then all_sum


def check_shardable(config: dict, world: int) -> None:
    """One-line error unless `world` divides the KV heads (and so the query heads and the MLP)."""
    kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    heads = config["num_attention_heads"]
    inter = config["intermediate_size"]
    if kv % world:
        raise MlxPagedError(
            f"tensor parallelism over {world} ranks needs {world} to divide num_key_value_heads={kv}; "
            f"run with a number of ranks that divides {kv}"
        )
    if heads % world or inter % world:
        raise MlxPagedError(f"{world} ranks must divide num_attention_heads={heads} and intermediate_size={inter}")


def shard_axis(name: str) -> int | None:
    """The axis along which parameter `name` (checkpoint naming) is split: 0 for column-sharded
    layers (weight, scales, biases and bias alike), -1 for a row-sharded layer's weight / scales /
    biases (its bias, were there one, is replicated), None for replicated tensors."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    layer, leaf = parts[-2], parts[-1]
    if layer in COLUMN:
        return 0
    if layer in ROW and leaf != "bias":
        return -1
    return None


def _shardable_here(model: nn.Module) -> bool:
    """Every block has the projections `COLUMN` and `ROW` name (so the split above applies), and
    no q/k norm spans all heads (olmo2's would need the heads of every rank)."""
    hd = model.args.head_dim
    return all(
        all(hasattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        and all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
        and all(
            getattr(layer.self_attn, n).weight.shape[-1] == hd
            for n in ("q_norm", "k_norm")
            if hasattr(layer.self_attn, n)
        )
        for layer in model.layers
    )


def shard_model(model: nn.Module, group: mx.distributed.Group) -> nn.Module:
    """Replace the linear layers of every block by their sharded versions, in place.

    Call it on a model whose parameters are not yet evaluated (lazy): the sharded layers slice
    the lazy arrays, so the full weights are never materialized; load the slices afterwards
    (loader.load_shard) or evaluate to slice real weights already held.
    """
    world = group.size()
    args = model.args
    check_shardable(vars(args), world)
    if not _shardable_here(model):
        raise MlxPagedError(
            f"tensor parallelism does not support model_type {args.model_type!r} "
            "(its layers lack separate q/k/v/o and gate/up/down projections, or norm all heads "
            "together); run it on one process"
        )
    if hasattr(type(model), "shard"):  # mlx-lm's own split (the same one, see the module docstring)
        model.shard(group)
    else:
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
            attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
            for name in ("gate_proj", "up_proj"):
                setattr(mlp, name, shard_linear(getattr(mlp, name), "all-to-sharded", group=group))
            mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
            # The heads this rank computes, and so the KV heads its pool stores.
            attn.n_heads //= world
            attn.n_kv_heads //= world
    model.num_local_kv_heads = args.num_key_value_heads // world
    model.tp_group = group
    return model
