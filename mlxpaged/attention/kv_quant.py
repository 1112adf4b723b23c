"""Quantized KV rows: MLX's affine quantization along head_dim, kept in the paged pools' layout.

Each cached row (one token, one KV head) is split into groups of `group_size` values along
head_dim; a group stores `bits`-bit codes plus one scale and one bias, so
`value = scale * code + bias`, exactly as `mx.quantize` / `mx.dequantize` define it. The pools
keep the block layout of the float cache, so block id `b` means the same slots in every pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

# The supported formats are config's (it validates them with no MLX); re-exported for the kernels.
from ..config import KV_BITS, KV_GROUP_SIZES, check_kv_quant  # noqa: F401


def row_bytes(head_dim: int, bits: int | None, group_size: int, dtype: mx.Dtype) -> int:
    """Bytes of one cached row of `head_dim` values: codes plus a scale and a bias per group."""
    if bits is None:
        return head_dim * dtype.size
    return head_dim * bits // 8 + 2 * (head_dim // group_size) * dtype.size


@dataclass
class QuantizedPool:
    """One layer's K (or V) pool, rows quantized along head_dim.

    Invariant: the three arrays share the leading `[num_blocks, num_kv_heads, block_size]`, and
    row `[b, h, o]` is `mx.dequantize(data[b, h, o], scales[b, h, o], biases[b, h, o],
    group_size, bits)`. Writers assign into these arrays in place (slot by slot).
    """

    data: mx.array  # [num_blocks, num_kv_heads, block_size, head_dim * bits // 32] uint32
    scales: mx.array  # [num_blocks, num_kv_heads, block_size, head_dim // group_size] float
    biases: mx.array  # [num_blocks, num_kv_heads, block_size, head_dim // group_size] float
    bits: int
    group_size: int

    @classmethod
    def zeros(
        cls,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: mx.Dtype,
        bits: int,
        group_size: int,
    ) -> QuantizedPool:
        check_kv_quant(bits, group_size, head_dim)
        lead = (num_blocks, num_kv_heads, block_size)
        return cls(
            mx.zeros(lead + (head_dim * bits // 32,), dtype=mx.uint32),
            mx.zeros(lead + (head_dim // group_size,), dtype=dtype),
            mx.zeros(lead + (head_dim // group_size,), dtype=dtype),
            bits,
            group_size,
        )

    @classmethod
    def quantize(cls, x: mx.array, bits: int, group_size: int) -> QuantizedPool:
        """Quantize float rows `x [..., head_dim]` (a whole pool, or the rows of a write)."""
        check_kv_quant(bits, group_size, x.shape[-1])
        data, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
        return cls(data, scales, biases, bits, group_size)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical (float) shape `[num_blocks, num_kv_heads, block_size, head_dim]`."""
        return tuple(self.data.shape[:-1]) + (self.data.shape[-1] * 32 // self.bits,)

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype rows dequantize to (that of the scales)."""
        return self.scales.dtype

    @property
    def arrays(self) -> list[mx.array]:
        return [self.data, self.scales, self.biases]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def dequantize(self) -> mx.array:
        """The whole pool as float rows `[num_blocks, num_kv_heads, block_size, head_dim]`."""
        return mx.dequantize(self.data, self.scales, self.biases, group_size=self.group_size, bits=self.bits)


def dequantize_rows(data: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """Float rows of quantized `data`/`scales`/`biases` (any leading shape): the one place the
    reference turns codes back into values, so a test can swap in a wrong one."""
    return mx.dequantize(data, scales, biases, group_size=group_size, bits=bits)


def gather_rows(pool: QuantizedPool, rows: mx.array) -> mx.array:
    """Dequantized rows `pool[(block, head) rows]`: `rows` indexes the pool seen as
    `[num_blocks * num_kv_heads, block_size, ...]`; only those rows are dequantized.

    Returns `rows.shape + [block_size, head_dim]` in the pool's dtype.
    """
    nb, kvh, bs, _ = pool.shape
    data, scales, biases = (a.reshape(nb * kvh, bs, a.shape[-1])[rows] for a in pool.arrays)
    return dequantize_rows(data, scales, biases, pool.bits, pool.group_size)


def key_offsets(model, num_positions: int = 4096, attentions: list | None = None) -> list[mx.array | None]:
    """Per layer, a constant `[num_kv_heads, head_dim]` to subtract from keys before quantizing.

    Why: Qwen2's k_proj bias puts a few channels of every key near +-150 while the rest stay
    within +-5, so one scale per row group wastes nearly all its levels on those channels. A
    constant c per (layer, KV head) can be taken out of every cached key for free: q.(k - c) =
    q.k - q.c shifts all of one query's scores equally, and softmax ignores the shift. c is the
    bias after the model's own RoPE, averaged over positions 0..num_positions-1: its slow channels
    (the outliers) barely rotate, so c removes them; fast ones average out to about 0.
    None for a layer without a k_proj bias (nothing to remove).
    """
    offsets = []
    # `attentions`: the pool layers' attention modules (a hybrid's attention layers; dbrx's nested one)
    for attn in [layer.self_attn for layer in model.layers] if attentions is None else attentions:
        bias = getattr(attn.k_proj, "bias", None) if hasattr(attn, "k_proj") else None
        # Attention sinks (gpt-oss) are logits the shift q.c does not move: softmax would see it.
        if bias is None or not hasattr(attn, "rope") or "sinks" in attn:
            offsets.append(None)
            continue
        b = bias.astype(mx.float32).reshape(1, -1, 1, attn.head_dim)  # [1, kvh, L=1, d], as the model ropes keys
        rows = attn.rope(mx.broadcast_to(b, (num_positions,) + b.shape[1:]), offset=mx.arange(num_positions))
        offsets.append(rows.mean(axis=0)[:, 0])
    mx.eval([o for o in offsets if o is not None])
    return offsets
