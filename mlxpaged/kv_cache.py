"""The paged KV cache: one K and one V pool per layer, `[num_blocks, num_kv_heads, block_size, head_dim]`.

Block id `b` means the same token slots in every layer's pools, so one block table per sequence
serves all layers. Writes are MLX scatters into the pool arrays; the cache holds the only
reference to each pool, so MLX updates them in place (no copy, no growth per step).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype

    @classmethod
    def of(cls, loaded) -> "CacheShape":
        """The cache shape of a `LoadedModel`'s layers, in its dtype."""
        args = loaded.model.args
        return cls(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, loaded.dtype)

    def bytes_per_block(self, block_size: int) -> int:
        """K and V bytes of one block across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * block_size * self.head_dim * self.dtype.size


def slot_mapping(block_ids: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Pool slots of token `positions` of a sequence whose block table is `block_ids`.

    Slot `block_id * block_size + offset` is the row that `PagedKVCache.write` fills.
    """
    return (block_ids[positions // block_size] * block_size + positions % block_size).astype(np.int32)


def available_memory() -> int:
    """Bytes the KV pools could take: the GPU's working set on a Mac, free RAM elsewhere."""
    try:
        if mx.metal.is_available():
            info = mx.device_info()
            return int(info["max_recommended_working_set_size"]) - mx.get_active_memory()
    except Exception:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def blocks_for_memory(shape: CacheShape, block_size: int, fraction: float, max_tokens: int) -> int:
    """How many blocks fit in `fraction` of the available memory, capped at `max_tokens` slots."""
    if not 0 < fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
    n = int(available_memory() * fraction) // shape.bytes_per_block(block_size)
    return max(1, min(n, max_tokens // block_size))


class PagedKVCache:
    """Per-layer K/V pools plus the two operations the allocator needs: write and copy blocks."""

    def __init__(self, shape: CacheShape, num_blocks: int, block_size: int):
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        pool_shape = (num_blocks, shape.num_kv_heads, block_size, shape.head_dim)
        self.keys = [mx.zeros(pool_shape, dtype=shape.dtype) for _ in range(shape.num_layers)]
        self.values = [mx.zeros(pool_shape, dtype=shape.dtype) for _ in range(shape.num_layers)]
        mx.eval(self.keys, self.values)
        self._heads = mx.arange(shape.num_kv_heads)[None, :]

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.shape.bytes_per_block(self.block_size)

    def write(self, layer: int, k: mx.array, v: mx.array, slot_mapping: mx.array) -> tuple[mx.array, mx.array]:
        """Store `k, v [num_tokens, num_kv_heads, head_dim]` at slots `block_id * block_size + offset`.

        Returns the updated pools of the layer (the same arrays the cache now holds).
        """
        blocks = (slot_mapping // self.block_size)[:, None]
        offsets = (slot_mapping % self.block_size)[:, None]
        kp, vp = self.keys[layer], self.values[layer]
        # Item assignment rebinds these very arrays to the scatter's result.
        kp[blocks, self._heads, offsets] = k.astype(kp.dtype)
        vp[blocks, self._heads, offsets] = v.astype(vp.dtype)
        return kp, vp

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks `src -> dst` in every layer (copy-on-write)."""
        if not copies:
            return
        src = mx.array([s for s, _ in copies], dtype=mx.int32)
        dst = mx.array([d for _, d in copies], dtype=mx.int32)
        for layer in range(self.shape.num_layers):
            self.keys[layer][dst] = self.keys[layer][src]
            self.values[layer][dst] = self.values[layer][src]
        mx.eval(self.keys, self.values)
