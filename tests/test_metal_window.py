"""Sliding windows and attention sinks in the Metal decode kernels (single pass, split + merge;
float and 8-bit pools), run in the MSL emulator against float64 numpy (test_windows.numpy_attention):
windows smaller than, equal to and larger than a block, contexts several times the window; and
the point of the window on long contexts: the blocks wholly before it are never read.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_windows import numpy_attention

from mlxpaged.attention import metal, metal_varlen, paged_attention, paged_attention_varlen
from mlxpaged.attention.kv_quant import QuantizedPool

from attention_cases import make_varlen_case

BS = 4
CTX = [41, 10, 3, 20]  # several times the windows below; one shorter than all of them


def _case(seed, dtype, bits=None, ctx=CTX, head_dim=64, group=2):
    rng = np.random.default_rng(seed)
    q, kc, vc, tables, _, lens = make_varlen_case(rng, head_dim, group, BS, [1] * len(ctx), [c - 1 for c in ctx])
    sinks = rng.normal(1.0, 1.5, size=q.shape[1]).astype(np.float32)
    qm, km, vm = (mx.array(a, dtype=dtype) for a in (q, kc, vc))
    if bits:
        km, vm = QuantizedPool.quantize(km, bits, 32), QuantizedPool.quantize(vm, bits, 32)
        # numpy on the kernels' own dequantization (fp32, unrounded)
        kc, vc = (np.array(metal.dequantized(p)) for p in (km, vm))
    else:
        kc, vc = (np.array(a.astype(mx.float32)) for a in (km, vm))
    return qm, km, vm, mx.array(tables), mx.array(lens), sinks, (np.array(qm.astype(mx.float32)), kc, vc, tables, lens)


def _check(got, np_args, window, sinks, dtype):
    q, kc, vc, tables, lens = np_args
    cu = np.arange(len(lens) + 1)
    want = numpy_attention(q, kc, vc, tables, cu, lens, 0.125, window, sinks)
    atol, rtol = metal.CHECK_TOLERANCE[dtype]
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("part", [0, 8], ids=["single", "split"])
def test_windows_and_sinks_match_numpy_fp32(emulated, part):
    q, k, v, tables, lens, sinks, np_args = _case(1, mx.float32)
    for window in (None, 1, 3, 4, 9, 64):
        for sk in (None, sinks):
            got, launches = metal.run_with_launches(
                q,
                k,
                v,
                tables,
                lens,
                scale=0.125,
                partition_tokens=part,
                window=window,
                sinks=None if sk is None else mx.array(sk),
            )
            assert len(launches) == (2 if part else 1)  # the kernels ran, not the reference
            _check(got, np_args, window, sk, mx.float32)


@pytest.mark.parametrize(
    "dtype,bits,window,part",
    [(mx.float16, None, 9, 8), (mx.bfloat16, None, 3, 0), (mx.float32, 8, 3, 8), (mx.float16, 8, 4, 0)],
    ids=["fp16-split", "bf16-single", "q8-split", "q8fp16-single"],
)
def test_half_dtypes_and_8bit_pools(emulated, dtype, bits, window, part):
    q, k, v, tables, lens, sinks, np_args = _case(2, dtype, bits)
    for sk in (None, sinks):
        got = metal.paged_attention_metal(
            q,
            k,
            v,
            tables,
            lens,
            scale=0.125,
            partition_tokens=part,
            window=window,
            sinks=None if sk is None else mx.array(sk),
        )
        assert got.dtype == dtype
        _check(got, np_args, window, sk, dtype)


@pytest.mark.parametrize("part", [0, 32], ids=["single", "split"])
def test_blocks_before_the_window_are_not_read(emulated, part):
    """A context of 256 with a window of 6: the kernels read a few blocks' rows, not 256."""
    q, k, v, tables, lens, sinks, np_args = _case(3, mx.float32, ctx=[256, 255])
    reads = {}
    for window in (None, 6):
        got, launches = metal.run_with_launches(
            q, k, v, tables, lens, scale=0.125, partition_tokens=part, window=window, sinks=mx.array(sinks)
        )
        _check(got, np_args, window, sinks, mx.float32)
        stats = metal._kernel(metal._metal_kernel_factory(), launches[0].kind, launches[0].variant).last_stats
        reads[window] = stats["k_cache"] + stats["v_cache"]  # the attention pass's K/V bytes
    rows = 2 * 2 * 64 * 4  # K and V, 2 kv heads, head_dim 64, fp32: bytes per position
    assert reads[None] >= 2 * 255 * rows  # the whole contexts
    # the window's 6 positions start within a block: at most 3 blocks per sequence
    assert 2 * 6 * rows <= reads[6] <= 2 * 3 * BS * rows


def test_through_the_public_ops(emulated):
    """paged_attention and an all-decode paged_attention_varlen with impl="metal" give the
    kernels' result with a window and sinks."""
    q, k, v, tables, lens, sinks, np_args = _case(4, mx.float32)
    sk = mx.array(sinks)
    got = paged_attention(q, k, v, tables, lens, scale=0.125, impl="metal", window=5, sinks=sk)
    _check(got, np_args, 5, sinks, mx.float32)
    cu = mx.arange(len(CTX) + 1, dtype=mx.int32)
    got = paged_attention_varlen(q, k, v, tables, cu, lens, scale=0.125, impl="metal", window=5, sinks=sk)
    _check(got, np_args, 5, sinks, mx.float32)


def test_gpt_oss_decodes_through_the_kernels_like_mlx_lm(emulated, tmp_path):
    """gpt-oss tiny (windowed and full layers, sinks) at window 4, block size 4: its decode steps
    run the emulated decode kernels with the window and the sinks, its prefill chunks the varlen
    kernel with them, and give mlx-lm's own greedy tokens."""
    import mlx_lm

    from mlxpaged import EngineConfig, LLMEngine, SamplingParams
    from mlxpaged.loading.loader import load
    from mlxpaged.testing.tiny_model import write_tiny_family

    from drive import run_all
    from reference import contiguous_generate

    path = write_tiny_family(tmp_path, "gpt_oss", sliding_window=4)
    ref_model, tok = mlx_lm.load(str(path))
    engine = LLMEngine(load(str(path), "float32"), EngineConfig.of(block_size=4, num_blocks=64, attention_impl="metal"))
    calls = []
    real = metal.run_with_launches

    def counting(*a, **k):
        out = real(*a, **k)
        calls.append((k.get("window"), k.get("sinks") is not None, len(out[1])))
        return out

    metal_run = pytest.MonkeyPatch()
    metal_run.setattr(metal, "run_with_launches", counting)
    varlen = []
    real_varlen = metal_varlen.Launch.run
    metal_run.setattr(metal_varlen.Launch, "run", lambda self: varlen.append(self.variant) or real_varlen(self))
    try:
        prompt = "Paged attention borrows an idea from operating systems: virtual memory."
        rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        done = run_all(engine)
    finally:
        metal_run.undo()
    assert done[rid].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(prompt), 10)
    assert (4, True, 1) in calls  # a windowed layer's decode ran the single-pass kernel
    assert any(v.endswith("_w_sk") for v in varlen), varlen  # a windowed layer's prefill: the varlen kernel
    assert all(n >= 1 for _, _, n in calls)  # no family fell back to the reference
