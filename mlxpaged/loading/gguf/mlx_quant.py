"""GGUF block types as MLX affine quantization (``w = scale * q + bias``, group size 32).

MLX's affine layout (``mx.quantize``/``mx.dequantize``, ``nn.QuantizedLinear``): each row
is cut into groups of ``GROUP_SIZE`` values; value i of a group is an unsigned
``bits``-bit code q_i, and ``w_i = scale * q_i + bias`` with one scale and one bias per
group.  Codes are packed as one little-endian bit stream per row (lowest bits first),
read as uint32.

Exact types (``EXACT_BITS``): every GGUF block splits into 32-value groups whose values
are ``d * (q - offset)`` or ``d * q + m``, so the codes are copied unchanged and

- Q8_0 (int8 q), Q4_0 (q - 8), Q5_0 (q - 16): scale = d, bias = -d * 2^(bits-1)
  (the int8 code is stored as q + 128);
- Q4_1, Q5_1: scale = d, bias = m;
- Q4_K, Q5_K: eight 32-value sub-blocks of a 256-value super-block,
  scale = d * sc_j, bias = -dmin * m_j (6-bit sc_j, m_j).

Each scale and bias is exact in float32 (a float16 times an integer below 2^8), and
``scale * q`` is exact (at most 17 + 5 significant bits), so ``mx.dequantize`` rounds
once, where gguf-py's decoder rounds once, and gives the same float32 values (a
zero may differ in sign).  Scales are stored in float16 where that is exact (the
legacy types) and in float32 otherwise (the K types: d * sc_j needs up to 17 bits).

Requantized types (``REQUANT_TYPES``): Q2_K, Q3_K and Q6_K scale 16-value
sub-blocks, which no MLX group size (32, 64, 128) can hold, so they are decoded to
float32 and quantized again to ``REQUANT_BITS`` bits, group 32, min-max per group
(error at most half a grid step, 1/510 of the group's range); the result records the
maximum and RMS error of that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from .reader import dequantize

__all__ = ["GROUP_SIZE", "EXACT_BITS", "REQUANT_TYPES", "REQUANT_BITS", "MLXQuantized", "to_mlx", "pack_codes"]

GROUP_SIZE = 32
EXACT_BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8, T.Q4_K: 4, T.Q5_K: 5}
REQUANT_TYPES = frozenset({T.Q2_K, T.Q3_K, T.Q6_K})
REQUANT_BITS = 8


@dataclass
class MLXQuantized:
    """One weight in MLX's affine layout: ``weight`` uint32 (rows, cols * bits / 32),
    ``scales`` and ``biases`` (rows, cols / 32).  ``max_error``/``rms_error``: 0 for an
    exact mapping, else the requantization's error against the GGUF's own decoding."""

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    exact: bool
    max_error: float = 0.0
    rms_error: float = 0.0


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes (rows, cols) into MLX's uint32 words: a little-endian bit stream per row."""
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    rows, cols = codes.shape
    if bits == 8:
        return codes.view("<u4")
    if bits == 4:
        return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4)).view("<u4")
    out = np.empty((rows, cols * bits // 8), dtype=np.uint8)
    shifts = np.arange(bits, dtype=np.uint8)
    step = max(1, (1 << 24) // max(cols * bits, 1))  # bounds the bit-plane buffer to ~16 MB
    for r in range(0, rows, step):
        planes = (codes[r : r + step, :, None] >> shifts) & 1
        out[r : r + step] = np.packbits(planes.reshape(planes.shape[0], cols * bits), axis=1, bitorder="little")
    return out.view("<u4")


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row (n, 2) -> float32 (n, 1)."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Legacy layout: value j is the low nibble of qs[j], value j + 16 its high nibble."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1)


def _legacy(blocks: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes (n, 32), scale (n, 1), bias (n, 1)) of n legacy blocks."""
    d = _f16(blocks[:, 0:2])
    if qtype == T.Q8_0:
        codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d, -128 * d
    has_min = qtype in (T.Q4_1, T.Q5_1)
    m = _f16(blocks[:, 2:4]) if has_min else None
    pos = 4 if has_min else 2
    codes = _nibbles(blocks[:, -16:])
    if qtype in (T.Q5_0, T.Q5_1):
        qh = np.ascontiguousarray(blocks[:, pos : pos + 4]).view("<u4")
        codes = codes | ((((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8))
    if has_min:
        return codes, d, m
    return codes, d, -float(1 << (EXACT_BITS[qtype] - 1)) * d


def _k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block (ggml's get_scale_min_k4)."""
    a, b, c = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = np.concatenate([a & 63, (c & 0xF) | ((a >> 6) << 4)], axis=1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return scales, mins


def _k_quant(blocks: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes (n, 256), scale (n, 8), bias (n, 8)) of n Q4_K/Q5_K blocks."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    qs = blocks[:, -128:].reshape(n, 4, 32)
    # Sub-block 2j: low nibbles of qs[32j:32j+32]; sub-block 2j+1: their high nibbles.
    codes = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(n, 8, 32)
    if qtype == T.Q5_K:
        qh = blocks[:, 16:48]  # bit j of qh[l] is the fifth bit of value l of sub-block j
        codes = codes | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
    return codes.reshape(n, 256).astype(np.uint8), d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _exact(raw: np.ndarray, qtype: T, shape: tuple[int, int]) -> MLXQuantized:
    rows, cols = shape
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size)
    codes, scale, bias = (_k_quant if qtype in (T.Q4_K, T.Q5_K) else _legacy)(blocks, qtype)
    bits = EXACT_BITS[qtype]
    groups = cols // GROUP_SIZE
    weight = pack_codes(codes.reshape(rows, cols), bits)
    return MLXQuantized(weight, _narrow(scale.reshape(rows, groups)), _narrow(bias.reshape(rows, groups)), bits, True)


def _narrow(x: np.ndarray) -> np.ndarray:
    """float16 when it holds every value exactly (and finitely), else float32."""
    h = x.astype(np.float16)
    return h if np.array_equal(h.astype(np.float32), x) else x.astype(np.float32)


def _requantize(raw: np.ndarray, qtype: T, shape: tuple[int, int]) -> MLXQuantized:
    """Min-max affine quantization of each 32-value group: scale = (max - min) / (2^bits - 1),
    bias = min, so every value lies within half a step of the grid.  (mx.quantize instead
    makes zero exact and can leave the far end 0.8 of a step off.)"""
    import mlx.core as mx

    rows, cols = shape
    ref = dequantize(raw, qtype).reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    lo, hi = ref.min(axis=-1, keepdims=True), ref.max(axis=-1, keepdims=True)
    scale = (hi - lo) / np.float32((1 << REQUANT_BITS) - 1)
    safe = np.where(scale > 0, scale, np.float32(1))  # a constant group: every code 0, bias = the value
    codes = np.clip(np.rint((ref - lo) / safe), 0, (1 << REQUANT_BITS) - 1).astype(np.uint8)
    weight = pack_codes(codes.reshape(rows, cols), REQUANT_BITS)
    scales, biases = scale.reshape(rows, -1).astype(np.float32), lo.reshape(rows, -1).astype(np.float32)
    back = np.array(
        mx.dequantize(mx.array(weight), mx.array(scales), mx.array(biases), group_size=GROUP_SIZE, bits=REQUANT_BITS)
    )
    err = back.astype(np.float64) - ref.reshape(rows, cols)
    return MLXQuantized(
        weight, scales, biases, REQUANT_BITS, False, float(np.abs(err).max()), float(np.sqrt(np.mean(err * err)))
    )


def to_mlx(raw: np.ndarray, qtype: T, shape: tuple[int, int]) -> MLXQuantized:
    """Map a 2-D GGUF weight (raw bytes, uint8 rows) to MLX's affine layout, group size 32.

    ``shape`` is (rows, cols) in numpy order.  Exact for ``EXACT_BITS`` types,
    8-bit requantization for ``REQUANT_TYPES``; ValueError for any other type.
    """
    qtype = T(qtype)
    if len(shape) != 2 or shape[1] % GROUP_SIZE:
        raise ValueError(f"cannot quantize a tensor of shape {tuple(shape)} in groups of {GROUP_SIZE}")
    if qtype in EXACT_BITS:
        return _exact(raw, qtype, shape)
    if qtype in REQUANT_TYPES:
        return _requantize(raw, qtype, shape)
    raise ValueError(f"{qtype.name} has no MLX quantized form here")
