"""Sliding windows and attention sinks in the varlen (prefill) Metal kernels, run in
the MSL emulator against float64 numpy (test_windows.numpy_attention): both float kernels
(simdgroup_matrix and lanes-per-row) at windows of 1, 3, 4 (the block size), 9 and more than
any context, with and without sinks, over a ragged batch (one-token sequences between chunks,
a 40-token prompt several windows long over no prefix, tiles that start mid-window); fp16 and
an 8-bit pool; the point of the window on long prompts (blocks before a tile's window unread);
and the public op's routing, with its fallback when the kernel fails.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest
from test_windows import numpy_attention

from mlxpaged.attention import metal, paged_attention_varlen
from mlxpaged.attention import metal_varlen as mv
from mlxpaged.attention.kv_quant import QuantizedPool

from attention_cases import make_varlen_case
from kernel_cases import Recording

BS = 4
# Decodes between chunks; the 40-token prompt over nothing spans 3 tiles and several windows.
Q_LENS, PREFIXES = [1, 7, 1, 40, 20], [20, 9, 3, 0, 5]
WINDOWS = (None, 1, 3, 4, 9, 64)  # 64: longer than every context
SCALE = 0.125


def _case(seed, dtype, bits=None, q_lens=Q_LENS, prefixes=PREFIXES):
    """(mx inputs, sinks, numpy inputs on the values the kernel reads: rounded to dtype,
    or the kernel's own fp32 dequantization of an 8-bit pool)."""
    rng = np.random.default_rng(seed)
    q, kc, vc, tables, cu, ctx = make_varlen_case(rng, 64, 2, BS, q_lens, prefixes)
    sinks = rng.normal(1.0, 1.5, size=q.shape[1]).astype(np.float32)
    qm, km, vm = (mx.array(a, dtype=dtype) for a in (q, kc, vc))
    if bits:
        km, vm = QuantizedPool.quantize(km, bits, 32), QuantizedPool.quantize(vm, bits, 32)
    kc, vc = (np.array(metal.dequantized(p).astype(mx.float32)) for p in (km, vm))
    args = (qm, km, vm, mx.array(tables), mx.array(cu), mx.array(ctx))
    return args, sinks, (np.array(qm.astype(mx.float32)), kc, vc, tables, cu, ctx)


def _check(got, np_args, window, sinks, dtype):
    want = numpy_attention(*np_args, SCALE, window, sinks)
    atol, rtol = metal.CHECK_TOLERANCE[dtype]
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, atol=atol, rtol=rtol)


def _run(args, window, sinks):
    out, launches = mv.run_with_launches(
        *args, scale=SCALE, window=window, sinks=None if sinks is None else mx.array(sinks)
    )
    assert isinstance(launches[0], mv.Launch)  # the varlen kernel ran (the decodes follow)
    return out, launches


@pytest.mark.parametrize("lanes", [False, True], ids=["mma", "lanes"])
def test_windows_and_sinks_match_numpy_fp32(emulated, monkeypatch, lanes):
    if lanes:
        monkeypatch.setattr(mv, "mma_fits", lambda head_dim, group: False)
    args, sinks, np_args = _case(1, mx.float32)
    for window in WINDOWS:
        for sk in (None, sinks):
            out, launches = _run(args, window, sk)
            p = launches[0]
            assert p.kind == (mv.KERNEL if lanes else mv.MMA_KERNEL)
            assert p.variant.endswith(("_w" if window else "") + ("_sk" if sk is not None else "")), p.variant
            _check(out, np_args, window, sk, mx.float32)


@pytest.mark.parametrize(
    "dtype,bits,window,with_sinks",
    [(mx.float16, None, 9, True), (mx.float32, 8, 3, True), (mx.float32, 8, 9, False)],
    ids=["fp16-mma", "q8-sinks", "q8"],
)
def test_fp16_and_8bit_pools(emulated, dtype, bits, window, with_sinks):
    args, sinks, np_args = _case(2, dtype, bits)
    sk = sinks if with_sinks else None
    out, launches = _run(args, window, sk)
    assert out.dtype == dtype
    assert launches[0].kind == (mv.QUANT_KERNEL if bits else mv.MMA_KERNEL)
    _check(out, np_args, window, sk, dtype)


@pytest.mark.parametrize("lanes", [False, True], ids=["mma", "lanes"])
def test_blocks_before_a_tiles_window_are_not_read(emulated, monkeypatch, lanes):
    """A 200-token prompt over 56 cached at window 6: each 16-token tile reads its window's
    blocks (about 6 + 16 + a block's keys), not every key before it. The blocks before the
    first query's window hold NaN: a kernel that read them (even masked: 0 * NaN) would not
    give numpy's finite result."""
    if lanes:
        monkeypatch.setattr(mv, "mma_fits", lambda head_dim, group: False)
    q_lens, prefixes = [200], [56]
    args, sinks, np_args = _case(3, mx.float32, q_lens=q_lens, prefixes=prefixes)
    reads = {}
    for window in (None, 6):
        if window:  # positions 0 .. 47 (blocks 0 .. 11): before position 56's window (51 ..)
            q, k, v, tables, cu, ctx = args
            dead = mx.array(np_args[3][0, :12])
            k, v = (c.at[dead].add(mx.array(np.nan, dtype=c.dtype)) for c in (k, v))
            args = (q, k, v, tables, cu, ctx)
        out, (launch,) = _run(args, window, sinks)
        _check(out, np_args, window, sinks, mx.float32)
        stats = launch.kernel.last_stats
        reads[window] = stats["k_cache"] + stats["v_cache"]
    row = 2 * 2 * 64 * 4  # K and V, 2 kv heads, head_dim 64, fp32: bytes per position
    tiles = -(-200 // mv.TILE_TOKENS)
    # Causal: tile t reads positions 0 .. its last one; windowed: at most its window's first
    # block to its last token, window - 1 + 16 positions and a block's start.
    assert reads[None] >= tiles * (56 + 16) * row
    assert reads[6] <= tiles * (6 - 1 + 16 + BS - 1) * row < reads[None] / 5


def test_public_op_routes_windowed_prefill_to_the_kernel(emulated, monkeypatch):
    """`paged_attention_varlen(impl="metal")` with a window and sinks on a batch with chunks runs
    the varlen kernel (after its flags' first-use check) and the decode kernels, not the
    reference."""
    args, sinks, np_args = _case(4, mx.float32)
    metal.reset_kernels()  # the family's plain check runs here too
    ran = []
    real = mv.Launch.run
    monkeypatch.setattr(mv.Launch, "run", lambda self: ran.append(self.variant) or real(self))
    got = paged_attention_varlen(*args, scale=SCALE, impl="metal", window=9, sinks=mx.array(sinks))
    _check(got, np_args, 9, sinks, mx.float32)
    # the family's plain check, its window-and-sinks check, then the call
    assert [v.endswith("_w_sk") for v in ran] == [False, True, True], ran
    key = metal.family_key(2, args[1], varlen=True)
    assert metal._families[key] and metal._families[key + ("window", "sinks")]


def test_a_failing_windowed_kernel_falls_back_to_the_reference(monkeypatch):
    """A windowed varlen kernel that fails mid-serving (as a Metal build would) still gives the
    reference's result: one warning, then that shape takes the reference."""
    factory = Recording(refuse="paged_attention_varlen_mma", after=2)  # the two first-use checks pass
    monkeypatch.setattr(metal, "_metal_kernel_factory", lambda: factory)
    monkeypatch.delenv("MLXPAGED_METAL", raising=False)
    metal.reset_kernels()
    mv._kernel.cache_clear()
    args, sinks, np_args = _case(5, mx.float32, q_lens=[5, 1, 12], prefixes=[3, 20, 0])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                got = paged_attention_varlen(*args, scale=SCALE, impl="metal", window=3, sinks=mx.array(sinks))
                _check(got, np_args, 3, sinks, mx.float32)
        runtime = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(runtime) == 1 and "paged_attention_varlen_mma" in runtime[0] and "_w_sk" in runtime[0], runtime
    finally:
        metal.reset_kernels()
        mv._kernel.cache_clear()


# Mutants of the MMA kernel's window and sink code (each anchor occurs there once): a kernel
# with one must fail the comparison. (By hand, also caught: the window one key too wide or too
# narrow in `pav_visible`, the walk one key late, sinks in the log2 domain missed, the other
# kv head's sinks in the lanes kernel.)
WINDOW_MUTANTS = [
    (
        "walk begins a block late",
        "pav_walk_begin(first_pos + i0, win, BS)",
        "pav_walk_begin(first_pos + i0, win, BS) + BS",
    ),
    ("sink in the numerator too", "of[d].thread_elements()[e] / den", "(of[d].thread_elements()[e] + den - l) / den"),
]


@pytest.mark.parametrize("mutant", WINDOW_MUTANTS, ids=[m[0] for m in WINDOW_MUTANTS])
def test_window_and_sink_mutants_are_caught(emulated, monkeypatch, mutant):
    from test_metal_varlen import mutate

    _, old, new = mutant
    mutate(monkeypatch, old, new, mv.MMA_KERNEL)
    args, sinks, np_args = _case(1, mx.float32)
    try:
        out, _ = _run(args, 9, sinks)
        with pytest.raises(AssertionError):
            _check(out, np_args, 9, sinks, mx.float32)
    finally:
        mv._kernel.cache_clear()  # drop the mutated kernel
