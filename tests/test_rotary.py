"""`models.rotary.Rotary`: RoPE tables built once per pass must rotate exactly as `mx.fast.rope`
does with per-token offsets (bit for bit: greedy tokens are compared with mlx-lm's), and fall
back to the module itself where tables do not apply."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxpaged.models.rotary import Rotary


def numpy_rope(x: np.ndarray, positions: np.ndarray, dims: int, base: float) -> np.ndarray:
    """Non-traditional RoPE in float64 of x `[T, heads, 1, head_dim]`: the first `dims` channels rotate in halves."""
    half = dims // 2
    inv = np.exp(-np.arange(half) * (math.log(base) / half))
    theta = positions[:, None].astype(np.float64) * inv  # [T, half]
    c, s = np.cos(theta)[:, None, None, :], np.sin(theta)[:, None, None, :]
    x1, x2 = x[..., :half], x[..., half:dims]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c, x[..., dims:]], axis=-1)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("dims,head_dim", [(64, 64), (32, 64), (128, 128)])
def test_tables_equal_fast_rope_bit_for_bit(dtype, dims, head_dim):
    rope = nn.RoPE(dims, base=1e6)
    positions = mx.array(np.random.default_rng(dims).integers(0, 32768, 41).astype(np.int32))
    x = mx.random.normal((41, 3, head_dim), key=mx.random.key(head_dim)).astype(dtype)
    rot = Rotary(rope, positions)
    assert rot.tabled  # the CPU: tables in use
    got, want = rot(x), rope(x[:, :, None], offset=positions)[:, :, 0]
    assert got.dtype == want.dtype and mx.array_equal(got, want).item()
    again = rot(x * 2)  # the tables are reused for the next application (another layer's keys)
    assert mx.array_equal(again, rope(x[:, :, None] * 2, offset=positions)[:, :, 0]).item()


def test_tables_equal_numpy_rope():
    rope = nn.RoPE(64, base=10000.0)
    positions = np.array([0, 1, 17, 4095, 30000], dtype=np.int32)
    x = np.random.default_rng(0).standard_normal((5, 2, 64)).astype(np.float32)
    got = np.array(Rotary(rope, mx.array(positions))(mx.array(x)))
    want = numpy_rope(x[:, :, None].astype(np.float64), positions, 64, 10000.0)[:, :, 0]
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


def test_other_ropes_call_the_module():
    positions = mx.array([3, 9], dtype=mx.int32)
    x = mx.random.normal((2, 2, 16), key=mx.random.key(1))
    trad = nn.RoPE(16, traditional=True)
    rot = Rotary(trad, positions)
    assert not rot.tabled and mx.array_equal(rot(x), trad(x[:, :, None], offset=positions)[:, :, 0]).item()

    class Scaled(nn.RoPE):  # a rope variant: not plain nn.RoPE, so never tabled
        def __call__(self, x, offset=0):
            return super().__call__(x * 0.5, offset)

    scaled = Scaled(16)
    rot = Rotary(scaled, positions)
    assert not rot.tabled and mx.array_equal(rot(x), scaled(x[:, :, None], offset=positions)[:, :, 0]).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_tables_on_rows_of_one_token_equal_fast_rope(dtype):
    """mlx-lm's layout `[T, heads, 1, head_dim]` (the paged adapter's rows of one token)."""
    rope = nn.RoPE(64, base=1e4)
    positions = mx.array(np.random.default_rng(5).integers(0, 4096, 9).astype(np.int32))
    x = mx.random.normal((9, 4, 1, 64), key=mx.random.key(3)).astype(dtype)
    rot = Rotary(rope, positions)
    assert mx.array_equal(rot(x), rope(x, offset=positions)).item()
    assert mx.array_equal(rot(x[:, :, 0]), rope(x, offset=positions)[:, :, 0]).item()  # both layouts, one Rotary


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_llama3_scaled_rope_tables_equal_the_module(dtype):
    """mlx-lm's Llama 3 RoPE (its own frequencies) only rotates: tabled, bit for bit."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    cfg = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    rope = Llama3RoPE(64, max_position_embeddings=4096, base=500000.0, scaling_config=cfg)
    positions = mx.array(np.random.default_rng(7).integers(0, 4096, 13).astype(np.int32))
    x = mx.random.normal((13, 4, 1, 64), key=mx.random.key(9)).astype(dtype)
    rot = Rotary(rope, positions)
    assert rot.tabled and mx.array_equal(rot(x), rope(x, offset=positions)).item()
    # Its tables differ from a plain RoPE of the same base: the frequencies are its own.
    plain = Rotary(nn.RoPE(64, base=500000.0), positions)
    assert not mx.array_equal(plain(x), rot(x)).item()
