"""Launch limits and the kernels that run: threads x registers fit one GPU core's
register file, the emulator refuses a launch past it, the variant checked at start-up is the one
every batch runs, and a kernel failing mid-serving falls back to the reference with one warning.
"""

from __future__ import annotations

import re
import warnings

import mlx.core as mx
import numpy as np
import pytest

import mlxpaged.metal_emu as emu  # noqa: E402  (the project's own emulator: never skipped)
from mlxpaged.attention import metal, paged_attention_varlen
from mlxpaged.attention import metal_varlen as mv
from mlxpaged.attention.kv_quant import QuantizedPool
from mlxpaged.attention.reference import paged_attention_varlen_reference

from kernel_cases import Recording  # noqa: E402


def inputs(rng, q_lens, prefixes, *, head_dim=32, group=1, kv_heads=1, bs=16, dtype=mx.float32):
    ctx = [n + p for n, p in zip(q_lens, prefixes)]
    nblocks = [-(-c // bs) for c in ctx]
    pool = sum(nblocks) + 2
    ids = rng.permutation(pool)
    tables = np.zeros((len(ctx), max(nblocks)), np.int32)
    start = 0
    for i, n in enumerate(nblocks):
        tables[i, :n] = ids[start : start + n]
        start += n
    shape = (pool, kv_heads, bs, head_dim)
    return (
        mx.array(rng.standard_normal((sum(q_lens), kv_heads * group, head_dim)), dtype=dtype),
        mx.array(rng.standard_normal(shape), dtype=dtype),
        mx.array(rng.standard_normal(shape), dtype=dtype),
        mx.array(tables),
        mx.array(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
        mx.array(np.array(ctx, np.int32)),
    )


def reference(q, k, v, *rest, scale):
    f32 = [x.astype(mx.float32) for x in (q, k, v)]
    return paged_attention_varlen_reference(*f32, *rest, scale)


# --- register file ---------------------------------------------------------------------------


@pytest.mark.parametrize("mma,quant,group", [(True, None, 2), (False, None, 3), (False, (4, 32), 2)])
def test_plan_registers_are_the_emulators(emulated, monkeypatch, mma, quant, group):
    """`Plan.registers` is the emulator's estimate of the launch it plans, and the threadgroup
    fits the register file."""
    if not mma:
        monkeypatch.setattr(mv, "mma_fits", lambda head_dim, group: False)
    rng = np.random.default_rng(1)
    q, k, v, *rest = inputs(rng, [3, 18], [0, 5], head_dim=64, group=group, dtype=mx.float16)
    if quant:
        k, v = (QuantizedPool.quantize(c, *quant) for c in (k, v))
    _, (launch,) = mv.run_with_launches(q, k, v, *rest, scale=0.1)
    p = mv.launch_plan(64, 16, group, 2, quant)
    st = launch.kernel.last_launch
    assert p.mma == mma and launch.variant == p.variant
    assert st.registers == p.registers and st.threads_per_threadgroup == p.threads
    assert st.threadgroup_register_bytes == p.register_file_bytes <= mv.REGISTER_FILE_BYTES


@pytest.mark.parametrize("lanes", [False, True])
def test_head_splits_compute_the_same(emulated, monkeypatch, lanes):
    """A register file too small for the whole group splits the query heads over threadgroups
    (3 heads over 2: the second group has a padding head) with the reference's result."""
    if lanes:
        monkeypatch.setattr(mv, "mma_fits", lambda head_dim, group: False)
    full = mv.plan(64, 16, 3, 4)
    monkeypatch.setattr(mv, "REGISTER_FILE_BYTES", full.register_file_bytes - 1)
    p = mv.plan(64, 16, 3, 4)
    assert p.head_splits == 2 and p.register_file_bytes <= mv.REGISTER_FILE_BYTES
    rng = np.random.default_rng(2)
    args = inputs(rng, [20, 1, 7], [9, 30, 0], head_dim=64, group=3, kv_heads=2)
    out, launches = mv.run_with_launches(*args, scale=0.125)
    assert launches[0].variant == p.variant and launches[0].call["grid"][0] == 2 * p.threads
    ref = reference(*args, scale=0.125)
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=2e-5, rtol=2e-4)


# Every plan the planner can make: each shape the engine accepts (`metal.shape_supported`), both
# element sizes, float and every quantized cache, and the lanes kernel forced where MMA would run.
def _every_plan():
    for hd in range(32, 257, 32):
        for bs in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            for g in range(1, 129):
                if not metal.shape_supported(hd, bs, g):
                    continue
                for size in (2, 4):
                    yield mv.plan(hd, bs, g, size, mma=False)
                    for quant in (None, (4, 32), (4, 64), (8, 32), (8, 64)):
                        if quant is None or metal.quant_supported(hd, *quant):
                            yield mv.launch_plan(hd, bs, g, size, quant)


def test_every_varlen_plan_launches_on_every_mac():
    """At most 256 threads per threadgroup (what every Mac's pipelines allow: MLX refuses a launch
    over a pipeline's maxTotalThreadsPerThreadgroup, 896 on an M2 Ultra in mlx-vlm#1799), registers
    within one core's register file, arrays within the spill budget, threadgroup memory within
    32 KB; every query row has a lane group, and each query head a threadgroup."""
    n = 0
    for p in _every_plan():
        n += 1
        assert 32 * p.simdgroups <= 256, p
        assert 4 * 32 * p.simdgroups * p.registers <= 208 * 1024, p
        assert p.array_registers <= 128, p
        itemsize = 4 if p.mma else 2
        assert mv.threadgroup_bytes(p, itemsize) <= 32768, p
        gh = -(-p.group // p.head_splits)
        assert gh * p.head_splits >= p.group and (gh - 1) * p.head_splits < p.group, p
        if p.mma:
            assert p.simdgroups * 8 == mv.TILE_TOKENS * gh, p
        else:
            assert 32 * p.simdgroups // p.lanes_per_row * p.rows_per_group >= mv.TILE_TOKENS * gh, p
    assert n > 30000


LOCALS = """
uint i = thread_position_in_grid.x;
float x[64];
for (int j = 0; j < 64; j++) { x[j] = a[i] + j; }
float s = 0.0f;
for (int j = 0; j < 64; j++) { s += x[j]; }
out[i] = s;
"""


def test_emulator_refuses_a_launch_past_the_register_file(monkeypatch):
    monkeypatch.setenv("MLXPAGED_EMU_MAX_THREADS", "1024")  # the thread cap is tested below
    k = emu.metal_kernel(name="regfile", input_names=["a"], output_names=["out"], source=LOCALS)
    a = mx.zeros((1024,), dtype=mx.float32)
    call = dict(inputs=[a], grid=(1024, 1, 1), output_shapes=[(1024,)], output_dtypes=[mx.float32])
    # 512 threads x 66 registers (the array, i and s) x 4 bytes = 132 KB: runs.
    out = k(threadgroup=(512, 1, 1), **call)[0]
    assert float(out[0]) == sum(range(64))
    assert k.last_launch.registers == 66 and k.last_launch.scalar_registers == 2
    # 1,024 threads: 264 KB, over the 208 KB of an Apple7/8 core.
    with pytest.raises(emu.MetalEmuError, match=r"launch refused: 1024 threads .* 66 registers"):
        k(threadgroup=(1024, 1, 1), **call)


def test_emulator_refuses_a_threadgroup_over_256_threads():
    """A tiny kernel (1 register) still may not launch 257 threads: the cap is MLX's pipeline
    limit, not the register file."""
    k = emu.metal_kernel(
        name="cap", input_names=["a"], output_names=["out"], source="out[thread_position_in_grid.x] = a[0];"
    )
    a = mx.ones((1,), dtype=mx.float32)
    call = dict(inputs=[a], grid=(512, 1, 1), output_shapes=[(512,)], output_dtypes=[mx.float32])
    assert float(k(threadgroup=(256, 1, 1), **call)[0][511]) == 1.0
    with pytest.raises(emu.MetalEmuError, match=r"launch refused: a threadgroup of 257 threads is over 256"):
        k(threadgroup=(257, 1, 1), **call)
    with pytest.raises(emu.MetalEmuError, match=r"threadgroup of 512 threads is over 256"):
        k(threadgroup=(16, 32, 1), **call | dict(grid=(16, 32, 1)))


# --- the checked variant is the one that runs ------------------------------------------------


def test_kernel_names_do_not_change_with_the_batch(monkeypatch):
    factory = Recording()
    monkeypatch.setattr(metal, "_metal_kernel_factory", lambda: factory)
    monkeypatch.delenv("MLXPAGED_METAL", raising=False)
    metal.reset_kernels()
    rng = np.random.default_rng(3)
    try:
        pool = mx.zeros((1, 1, 16, 32), dtype=mx.float32)
        assert metal.check_family(1, pool)
        assert mv.check_varlen(1, pool)
        checked = set(factory.names)
        used = set()
        for n in (1, 2, 3, 4, 5, 9, 17, 64):
            for mix in ("decode", "prefill", "mixed"):
                q_lens = {
                    "decode": [1] * n,
                    "prefill": list(rng.integers(2, 40, n)),
                    "mixed": list(rng.choice([1, 1, 2, 17, 33], n)),
                }[mix]
                prefixes = list(rng.integers(0, 40, n))
                args = inputs(rng, [int(x) for x in q_lens], [int(p) for p in prefixes])
                factory.names.clear()
                out = paged_attention_varlen(*args, scale=0.2, impl="metal")
                ref = reference(*args, scale=0.2)
                np.testing.assert_allclose(np.array(out), np.array(ref), atol=2e-5, rtol=2e-4)
                used |= set(factory.names)
    finally:
        metal.reset_kernels()
    assert used <= checked, used - checked
    assert len([x for x in used if "varlen" in x]) == 1  # one varlen kernel for every batch


def test_mid_serving_failure_falls_back_with_one_warning(monkeypatch):
    """The varlen kernel passes its start-up check, then fails (as a build would on a Mac):
    the call still returns the right result, one warning names it, later calls take the
    reference path, and the doctor's text keeps the compiler's lines."""
    factory = Recording(refuse="paged_attention_varlen_mma", after=1)
    monkeypatch.setattr(metal, "_metal_kernel_factory", lambda: factory)
    monkeypatch.delenv("MLXPAGED_METAL", raising=False)
    metal.reset_kernels()
    rng = np.random.default_rng(4)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                args = inputs(rng, [5, 1, 12], [3, 20, 0], group=2)
                out = paged_attention_varlen(*args, scale=0.3, impl="metal")
                np.testing.assert_allclose(np.array(out), np.array(reference(*args, scale=0.3)), atol=2e-5, rtol=2e-4)
        runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(runtime) == 1, [str(w.message) for w in runtime]
        assert "Unable to build metal library" in str(runtime[0].message)
        pool = mx.zeros((1, 1, 16, 32), dtype=mx.float32)
        text = metal.family_error(2, pool, varlen=True)
        assert "program_source:120:5: error: simulated Metal compiler error" in text
        assert factory.calls == 2  # the check, the failed call; then the reference only
    finally:
        metal.reset_kernels()


# What MLX raises for a launch over the pipeline's limit (mlx/backend/metal/custom_kernel.cpp).
THREADS_ERROR = (
    "[custom_kernel] Trying to launch with 1024 threads per threadgroup but the maximum allowed "
    "threads per threadgroup is 896"
)


@pytest.mark.parametrize("path", ["varlen", "decode"])
@pytest.mark.parametrize("error", [ValueError(THREADS_ERROR), TypeError("any other exception")])
def test_mid_serving_failure_of_any_kind_falls_back(monkeypatch, path, error):
    """MLX's launch-configuration errors are ValueError, not RuntimeError: a kernel raising any
    exception mid-serving still gives the reference's result and one warning naming the kernel."""
    refuse = "paged_attention_varlen_mma" if path == "varlen" else "paged_attention_hd32"
    factory = Recording(refuse=refuse, after=1, error=error)
    monkeypatch.setattr(metal, "_metal_kernel_factory", lambda: factory)
    monkeypatch.delenv("MLXPAGED_METAL", raising=False)
    metal.reset_kernels()
    rng = np.random.default_rng(4)
    q_lens = [5, 1, 12] if path == "varlen" else [1, 1, 1]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if path == "decode":
                assert metal.check_family(2, mx.zeros((1, 1, 16, 32), dtype=mx.float32))
            for _ in range(3):
                args = inputs(rng, q_lens, [3, 20, 0], group=2)
                out = paged_attention_varlen(*args, scale=0.3, impl="metal")
                np.testing.assert_allclose(np.array(out), np.array(reference(*args, scale=0.3)), atol=2e-5, rtol=2e-4)
        runtime = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(runtime) == 1, runtime
        assert re.search(rf"kernel {refuse}_\w+ failed", runtime[0]), runtime[0]
        assert str(error) in runtime[0]
    finally:
        metal.reset_kernels()


def test_startup_failure_of_any_kind_names_the_kernel(monkeypatch):
    factory = Recording(refuse="paged_attention_partitioned", error=ValueError(THREADS_ERROR))
    monkeypatch.setattr(metal, "_metal_kernel_factory", lambda: factory)
    monkeypatch.delenv("MLXPAGED_METAL", raising=False)
    metal.reset_kernels()
    try:
        with pytest.warns(RuntimeWarning, match=r"kernel paged_attention_partitioned_hd32_\w+: ValueError: "):
            assert not metal.check_family(1, mx.zeros((1, 1, 16, 32), dtype=mx.float32))
    finally:
        metal.reset_kernels()


def test_bad_input_is_not_a_kernel_failure(monkeypatch):
    """A ValueError about the caller's arguments is raised as it is, with no fallback: here
    MLXPAGED_DEBUG=1's metadata check (a block id outside the pool)."""
    factory = Recording()
    monkeypatch.setattr(metal, "_metal_kernel_factory", lambda: factory)
    monkeypatch.delenv("MLXPAGED_METAL", raising=False)
    monkeypatch.setenv("MLXPAGED_DEBUG", "1")
    metal.reset_kernels()
    try:
        q, k, v, bt, cu, cl = inputs(np.random.default_rng(8), [5, 12], [3, 0])
        bad = np.array(bt)
        bad[1, 0] = 99  # sequence 1's first block: past the pool's 4
        bad = mx.array(bad)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with pytest.raises(ValueError, match=r"block id 99 at block_tables\[1, 0\]"):
                paged_attention_varlen(q, k, v, bad, cu, cl, scale=0.3, impl="metal")
        assert metal._families == {} or all(metal._families.values())
    finally:
        metal.reset_kernels()


def test_mid_serving_failure_raises_when_strict(monkeypatch):
    factory = Recording(refuse="paged_attention_varlen_mma", after=1)
    monkeypatch.setattr(metal, "_metal_kernel_factory", lambda: factory)
    monkeypatch.setenv("MLXPAGED_METAL", "strict")
    metal.reset_kernels()
    try:
        args = inputs(np.random.default_rng(5), [5, 12], [3, 0], group=2)
        with pytest.raises(RuntimeError, match="simulated Metal compiler error"):
            paged_attention_varlen(*args, scale=0.3, impl="metal")
    finally:
        metal.reset_kernels()


# --- context lengths clamped to the real table width -----------------------------------------


def _attend_all(q, k, v, scale):
    """numpy: each query row attends to every key row (fp64)."""
    s = np.einsum("thd,khd->thk", q, k) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("thk,khd->thd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("q_len", [1, 3])
def test_length_past_the_table_stops_at_its_end(emulated, q_len):
    """A context length past a one-block table reads that block only: not the padding's block
    0, which holds another sequence's rows (table width is the real one, not the padded one)."""
    rng = np.random.default_rng(6)
    bs, hd = 16, 32
    k = mx.array(rng.standard_normal((3, 1, bs, hd)), dtype=mx.float32)
    v = mx.array(rng.standard_normal((3, 1, bs, hd)), dtype=mx.float32)
    q = mx.array(rng.standard_normal((q_len, 2, hd)), dtype=mx.float32)
    table = mx.array(np.array([[2]], np.int32))  # one block; block 0 belongs to someone else
    cu = mx.array(np.array([0, q_len], np.int32))
    lens = mx.array(np.array([3 * bs + q_len], np.int32))  # past the table's 16 tokens
    if q_len == 1:
        out = metal.paged_attention_metal(q, k, v, table, lens, scale=0.2, partition_tokens=0)
    else:
        out, _ = mv.run_with_launches(q, k, v, table, cu, lens, scale=0.2)
    kk = np.array(k)[2, 0][:, None, :].repeat(2, 1)  # the table's block, both query heads
    vv = np.array(v)[2, 0][:, None, :].repeat(2, 1)
    want = _attend_all(np.array(q, np.float64), kk, vv, 0.2)
    np.testing.assert_allclose(np.array(out), want, atol=1e-5, rtol=1e-4)


# --- bad varlen metadata ----------------------------------------------------------------------


@pytest.mark.parametrize("lanes", [False, True])
def test_context_shorter_than_its_new_tokens(emulated, monkeypatch, lanes):
    """Sequence 1 claims 12 new tokens in a context of 4: MLXPAGED_DEBUG=1 names it; without it,
    its 8 tokens before position 0 see no key and read 0 (the launch's init_value), never stale
    memory, and sequence 0 is untouched."""
    if lanes:
        monkeypatch.setattr(mv, "mma_fits", lambda head_dim, group: False)
    q, k, v, bt, cu, cl = inputs(np.random.default_rng(9), [5, 12], [3, 0], group=2)
    bad = mx.array(np.array([8, 4], np.int32))
    monkeypatch.setenv("MLXPAGED_DEBUG", "1")
    with pytest.raises(ValueError, match=r"context length 4 of sequence 1 is less than its 12 new tokens"):
        mv.run_with_launches(q, k, v, bt, cu, bad, scale=0.3)
    monkeypatch.delenv("MLXPAGED_DEBUG")
    out, (launch,) = mv.run_with_launches(q, k, v, bt, cu, bad, scale=0.3)
    assert launch.kind == (mv.KERNEL if lanes else mv.MMA_KERNEL)
    out = np.array(out)
    assert (out[5:13] == 0).all()  # tokens 0..7 of sequence 1: positions -8..-1
    ref = np.array(reference(q, k, v, bt, cu, cl, scale=0.3))
    np.testing.assert_allclose(out[:5], ref[:5], atol=2e-5, rtol=2e-4)
    assert np.isfinite(out).all()
