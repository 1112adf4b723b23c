"""The paged KV cache: one K and one V pool per layer, `[num_blocks, num_kv_heads, block_size, head_dim]`.

Block id `b` means the same token slots in every pool of one KV cache group (core/kv_groups.py),
so one block table per sequence and group serves the group's layers: each layer names its group
(`groups[layer]`), and a group's pools are that group's pool length (`group_blocks[g]`). The
pools of different layers may differ in KV heads and head_dim (Gemma 4's full layers are wider
than its sliding ones: `CacheShape.layer_dims`); a block is then the same token slots in pools of
different widths. Writes are MLX scatters into the pool arrays; the cache holds the only
reference to each pool, so MLX updates them in place (no copy, no growth per step).

With `kv_bits` set, each pool is a `QuantizedPool` (codes, scales and biases in the same block
layout): a write quantizes its new rows along head_dim and scatters all three arrays, a block
copy copies all three, and a block costs `row_bytes` per row instead of `head_dim * dtype.size`.
Keys are stored less a constant per (layer, KV head) (`kv_quant.key_offsets`), which attention
cannot see (softmax ignores a shift shared by all of a query's scores) but quantization can, and
divided channel by channel by per-(layer, KV head) scales (`kv_calibration.key_scales`), which
`scale_queries` multiplies back into the queries so every score `q . k` is unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from ..attention.kv_quant import QuantizedPool, check_kv_quant, key_offsets, row_bytes
from ..models.cache_spec import CacheSpec
from ..models.paged_adapter import attention_of, paged_layers


@dataclass
class CacheShape:
    """What the pools hold. Invariant: `layer_dims` has one `(kv_heads, head_dim)` per layer;
    built without it, every layer is `(num_kv_heads, head_dim)`. With it, `num_kv_heads` and
    `head_dim` are layer 0's; the pools, the bytes and the quantization check read `layer_dims`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype
    kv_bits: int | None = None  # None: float rows in `dtype`; 8 or 4: quantized rows
    kv_group_size: int = 64
    # An MLA model's pool (models/paged_adapter.py LatentLayerCache): attention reads its values
    # from the key rows (`[latent, k_pe]`, the first kv_lora_rank columns of the output used), so
    # no value pool is kept: half the bytes. Keys are then stored unscaled (values must be).
    keys_only: bool = False
    layer_dims: tuple[tuple[int, int], ...] = ()  # per layer (kv_heads, head_dim); () fills it uniformly

    def __post_init__(self):
        if not self.layer_dims:
            self.layer_dims = ((self.num_kv_heads, self.head_dim),) * self.num_layers
        self.layer_dims = tuple((int(h), int(d)) for h, d in self.layer_dims)
        if len(self.layer_dims) != self.num_layers:
            raise ValueError(f"layer_dims has {len(self.layer_dims)} entries for {self.num_layers} layers")

    @classmethod
    def of(cls, loaded) -> CacheShape:
        """The cache shape of a `LoadedModel`'s layers (its `cache_spec`), in its dtype."""
        spec = loaded.cache_spec
        dims = spec.pool_dims  # an MLA model: one latent row per token
        return cls(
            len(dims),  # a hybrid's recurrent layers hold state, not K/V; Gemma 4's shared layers nothing
            *(dims[0] if dims else (0, 0)),  # no attention layer (mamba, rwkv7): no pools
            loaded.dtype,
            keys_only=spec.latent,
            layer_dims=tuple(dims),
        )

    def quantized(self, kv_bits: int | None, kv_group_size: int = 64) -> CacheShape:
        """This shape with K/V rows stored at `kv_bits` (None: float); checks the pair fits each head_dim."""
        for d in sorted({d for _, d in self.layer_dims}):
            check_kv_quant(kv_bits, kv_group_size, d)
        return replace(self, kv_bits=kv_bits, kv_group_size=kv_group_size)

    def bytes_per_block(self, block_size: int) -> int:
        """K and V bytes of one block across all layers (codes, scales and biases when quantized)."""
        rows = sum(h * row_bytes(d, self.kv_bits, self.kv_group_size, self.dtype) for h, d in self.layer_dims)
        return (1 if self.keys_only else 2) * block_size * rows


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


def blocks_for_memory(
    shape: CacheShape,
    block_size: int,
    fraction: float,
    max_tokens: int,
    extra_block_bytes: int = 0,
    reserved_bytes: int = 0,
) -> int:
    """How many blocks fit in `fraction` of the available memory, capped at `max_tokens` slots
    (`extra_block_bytes`: what each block costs besides `shape`'s rows, e.g. a draft model's pool;
    `reserved_bytes`: what else the budget holds, e.g. recurrent states, at most half of it)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
    budget = int(available_memory() * fraction)
    budget -= min(reserved_bytes, budget // 2)
    per_block = shape.bytes_per_block(block_size) + extra_block_bytes
    n = budget // per_block if per_block else max_tokens  # no pools (a recurrent-only model): blocks are free
    return max(1, min(n, max_tokens // block_size))


def pool_blocks(loaded, config, need: int | None = None, extra_block_bytes: int = 0, reserved_bytes: int = 0) -> int:
    """The one pool-sizing rule, used by a single process and by every tensor-parallel rank.

    `config.cache.num_blocks` if set; else `need` blocks (a known workload, as `generate` has) capped
    by `config.cache.kv_memory_fraction` of free memory and `config.cache.max_kv_tokens`; else that cap.
    """
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    shape = CacheShape.of(loaded).quantized(
        config.cache.kv_bits, config.cache.kv_group_size
    )  # quantized rows are smaller
    cap = blocks_for_memory(
        shape,
        config.cache.block_size,
        config.cache.kv_memory_fraction,
        config.cache.max_kv_tokens,
        extra_block_bytes,
        reserved_bytes,
    )
    return cap if need is None else max(1, min(need, cap))


CHUNK_TOKENS = 4096  # a growable pool starts at (and an idle one trims back to) this many token slots
# ... and grows by this many (or an eighth of itself, `BlockPool._grow`): memory follows use to
# within a step this size, where a step as large as the start left up to 4,095 slots unused
GROW_TOKENS = 1024


def growable_pool(loaded, config, extra_block_bytes: int = 0, reserved_bytes: int = 0) -> tuple[int, int, int] | None:
    """(initial blocks, cap, chunk) of a pool that grows as blocks are needed, or None for a
    fixed pool (`config.cache.num_blocks` set). The cap is memory alone: `config.cache.kv_memory_gb` if set,
    else `config.cache.kv_memory_fraction` of the memory free now. `max_kv_tokens` bounds only a fixed
    pool sized from memory (`pool_blocks`): a growing pool holds what is in use and trims back
    when idle, so a token cap would only refuse agent-sized contexts (a 27k-token prompt with
    `max_tokens` 32,000) that the memory holds. The pool starts at CHUNK_TOKENS slots and grows
    GROW_TOKENS at a time; `config.cache.kv_chunk_blocks`, if set, is both."""
    if config.cache.num_blocks is not None:
        return None
    shape = CacheShape.of(loaded).quantized(config.cache.kv_bits, config.cache.kv_group_size)
    bs = config.cache.block_size
    per_block = shape.bytes_per_block(bs) + extra_block_bytes
    if config.cache.kv_memory_gb is not None:
        cap = max(1, int(config.cache.kv_memory_gb * 1e9) // per_block)
    else:
        cap = blocks_for_memory(shape, bs, config.cache.kv_memory_fraction, 1 << 62, extra_block_bytes, reserved_bytes)
    if config.cache.kv_chunk_blocks:
        start = chunk = config.cache.kv_chunk_blocks
    else:
        start, chunk = max(1, CHUNK_TOKENS // bs), max(1, GROW_TOKENS // bs)
    return min(start, cap), cap, chunk


class PagedKVCache:
    """Per-layer K/V pools plus the two operations the allocator needs: write and copy blocks."""

    def __init__(
        self,
        shape: CacheShape,
        num_blocks: int,
        block_size: int,
        key_offsets: list[mx.array | None] | None = None,
        key_scales: list[mx.array] | None = None,
        groups: tuple[int, ...] = (),
        group_blocks: tuple[int, ...] = (),
        spec: CacheSpec | None = None,
    ):
        """`spec`: the model's declared cache (models/cache_spec.py), which the paged forward pass
        reads (None: the pass reads it off the model each time).
        `groups[layer]` is the KV cache group of the layer (`()`: every layer is group 0), whose
        pools hold `group_blocks[g]` blocks (default `num_blocks`, every group).
        `key_offsets[layer]` (`[num_kv_heads, head_dim]` or None) is subtracted from that
        layer's keys before they are quantized and `key_scales[layer]` (`[num_kv_heads,
        head_dim]`, positive) divides them: a quantized K row holds `quantize((k - offset) /
        scale)`, and `scale_queries` multiplies the layer's queries by the same scales."""
        for name, per_layer in (("key_offsets", key_offsets), ("key_scales", key_scales)):
            if per_layer is not None and (shape.kv_bits is None or len(per_layer) != shape.num_layers):
                raise ValueError(f"{name} need a quantized cache and one entry per layer")
        if key_scales is not None and any(
            tuple(c.shape) != dims or not bool((c > 0).all()) for c, dims in zip(key_scales, shape.layer_dims)
        ):
            raise ValueError(f"key_scales must be positive [num_kv_heads, head_dim] per layer = {shape.layer_dims}")
        self.key_offsets = key_offsets
        self.key_scales = key_scales
        self.spec = spec
        self.shape = shape
        self.quantized = shape.kv_bits is not None  # (an attribute: read per layer per step)
        self.block_size = block_size
        self.groups = tuple(groups) or (0,) * shape.num_layers
        if len(self.groups) != shape.num_layers or min(self.groups, default=0) < 0:
            raise ValueError(f"groups must name a group >= 0 for each of the {shape.num_layers} layers, got {groups}")
        num_groups = max(max(self.groups, default=0) + 1, len(group_blocks))
        self.group_blocks = list(group_blocks) + [num_blocks] * (num_groups - len(group_blocks))  # pool lengths
        if shape.keys_only and (key_offsets is not None or key_scales is not None):
            raise ValueError("a keys-only pool stores its keys unscaled: they are its values too")
        sized = [(self.group_blocks[g], *dims) for g, dims in zip(self.groups, shape.layer_dims)]
        self.keys = [self._pool(*x) for x in sized]
        self.values = [] if shape.keys_only else [self._pool(*x) for x in sized]
        mx.eval(self.arrays)
        # The pass's last slot mappings (one per group), each with its (blocks, heads, offsets)
        # index per KV-head count.
        self._write_index: list[tuple[mx.array, dict]] = []

    @property
    def num_blocks(self) -> int:
        """Group 0's pool length (every layer's, with one group)."""
        return self.group_blocks[0]

    @classmethod
    def for_model(
        cls,
        model,
        spec: CacheSpec,
        shape: CacheShape,
        num_blocks: int,
        block_size: int,
        key_scales: list[mx.array] | None = None,
        groups: tuple[int, ...] = (),
        group_blocks: tuple[int, ...] = (),
    ) -> PagedKVCache:
        """The cache for `model`'s layers as `spec` (its `cache_spec`) declares them. A quantized one
        takes the model's key offsets and `key_scales` (`kv_calibration.model_key_scales`), if given."""
        kw = {"groups": groups, "group_blocks": group_blocks, "spec": spec}
        if shape.kv_bits is None or shape.keys_only:
            return cls(shape, num_blocks, block_size, **kw)
        attentions = [attention_of(layer) for layer in paged_layers(model, spec)]
        return cls(shape, num_blocks, block_size, key_offsets(model, attentions=attentions), key_scales, **kw)

    def _pool(self, num_blocks: int, kv_heads: int, head_dim: int):
        s = self.shape
        if s.kv_bits is None:
            return mx.zeros((num_blocks, kv_heads, self.block_size, head_dim), dtype=s.dtype)
        return QuantizedPool.zeros(num_blocks, kv_heads, self.block_size, head_dim, s.dtype, s.kv_bits, s.kv_group_size)

    @property
    def arrays(self) -> list[mx.array]:
        """Every array of every pool (a quantized pool contributes codes, scales and biases)."""
        if not self.quantized:
            return self.keys + self.values
        return [a for pool in self.keys + self.values for a in pool.arrays]

    def _array_groups(self) -> list[int]:
        """The group of each array of `arrays`, in order."""
        per_pool = 3 if self.quantized else 1
        return [g for g in self.groups * (1 if self.shape.keys_only else 2) for _ in range(per_pool)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def group_block_bytes(self) -> list[int]:
        """Bytes one block costs in each group's pools, in group order."""
        out = [0] * len(self.group_blocks)
        for a, g in zip(self.arrays, self._array_groups()):
            out[g] += a.nbytes // a.shape[0]
        return out

    def write(self, layer: int, k: mx.array, v: mx.array, slot_mapping: mx.array) -> tuple[mx.array, mx.array]:
        """Store `k, v [num_tokens, num_kv_heads, head_dim]` at slots `block_id * block_size + offset`.

        Returns the updated pools of the layer (the same arrays the cache now holds).
        """
        # Every layer of a pass writes at the same slots: (block, head, offset) of each new row,
        # broadcast to [T, kv_heads] once per head count, so no layer's scatter broadcasts them again.
        index = next((ix for sm, ix in self._write_index if sm is slot_mapping), None)
        if index is None:
            index = {}
            self._write_index = [(slot_mapping, index)] + self._write_index[: len(self.group_blocks) - 1]
        kvh = k.shape[1]
        if kvh not in index:
            blocks, offsets = (slot_mapping // self.block_size)[:, None], (slot_mapping % self.block_size)[:, None]
            index[kvh] = mx.broadcast_arrays(blocks, mx.arange(kvh)[None, :], offsets)
        blocks, heads, offsets = index[kvh]
        if self.shape.keys_only:  # the value rows are the key rows (MLA)
            kp = self.keys[layer]
            if self.quantized:
                rows = mx.quantize(k.astype(kp.dtype), group_size=kp.group_size, bits=kp.bits)
                for dst, src in zip(kp.arrays, rows):
                    dst[blocks, heads, offsets] = src
            else:
                kp[blocks, heads, offsets] = k.astype(kp.dtype)
            return kp, kp
        kp, vp = self.keys[layer], self.values[layer]
        if self.quantized:
            if self.key_offsets is not None and self.key_offsets[layer] is not None:
                k = k - self.key_offsets[layer]  # the same shift for every key of a head: softmax cannot see it
            if self.key_scales is not None:
                k = k / self.key_scales[layer]  # undone in the queries (scale_queries)
            for pool, x in ((kp, k), (vp, v)):
                # Quantized in the pool's dtype, so the scales and biases land in that dtype.
                rows = mx.quantize(x.astype(pool.dtype), group_size=pool.group_size, bits=pool.bits)
                for dst, src in zip(pool.arrays, rows):
                    dst[blocks, heads, offsets] = src
            return kp, vp
        # Item assignment rebinds these very arrays to the scatter's result.
        kp[blocks, heads, offsets] = k.astype(kp.dtype)
        vp[blocks, heads, offsets] = v.astype(vp.dtype)
        return kp, vp

    def scale_queries(self, layer: int, q: mx.array) -> mx.array:
        """`q [T, num_heads, head_dim]` as attention must see it over this layer's stored keys:
        times the key scales (each KV head's scales for its query heads), so `(q * s) . (k / s)
        = q . k`. Unchanged without key scales."""
        if self.key_scales is None:
            return q
        T, H, D = q.shape
        s = self.key_scales[layer].astype(q.dtype)[:, None, :]  # [kvh, 1, D], broadcast over a head's G queries
        return (q.reshape(T, s.shape[0], H // s.shape[0], D) * s).reshape(T, H, D)

    def resize(self, num_blocks: int, copies: list[tuple[int, int]] = (), group: int = 0) -> None:
        """Apply block `copies` (src, dst), then make every pool of `group` `num_blocks` blocks
        long: zero blocks appended, or the blocks from `num_blocks` up dropped. Ids below both
        sizes keep their rows. A shrunk pool is a copy, so the old buffers are freed once MLX's
        cache is cleared."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.copy_blocks(list(copies), group)

        def fit(a: mx.array) -> mx.array:
            n = a.shape[0]
            if num_blocks > n:
                return mx.concatenate([a, mx.zeros((num_blocks - n,) + tuple(a.shape[1:]), dtype=a.dtype)])
            return mx.array(a[:num_blocks]) if num_blocks < n else a

        def fit_pool(pool):
            if not self.quantized:
                return fit(pool)
            return QuantizedPool(*(fit(a) for a in pool.arrays), pool.bits, pool.group_size)

        # One pool at a time, each evaluated before the next is built, with MLX's buffer cache off
        # meanwhile: an old pool's buffers go back to the system as soon as its copy exists, so a
        # resize holds the new pools and one old one, not both sizes of every pool at once (growing
        # 100 MB of pools to 200 MB held 285 MB for a moment, the process's peak RSS).
        limit = mx.set_cache_limit(0)
        try:
            for pools in (self.keys, self.values):
                for i, g in enumerate(self.groups[: len(pools)]):
                    if g == group:
                        pools[i] = fit_pool(pools[i])
                        mx.eval(pools[i].arrays if self.quantized else pools[i])
        finally:
            mx.set_cache_limit(limit)
        self.group_blocks[group] = num_blocks

    def copy_blocks(self, copies: list[tuple[int, int]], group: int = 0) -> None:
        """Copy whole blocks `src -> dst` in every layer of `group` (copy-on-write)."""
        if not copies:
            return
        src = mx.array([s for s, _ in copies], dtype=mx.int32)
        dst = mx.array([d for _, d in copies], dtype=mx.int32)
        for a, g in zip(self.arrays, self._array_groups()):
            if g == group:
                a[dst] = a[src]
        mx.eval(self.arrays)

    # -- the disk tier of the prefix cache (prefix_store.py) --------------------------------------------
    def gather_blocks(self, group_ids: list[list[int]]) -> list[mx.array]:
        """Lazily, every pool array's rows of some blocks as bytes: `uint8 [k, num_kv_heads,
        block_size, -1]` per array (`arrays` order), group g's arrays at `group_ids[g]` (the same
        blocks' ids in that group; a group past the list at group 0's). A snapshot: later writes
        to the pools do not change it."""
        idx = [mx.array(ids, dtype=mx.int32) for ids in group_ids]
        return [a[idx[g if g < len(idx) else 0]].view(mx.uint8) for a, g in zip(self.arrays, self._array_groups())]

    def block_nbytes(self) -> list[int]:
        """Bytes of one block in each pool array (`arrays` order)."""
        return [a.nbytes // a.shape[0] for a in self.arrays]

    def write_blocks(self, rows: list[np.ndarray], at: list[list[tuple[int, int]]]) -> None:
        """Store rows of `rows[i]` (`uint8 [k, block_nbytes()[i]]`, from `gather_blocks` or the
        disk) into pool array `i`; lazy, like a forward pass's writes. Group g's arrays take the
        rows `at[g]` names, `(row, block id in group g)` (a group past the list takes none)."""
        where = []
        for pairs in at:
            picked = np.array([r for r, _ in pairs], dtype=np.int64)
            where.append((picked, mx.array([b for _, b in pairs], dtype=mx.int32)))
        for a, r, g in zip(self.arrays, rows, self._array_groups()):
            if g >= len(where) or not len(where[g][0]):
                continue
            picked, idx = where[g]
            src = mx.array(np.ascontiguousarray(r[picked])).reshape(len(picked), *a.shape[1:-1], -1)
            a[idx] = src.view(a.dtype)
