"""RoPE for one forward pass: every layer rotates by the same positions, so on the CPU the
cosines and sines are computed once per pass instead of twice per layer.

On the CPU `mx.fast.rope` has no kernel: each call builds MLX's fallback graph (about 25 ops:
positions, inverse frequencies, cos, sin, then the rotation), about 150 us for a decode step of
the tiny test model, four times a step. `Rotary` takes the tables from one call of the model's
own rope module on a probe row (ones in the rotated first half, zeros in the second), whose
rotation is `(cos, sin)` exactly, and each layer then applies only the rotation, with the
fallback's own ops in its own order: the result is bit-identical to `rope(x, offset=positions)`.
On a GPU the fused kernel is one launch, cheaper than the rotation's nine ops, so it is called
as it is. Tables apply to ropes that only rotate: plain `nn.RoPE` and mlx-lm's `Llama3RoPE`
(Llama 3.1+: its own frequencies, `freqs`), non-traditional; other variants are called as they
are (YaRN and Phi-3's SuScaled ropes pre-multiply x, so a table would round differently).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def is_rotation(rope) -> bool:
    """A rope that only rotates x by the positions, in halves: its tables are exact (see above)."""
    rotates = type(rope) is nn.RoPE or type(rope).__name__ == "Llama3RoPE"
    return rotates and not rope.traditional


def table_key(rope) -> tuple:
    """Ropes with equal keys rotate alike: one table serves all of them in a pass."""
    if type(rope) is nn.RoPE:
        return ("rope", rope.dims, rope.base, rope.scale)
    return (type(rope).__name__, rope.dims, tuple(rope._freqs.tolist()))


class Rotary:
    """`rotary(x)` rotates x `[T, heads, head_dim]` (token t at `positions[t]`) as
    `rope(x[:, :, None], offset=positions)[:, :, 0]`, and x `[T, heads, 1, head_dim]` (mlx-lm's
    layout of T rows of one token) as `rope(x, offset=positions)`; the tables are built on first
    use per dtype and layout."""

    def __init__(self, rope: nn.Module, positions: mx.array):
        self.rope = rope
        self.positions = positions
        self.tabled = is_rotation(rope) and mx.default_device() == mx.cpu
        self._tables: dict = {}  # (dtype, ndim) -> (cos, sin), each [T, 1, dims / 2] or [T, 1, 1, dims / 2]

    def __call__(self, x: mx.array) -> mx.array:
        if not self.tabled:  # each token a batch row of one position, as rope's offsets are per row
            if x.ndim == 4:
                return self.rope(x, offset=self.positions)
            return self.rope(x[:, :, None, :], offset=self.positions)[:, :, 0, :]
        half = self.rope.dims // 2
        key = (x.dtype, x.ndim)
        if key not in self._tables:
            probe = mx.concatenate([mx.ones((half,), x.dtype), mx.zeros((half,), x.dtype)])
            rot = self.rope(mx.broadcast_to(probe, (x.shape[0], 1, 1, 2 * half)), offset=self.positions)
            if x.ndim == 3:
                rot = rot.reshape(x.shape[0], 1, 2 * half)
            self._tables[key] = (rot[..., :half], rot[..., half:])  # 1*cos - 0*sin, 1*sin + 0*cos
        cos, sin = self._tables[key]
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
        if 2 * half < x.shape[-1]:
            parts.append(x[..., 2 * half :])  # dims < head_dim: the rest passes through
        return mx.concatenate(parts, axis=-1)
