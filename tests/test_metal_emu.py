"""The MSL emulator (mlxpaged.metal_emu) on small kernels whose right answers numpy knows.

Covers: templates and dtypes, threadgroup memory and barriers under every lane order, the race
check, SIMD-group functions, partial edge threadgroups, out-of-bounds detection, divergence,
deadlock and endless-loop reports, NaN-initialised outputs, exact byte counts, source parity
with MLX (and with the macOS build's preamble), MSL language features, fp16/bf16 rounding.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxpaged import metal_emu as emu
from mlxpaged.metal_emu import CompileError, MetalEmuError, metal_kernel

ORDERS = ["forward", "reverse", "random:1", "random:7"]


def run1(k, inputs, n, dtype=mx.float32, tg=32, grid=None, **kw):
    grid = grid or (n, 1, 1)
    return k(inputs=inputs, grid=grid, threadgroup=(tg, 1, 1), output_shapes=[(n,)], output_dtypes=[dtype], **kw)[0]


# ---------------------------------------------------------------------------------------------
# Elementwise, templates, dtypes

AXPB = """
uint i = thread_position_in_grid.x;
if (i >= a_shape[0]) return;
T v = a[i] * T(N) + b;
out[i] = F ? metal::max(v, T(0)) : v;
"""


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.int32])
@pytest.mark.parametrize("relu", [True, False])
def test_elementwise_templates(dtype, relu):
    k = metal_kernel(name="axpb", input_names=["a", "b"], output_names=["out"], source=AXPB)
    a = mx.array(np.arange(-20, 30) / (1 if dtype == mx.int32 else 4)).astype(dtype)
    b = mx.array(3, dtype=dtype)
    out = run1(k, [a, b], a.size, dtype, template=[("T", dtype), ("N", 3), ("F", relu)])
    want = a * 3 + b
    if relu:
        want = mx.maximum(want, 0)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32)))


def test_int64_uint32_bool():
    src = """
    uint i = thread_position_in_grid.x;
    o64[i] = x[i] * 3000000000LL;
    ou[i] = uint(x[i]) * 2u;
    ob[i] = (x[i] & 1) != 0;
    """
    k = metal_kernel(name="ints", input_names=["x"], output_names=["o64", "ou", "ob"], source=src)
    x = mx.arange(10, dtype=mx.int64)
    o64, ou, ob = k(
        inputs=[x],
        grid=(10, 1, 1),
        threadgroup=(8, 1, 1),
        output_shapes=[(10,)] * 3,
        output_dtypes=[mx.int64, mx.uint32, mx.bool_],
    )
    np.testing.assert_array_equal(np.array(o64), np.arange(10) * 3000000000)
    np.testing.assert_array_equal(np.array(ou), np.arange(10) * 2)
    np.testing.assert_array_equal(np.array(ob), np.arange(10) % 2 == 1)


# ---------------------------------------------------------------------------------------------
# Threadgroup memory, barriers, lane order

REDUCE = """
uint tid = thread_index_in_threadgroup;
threadgroup float buf[64];
buf[tid] = x[thread_position_in_grid.x];
BARRIER
if (tid == 0) {
  float s = 0.0f;
  for (uint i = 0; i < threads_per_threadgroup.x; i++) s += buf[i];
  out[threadgroup_position_in_grid.x] = s;
}
"""


def reduce_kernel(with_barrier: bool):
    src = REDUCE.replace("BARRIER", "threadgroup_barrier(mem_flags::mem_threadgroup);" if with_barrier else "")
    return metal_kernel(name=f"reduce_{int(with_barrier)}", input_names=["x"], output_names=["out"], source=src)


def test_reduction_with_barrier_is_right_under_every_order():
    x = mx.array(np.random.default_rng(0).standard_normal(256).astype(np.float32))
    want = np.array(x).reshape(4, 64).sum(1)
    k = reduce_kernel(True)
    for order in ORDERS:
        out = k(
            inputs=[x],
            grid=(256, 1, 1),
            threadgroup=(64, 1, 1),
            output_shapes=[(4,)],
            output_dtypes=[mx.float32],
            order=order,
        )[0]
        np.testing.assert_allclose(np.array(out), want, rtol=1e-5, err_msg=order)
        assert k.last_launch.barriers == 4


def test_missing_barrier_is_a_reported_race():
    x = mx.array(np.random.default_rng(0).standard_normal(256).astype(np.float32))
    k = reduce_kernel(False)
    for order in ORDERS:
        with pytest.raises(MetalEmuError, match="data race on threadgroup array .buf."):
            k(
                inputs=[x],
                grid=(256, 1, 1),
                threadgroup=(64, 1, 1),
                output_shapes=[(4,)],
                output_dtypes=[mx.float32],
                order=order,
            )


def test_missing_barrier_shows_under_some_order(monkeypatch):
    monkeypatch.setenv("MLXPAGED_EMU_RACES", "0")  # the lane orders alone must expose it too
    x = mx.array(np.random.default_rng(0).standard_normal(256).astype(np.float32))
    want = np.array(x).reshape(4, 64).sum(1)
    k = reduce_kernel(False)
    results = {}
    for order in ORDERS:
        out = k(
            inputs=[x],
            grid=(256, 1, 1),
            threadgroup=(64, 1, 1),
            output_shapes=[(4,)],
            output_dtypes=[mx.float32],
            order=order,
        )[0]
        results[order] = np.allclose(np.array(out), want, rtol=1e-5)
    # Forward: thread 0 runs to the end before the others store, reads NaN-filled memory.
    assert not results["forward"]
    assert results["reverse"]  # ...and the bug hides when the order happens to suit it


def test_same_simdgroup_exchange_needs_a_simd_sync():
    k = metal_kernel(
        name="lockstep",
        input_names=["x"],
        output_names=["out"],
        source="""
    threadgroup float lanes[32];
    uint tid = thread_index_in_threadgroup;
    lanes[tid] = x[tid];
    out[tid] = lanes[tid ^ 1];   // relies on lockstep: no simdgroup_barrier
    """,
    )
    with pytest.raises(MetalEmuError, match="data race.*simdgroup_barrier"):
        run1(k, [mx.ones(32)], 32, order="reverse")


def test_atomics_and_synchronised_accesses_are_not_races():
    k = metal_kernel(
        name="tg_atomic",
        input_names=["x"],
        output_names=["out"],
        source="""
    threadgroup atomic<int> count[1];
    threadgroup float lanes[64];
    uint tid = thread_index_in_threadgroup;
    if (tid == 0) atomic_store_explicit(&count[0], 0, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    atomic_fetch_add_explicit(&count[0], int(x[tid]), memory_order_relaxed);
    lanes[tid] = x[tid];
    simdgroup_barrier(mem_flags::mem_threadgroup);
    float nb = lanes[tid ^ 1];            // a neighbour in the same simdgroup
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) out[0] = atomic_load_explicit(&count[0], memory_order_relaxed);
    out[1 + tid] = nb;
    """,
    )
    out = k(
        inputs=[mx.arange(64, dtype=mx.float32)],
        grid=(64, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[(65,)],
        output_dtypes=[mx.float32],
        order="reverse",
    )[0]
    o = np.array(out)
    assert o[0] == sum(range(64))
    np.testing.assert_array_equal(o[1:], np.arange(64) ^ 1)


RACE_BIG = """
uint tid = thread_index_in_threadgroup;
threadgroup float buf[64];
buf[tid] = x[tid] + big[tid];
if (tid == 0) {                 // no barrier: reads the other simdgroup's stores
  float s = 0.0f;
  for (uint i = 0; i < 64; i++) s += buf[i];
  out[0] = s;
}
"""
OOB_BIG = """
uint tid = thread_index_in_threadgroup;
threadgroup float t[64];
t[tid + 1] = x[tid] + big[tid];  // thread 63 writes one past the end
threadgroup_barrier(mem_flags::mem_threadgroup);
out[tid] = t[tid];
"""


@pytest.mark.parametrize("big_bytes", [4 << 10, 1 << 20, 4 << 20, 16 << 20])
def test_threadgroup_checks_do_not_depend_on_buffer_layout(big_bytes):
    """A large buffer is mapped below the threadgroup arena and the small ones above it, so the
    arena lies inside the span of the buffer mappings: its accesses must still be race- and
    red-zone-checked (they used to be looked up among the buffers and dropped)."""
    big = mx.zeros(big_bytes // 4)
    x = mx.ones(64)
    race = metal_kernel(name="race_big", input_names=["big", "x"], output_names=["out"], source=RACE_BIG)
    oob = metal_kernel(name="oob_big", input_names=["big", "x"], output_names=["out"], source=OOB_BIG)
    with pytest.raises(MetalEmuError, match="data race on threadgroup array .buf."):
        run1(race, [big, x], 64, tg=64)
    with pytest.raises(MetalEmuError, match=r"out-of-bounds write of threadgroup array 't'.*offset 256"):
        run1(oob, [big, x], 64, tg=64)
    # ...and the buffers are still counted exactly.
    fixed = metal_kernel(
        name="race_big_fixed",
        input_names=["big", "x"],
        output_names=["out"],
        source=RACE_BIG.replace("if (tid == 0)", "threadgroup_barrier(mem_flags::mem_threadgroup);\nif (tid == 0)"),
    )
    assert run1(fixed, [big, x], 64, tg=64)[0].item() == 64
    assert fixed.last_stats == {"big": 256, "x": 256}


def test_lane_order_selection(monkeypatch):
    k = metal_kernel(
        name="who_first",
        input_names=["x"],
        output_names=["out"],
        source="""
    threadgroup uint first[1];
    uint tid = thread_index_in_threadgroup;
    if (tid == 0 || tid == 31) {
      // No barrier on purpose: whoever runs last wins.
      first[0] = tid;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) out[0] = first[0] + x[0];
    """,
    )
    x = mx.array([0], dtype=mx.uint32)
    call = dict(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.uint32])
    assert k(**call, order="forward")[0].item() == 31
    assert k(**call, order="reverse")[0].item() == 0
    monkeypatch.setenv("MLXPAGED_EMU_ORDER", "reverse")
    assert k(**call)[0].item() == 0
    with emu.lane_order("forward"):
        assert k(**call)[0].item() == 31
    monkeypatch.setenv("MLXPAGED_EMU_ORDER", "random:3")
    a = [k(**call)[0].item() for _ in range(2)]
    assert a[0] == a[1]  # a seed is reproducible
    assert k.last_launch.order == "random:3"
    with pytest.raises(ValueError):
        k(**call, order="sideways")


# ---------------------------------------------------------------------------------------------
# SIMD-group functions

SIMD = """
uint gid = thread_position_in_grid.x;
uint lane = thread_index_in_simdgroup;
T v = x[gid];
o_sum[gid] = simd_sum(v);
o_max[gid] = simd_max(v);
o_min[gid] = simd_min(v);
o_shuf[gid] = simd_shuffle(v, (lane * 7 + 3) % 32);
o_down[gid] = simd_shuffle_down(v, 5);
o_xor[gid] = simd_shuffle_xor(v, 9);
o_bcast[gid] = simd_broadcast(v, 4);
o_pre[gid] = simd_prefix_inclusive_sum(v);
o_quad[gid] = quad_sum(v) + quad_shuffle_xor(v, 1);
"""
SIMD_OUTS = ["o_sum", "o_max", "o_min", "o_shuf", "o_down", "o_xor", "o_bcast", "o_pre", "o_quad"]


@pytest.mark.parametrize("dtype", [mx.float32, mx.int32])
def test_simd_functions_match_numpy(dtype):
    rng = np.random.default_rng(1)
    xs = rng.integers(-50, 50, 128).astype(np.float32 if dtype == mx.float32 else np.int32)
    k = metal_kernel(name="simd", input_names=["x"], output_names=SIMD_OUTS, source=SIMD)
    outs = k(
        inputs=[mx.array(xs)],
        template=[("T", dtype)],
        grid=(128, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[(128,)] * 9,
        output_dtypes=[dtype] * 9,
    )
    got = {n: np.array(o).reshape(4, 32) for n, o in zip(SIMD_OUTS, outs)}
    g = xs.reshape(4, 32)
    lane = np.arange(32)
    np.testing.assert_array_equal(got["o_sum"], np.repeat(g.sum(1, keepdims=True), 32, 1))
    np.testing.assert_array_equal(got["o_max"], np.repeat(g.max(1, keepdims=True), 32, 1))
    np.testing.assert_array_equal(got["o_min"], np.repeat(g.min(1, keepdims=True), 32, 1))
    np.testing.assert_array_equal(got["o_shuf"], g[:, (lane * 7 + 3) % 32])
    np.testing.assert_array_equal(got["o_down"], np.where(lane + 5 < 32, g[:, np.minimum(lane + 5, 31)], g))
    np.testing.assert_array_equal(got["o_xor"], g[:, lane ^ 9])
    np.testing.assert_array_equal(got["o_bcast"], np.repeat(g[:, 4:5], 32, 1))
    np.testing.assert_array_equal(got["o_pre"], np.cumsum(g, 1))
    quads = np.repeat(g.reshape(4, 8, 4).sum(2), 4, 1)
    np.testing.assert_array_equal(got["o_quad"], quads + g[:, lane ^ 1])
    assert k.last_launch.simd_ops == 10 * 4


def test_simd_with_exited_lanes_uses_live_lanes_only():
    k = metal_kernel(
        name="simd_tail",
        input_names=["x"],
        output_names=["out"],
        source="""
    uint gid = thread_position_in_grid.x;
    if (gid >= 20) return;
    out[gid] = simd_sum(x[gid]);
    """,
    )
    out = run1(k, [mx.ones(32)], 32, init_value=-1)
    np.testing.assert_array_equal(np.array(out), [20.0] * 20 + [-1.0] * 12)


# ---------------------------------------------------------------------------------------------
# Dispatch geometry


def test_partial_last_threadgroup():
    src = """
    uint3 g = thread_position_in_grid;
    uint i = g.x + g.y * threads_per_grid.x;
    out[i] = threads_per_threadgroup.x * 1000 + threads_per_threadgroup.y * 100
           + thread_position_in_threadgroup.x + simdgroups_per_threadgroup * 10000;
    """
    k = metal_kernel(name="edge", input_names=["x"], output_names=["out"], source=src)
    out = k(
        inputs=[mx.zeros(1)],
        grid=(70, 3, 1),
        threadgroup=(32, 2, 1),
        output_shapes=[(3, 70)],
        output_dtypes=[mx.uint32],
    )[0]
    o = np.array(out)
    x = np.arange(70)
    tx = np.where(x < 64, 32, 6)
    for y in range(3):
        ty = 2 if y < 2 else 1
        nsg = -(-(tx * ty) // 32)
        np.testing.assert_array_equal(o[y], tx * 1000 + ty * 100 + x % 32 + nsg * 10000)
    assert k.last_launch.threads == 210
    assert k.last_launch.threadgroups == 3 * 2


# ---------------------------------------------------------------------------------------------
# Bug detectors


def test_out_of_bounds_read_is_named():
    k = metal_kernel(
        name="oob",
        input_names=["a", "bias"],
        output_names=["out"],
        source="""
    uint i = thread_position_in_grid.x;
    out[i] = bias[i + 1] + a[0];
    """,
    )
    with pytest.raises(MetalEmuError, match=r"out-of-bounds read of buffer 'bias'.*offset 40"):
        run1(k, [mx.ones(8), mx.ones(10)], 10)


def test_out_of_bounds_write_is_named():
    k = metal_kernel(
        name="oobw",
        input_names=["a"],
        output_names=["out"],
        source="""
    uint i = thread_position_in_grid.x;
    out[i * 2] = a[i];
    """,
    )
    with pytest.raises(MetalEmuError, match="out-of-bounds write of buffer 'out'"):
        run1(k, [mx.ones(16)], 16)


def test_threadgroup_overflow_is_reported():
    k = metal_kernel(
        name="tgoob",
        input_names=["x"],
        output_names=["out"],
        source="""
    threadgroup float t[32];
    uint i = thread_index_in_threadgroup;
    t[i + 1] = x[i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[i] = t[i];
    """,
    )
    with pytest.raises(MetalEmuError, match=r"out-of-bounds write of threadgroup array 't'.*offset 128"):
        run1(k, [mx.ones(32)], 32)


def test_wild_read_past_guard_is_reported():
    k = metal_kernel(
        name="oobfar",
        input_names=["a"],
        output_names=["out"],
        source="""
    uint i = thread_position_in_grid.x;
    out[i] = a[i - 4096];
    """,
    )
    with pytest.raises(MetalEmuError):
        run1(k, [mx.ones(16)], 16)


def test_divergent_barrier_is_reported():
    k = metal_kernel(
        name="divbar",
        input_names=["x"],
        output_names=["out"],
        source="""
    uint tid = thread_index_in_threadgroup;
    if (tid < 16) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
    } else {
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    out[thread_position_in_grid.x] = x[0];
    """,
    )
    with pytest.raises(MetalEmuError, match="divergent"):
        run1(k, [mx.ones(1)], 64, tg=64)


def test_divergent_simd_function_is_reported():
    k = metal_kernel(
        name="divsimd",
        input_names=["x"],
        output_names=["out"],
        source="""
    uint lane = thread_index_in_simdgroup;
    float v = x[thread_position_in_grid.x];
    if (lane < 8) {
      v = simd_sum(v);
    } else {
      v = simd_max(v);
    }
    out[thread_position_in_grid.x] = v;
    """,
    )
    with pytest.raises(MetalEmuError, match="divergent SIMD-group function"):
        run1(k, [mx.ones(32)], 32)


def test_barrier_against_simd_function_deadlock_is_reported():
    k = metal_kernel(
        name="deadlock",
        input_names=["x"],
        output_names=["out"],
        source="""
    uint lane = thread_index_in_simdgroup;
    float v = x[thread_position_in_grid.x];
    if (lane == 0) {
      threadgroup_barrier(mem_flags::mem_none);
    } else {
      v = simd_sum(v);
    }
    out[thread_position_in_grid.x] = v;
    """,
    )
    with pytest.raises(MetalEmuError, match="deadlock"):
        run1(k, [mx.ones(32)], 32)


def test_barrier_after_early_exit(monkeypatch):
    src = """
    uint i = thread_position_in_grid.x;
    if (i >= 40) return;
    threadgroup_barrier(mem_flags::mem_none);
    out[i] = x[i];
    """
    k = metal_kernel(name="exitbar", input_names=["x"], output_names=["out"], source=src)
    # An error by default: undefined behaviour in Metal, even where it happens to work.
    with pytest.raises(MetalEmuError, match="24 threads .* had already returned"):
        run1(k, [mx.ones(64)], 64, tg=64)
    monkeypatch.setenv("MLXPAGED_EMU_STRICT", "0")  # opt out: counted instead
    run1(k, [mx.ones(64)], 64, tg=64)
    assert k.last_launch.barriers_with_exited_threads == 1


def test_nan_initialised_output_shows_missed_writes():
    k = metal_kernel(
        name="evens",
        input_names=["x"],
        output_names=["out", "h", "b", "i"],
        source="""
    uint j = thread_position_in_grid.x;
    if (j % 2 == 0) { out[j] = x[j]; h[j] = x[j]; b[j] = x[j]; i[j] = 1; }
    """,
    )
    call = dict(
        inputs=[mx.ones(8)],
        grid=(8, 1, 1),
        threadgroup=(8, 1, 1),
        output_shapes=[(8,)] * 4,
        output_dtypes=[mx.float32, mx.float16, mx.bfloat16, mx.int32],
    )
    outs = k(**call)
    for o in outs[:3]:
        a = np.array(o.astype(mx.float32))
        assert (a[::2] == 1).all() and np.isnan(a[1::2]).all()
    assert (np.array(outs[3])[1::2] == -1).all()  # 0xFFFFFFFF
    assert k.last_launch.bytes_unwritten == {"out": 16, "h": 8, "b": 8, "i": 16}
    outs = k(**call, init_value=0)
    np.testing.assert_array_equal(np.array(outs[0]), [1, 0] * 4)


# ---------------------------------------------------------------------------------------------
# Byte counts


def test_bytes_read_are_exact():
    k = metal_kernel(
        name="bytes",
        input_names=["a", "h", "idx"],
        output_names=["out"],
        source="""
    uint i = thread_position_in_grid.x;
    const device half4* h4 = (const device half4*)h;
    half4 v = h4[i];                      // 8 bytes per thread
    float s = a[idx[i]];                  // 4 + 4 bytes per thread
    if (i % 4 == 0) s += a[i + 1];        // 4 more bytes in a quarter of the threads
    out[i] = s + float(v.x) + float(v.w);
    """,
    )
    n = 64
    idx = mx.array(np.random.default_rng(0).integers(0, 128, n).astype(np.int32))
    run1(k, [mx.ones(128), mx.ones(4 * n, dtype=mx.float16), idx], n)
    assert k.last_stats == {"a": 4 * n + 4 * (n // 4), "h": 8 * n, "idx": 4 * n}
    assert k.last_launch.bytes_written["out"] == 4 * n
    assert k.last_launch.bytes_read["out"] == 0


def test_atomic_outputs_histogram():
    k = metal_kernel(
        name="hist",
        input_names=["x"],
        output_names=["out"],
        atomic_outputs=True,
        source="""
    uint i = thread_position_in_grid.x;
    atomic_fetch_add_explicit(&out[x[i]], 1, memory_order_relaxed);
    """,
    )
    x = np.random.default_rng(0).integers(0, 10, 300).astype(np.int32)
    out = k(
        inputs=[mx.array(x)],
        grid=(300, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[(10,)],
        output_dtypes=[mx.int32],
        init_value=0,
    )[0]
    np.testing.assert_array_equal(np.array(out), np.bincount(x, minlength=10))


# ---------------------------------------------------------------------------------------------
# Compilation: source parity with MLX, Metal's type rules

PARITY_CASES = [
    dict(
        kernel=dict(
            name="p1",
            input_names=["a", "s"],
            output_names=["o"],
            source="o[thread_position_in_grid.x] = a[thread_position_in_grid.x] * s;",
        ),
        call=dict(
            inputs=[mx.ones(16), mx.array(2.0)],
            grid=(16, 1, 1),
            threadgroup=(16, 1, 1),
            output_shapes=[(16,)],
            output_dtypes=[mx.float32],
        ),
    ),
    dict(
        kernel=dict(
            name="p2",
            input_names=["a", "small"],
            output_names=["o", "o2"],
            header="#define TWO 2\n",
            source="""uint i = thread_position_in_grid.x;
o[i] = T(a[i] * TWO) + small[i % small_shape[0]] + a_strides[0] + a_ndim;
o2[i] = simdgroup_index_in_threadgroup + thread_index_in_simdgroup + threads_per_simdgroup;""",
        ),
        call=dict(
            inputs=[mx.ones((4, 8), dtype=mx.float16), mx.arange(3, dtype=mx.int32)],
            template=[("T", mx.float16), ("K", 4), ("B", False)],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(32,), (32,)],
            output_dtypes=[mx.float16, mx.uint32],
        ),
    ),
    dict(
        kernel=dict(
            name="p3",
            input_names=["x"],
            output_names=["o"],
            atomic_outputs=True,
            source="atomic_fetch_add_explicit(&o[0], x[thread_position_in_grid.x], memory_order_relaxed);",
        ),
        call=dict(
            inputs=[mx.ones(40, dtype=mx.int32)],
            grid=(40, 1, 1),
            threadgroup=(8, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.int32],
            init_value=0,
        ),
    ),
    dict(
        kernel=dict(
            name="p4",
            input_names=["x"],
            output_names=["o"],
            source="""threadgroup bfloat16_t t[32];
uint l = thread_position_in_threadgroup.x;
t[l] = x[threadgroup_position_in_grid.x * threads_per_threadgroup.x + l];
threadgroup_barrier(mem_flags::mem_threadgroup);
o[thread_position_in_grid.x] = t[31 - l] + t[l];""",
        ),
        call=dict(
            inputs=[mx.arange(64).astype(mx.bfloat16)],
            grid=(64, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(64,)],
            output_dtypes=[mx.bfloat16],
        ),
    ),
]


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c["kernel"]["name"])
def test_source_parity_with_mlx(case):
    k = metal_kernel(**case["kernel"])
    k(**case["call"])
    assert k.last_source == emu.mlx_compiled_source(case["kernel"], case["call"])
    assert k.last_source.startswith(emu.metal_utils_preamble())
    assert k.last_source.endswith(emu.mlx_generated_source(case["kernel"], case["call"]))


# SHA-256 of `metal::utils()` as compiled into libmlx.dylib of the macOS arm64 wheel
# mlx-metal==0.32.4 (the NUL-terminated string holding "Auto generated source for
# mlx/backend/metal/kernels/utils.h"), extracted once by hand: the preamble rebuilt here from
# the Linux wheel's headers must be byte-identical to what a Mac compiles.
MAC_PREAMBLE_SHA256 = {"0.32.4": "ec70ca7b8330eaf43786cdbeba2b816440611341c2ea48cfdef55ae8e4d358b1"}


def test_preamble_matches_the_macos_build():
    import hashlib

    digest = hashlib.sha256(emu.metal_utils_preamble().encode()).hexdigest()
    if mx.__version__ in MAC_PREAMBLE_SHA256:
        assert digest == MAC_PREAMBLE_SHA256[mx.__version__]
    else:  # another MLX: at least the structure make_compiled_preamble.sh writes
        p = emu.metal_utils_preamble()
        assert p.startswith("\n// Copyright © 2025 Apple Inc.\n\n// Auto generated source for ")
        assert '#line 1 "mlx/backend/metal/kernels/utils.h"' in p


def test_parity_kernels_compute_right():
    p2 = PARITY_CASES[1]
    o, o2 = metal_kernel(**p2["kernel"])(**p2["call"])
    want = 2 + np.arange(32) % 3 + 8 + 2
    np.testing.assert_array_equal(np.array(o.astype(mx.float32)), want)
    np.testing.assert_array_equal(np.array(o2), np.arange(32) + 32)
    p4 = PARITY_CASES[3]
    (o,) = metal_kernel(**p4["kernel"])(**p4["call"])
    x = np.arange(64).reshape(2, 32)
    np.testing.assert_array_equal(np.array(o.astype(mx.float32)).reshape(2, 32), x + x[:, ::-1])


FEATURES_HEADER = """
constant float kTable[4] = {1.0, 2.0, 3.0, 4.0};
struct Acc {
  float v;
  void add(float x) thread { v += x; }
  float get() const thread { return v; }
};
template <typename T> T twice(T x) { return x * T(2); }
"""
FEATURES = """
uint i = thread_position_in_grid.x;
constexpr constant int K = 3;
float4 a = float4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
float2 lo = a.xy;
float4 b = float4(lo, a.zw) + float4(1.0);
half4 h = half4(b);
float4 c = float4(h) * 0.5;
half hl = 1.5h;
uint bits = as_type<uint>(c.x);
Acc acc{0.0f};
acc.add(dot(a, float4(1)));
acc.add(kTable[i % 4]);
float e = fast::exp(0.0f) + precise::sqrt(4.0f) + metal::clamp(c.y, 0.0f, 100.0f);
float sel = select(1.0f, 2.0f, a.x > 2.0f);
bfloat16_t bs = simd_sum(static_cast<bfloat16_t>(1.0f));
int loc = elem_to_loc(int(i), x_shape, x_strides, x_ndim);
float inf = metal::numeric_limits<float>::infinity();
((device float4*)out)[i] = float4(acc.get(), e + sel + float(hl) + K, float(bs) + twice(loc),
                                  (bits == as_type<uint>(c.x)) + (Limits<float>::max == inf));
"""


def test_msl_features():
    """Vector constructors and swizzles, half literals, as_type, methods with address-space
    qualifiers, program-scope constants, MLX preamble helpers (elem_to_loc, Limits, bfloat SIMD)."""
    k = metal_kernel(name="features", input_names=["x"], output_names=["out"], source=FEATURES, header=FEATURES_HEADER)
    o = k(
        inputs=[mx.arange(32, dtype=mx.float32)],
        grid=(8, 1, 1),
        threadgroup=(8, 1, 1),
        output_shapes=[(8, 4)],
        output_dtypes=[mx.float32],
    )[0]
    xs = np.arange(32, dtype=np.float32).reshape(8, 4)
    want = np.stack(
        [
            xs.sum(1) + np.array([1, 2, 3, 4] * 2),
            1 + 2 + np.clip((xs[:, 1] + 1) * 0.5, 0, 100) + np.where(xs[:, 0] > 2, 2, 1) + 1.5 + 3,
            8 + 2 * np.arange(8),
            np.full(8, 2),
        ],
        1,
    )
    np.testing.assert_array_equal(np.array(o), want)


def test_compile_error_and_address_space_mixing():
    k = metal_kernel(
        name="bad",
        input_names=["a"],
        output_names=["o"],
        source="""
    const float* p = a;   // device pointer into a thread pointer: rejected by Metal too
    o[0] = p[0];
    """,
    )
    with pytest.raises(CompileError, match=r"bad\.metal:\d+"):
        run1(k, [mx.ones(8)], 1, tg=1)


# ---------------------------------------------------------------------------------------------
# Rounding of half and bfloat

ROUND = """
uint i = thread_position_in_grid.x;
T acc = T(0);
for (int j = 0; j < 64; j++) {
  acc = acc * T(1.01f) + x[i * 64 + j];   // rounded to T after every operation
}
out[i] = acc;
"""


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_and_bfloat_round_per_operation(dtype):
    rng = np.random.default_rng(5)
    xs = mx.array(rng.standard_normal(4 * 64).astype(np.float32)).astype(dtype)
    k = metal_kernel(name="rounding", input_names=["x"], output_names=["out"], source=ROUND)
    out = run1(k, [xs], 4, dtype, tg=4, template=[("T", dtype)])
    # The same recurrence in MLX, which rounds to the dtype after each op as well.
    acc = mx.zeros((4,), dtype=dtype)
    c = mx.array(1.01, dtype=mx.float32).astype(dtype)
    xr = xs.reshape(4, 64)
    for j in range(64):
        acc = acc * c + xr[:, j]
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)), np.array(acc.astype(mx.float32)))
    # ...and it differs from float32 accumulation, so rounding really happened per step.
    acc32 = np.zeros(4, np.float32)
    x32 = np.array(xr.astype(mx.float32))
    c32 = np.float32(np.array(c.astype(mx.float32)))
    for j in range(64):
        acc32 = acc32 * c32 + x32[:, j]
    assert not np.array_equal(np.array(out.astype(mx.float32)), acc32)


def test_half_matches_numpy_float16():
    src = "uint i = thread_position_in_grid.x; out[i] = (a[i] * b[i] + a[i]) / b[i];"
    k = metal_kernel(name="h16", input_names=["a", "b"], output_names=["out"], source=src)
    rng = np.random.default_rng(2)
    a = rng.standard_normal(256).astype(np.float16)
    b = (rng.standard_normal(256) + 3).astype(np.float16)
    out = run1(k, [mx.array(a), mx.array(b)], 256, mx.float16, tg=64)
    np.testing.assert_array_equal(np.array(out), (a * b + a) / b)


# ---------------------------------------------------------------------------------------------
# Factory


def test_get_metal_kernel(monkeypatch):
    monkeypatch.delenv("MLXPAGED_METAL", raising=False)
    if not mx.metal.is_available():
        assert emu.get_metal_kernel() is emu.metal_kernel
    monkeypatch.setenv("MLXPAGED_METAL", "emulate")
    assert emu.get_metal_kernel() is emu.metal_kernel
    monkeypatch.delenv("MLXPAGED_METAL")
    with emu.emulate():
        assert emu.get_metal_kernel() is emu.metal_kernel


def test_lowering_rewrites_only_what_clang_needs():
    from mlxpaged.metal_emu.lower import lower

    src = """struct P { constant float* data; float get() const constant { return 0; } };
template <typename T> void f(threadgroup T* p, constant const int64_t s[2]) {
  threadgroup float buf[4 * 8];
  threadgroup float* q = buf;
  constexpr constant int K = 2;
  float x = 0.5 + 1.0h + 2e3 + 1.5f; // 0.5 in a comment stays
}
template [[host_name("k")]] [[kernel]] decltype(f<float>) f<float>;
"""
    out = lower(src)
    assert "struct P { constant float* data;" in out  # a member pointer is not storage
    assert "const MLXEMU_AS_METHOD_constant {" in out
    assert "constant const int64_t * s)" in out
    assert (
        "threadgroup mlxemu_type<float> (&buf)[4 * 8] = *(threadgroup mlxemu_type<float> (*)[4 * 8])"
        'mlxemu_tg_slot(0, sizeof(mlxemu_type<float>[4 * 8]), alignof(mlxemu_type<float>), "buf");'
    ) in out
    assert "  threadgroup float* q = buf;" in out
    assert "static constexpr constant int K = 2;" in out
    assert "float x = 0.5f + ((half)1.0f) + 2e3f + 1.5f; // 0.5 in a comment stays" in out
    assert "template decltype(f<float>) f<float>;" in out
    assert out.count("\n") == src.count("\n")


def test_endless_loop_stack_overflow_and_threadgroup_limit(monkeypatch):
    monkeypatch.setenv("MLXPAGED_EMU_TIMEOUT", "1")
    spin = metal_kernel(
        name="spin",
        input_names=["x"],
        output_names=["out"],
        source="""
    float s = 0;
    while (x[0] > 0) { s += 1; if (s < 0) break; }
    out[thread_position_in_grid.x] = s;
    """,
    )
    with pytest.raises(MetalEmuError, match="did not finish"):
        run1(spin, [mx.ones(1)], 4, tg=4)
    deep = metal_kernel(
        name="deep",
        input_names=["x"],
        output_names=["out"],
        source="""
    float big[100000];
    for (int j = 0; j < 100000; j++) big[j] = x[0] * j;
    out[thread_position_in_grid.x] = big[(int)x[0] * 1000];
    """,
    )
    with pytest.raises(MetalEmuError, match="stack overflow"):
        run1(deep, [mx.ones(1)], 4, tg=4)
    monkeypatch.setenv("MLXPAGED_EMU_STACK", str(1 << 20))
    # 100,000 registers a thread: far past the register file, refused unless the cap is off.
    with pytest.raises(MetalEmuError, match="launch refused"):
        run1(deep, [mx.ones(1)], 4, tg=4)
    monkeypatch.setenv("MLXPAGED_EMU_REGFILE_BYTES", "0")
    assert run1(deep, [mx.ones(1)], 4, tg=4)[0].item() == 1000
    huge = metal_kernel(
        name="huge",
        input_names=["x"],
        output_names=["out"],
        source="""
    threadgroup float t[9000];
    t[thread_index_in_threadgroup] = x[0];
    out[0] = t[0];
    """,
    )
    with pytest.raises(MetalEmuError, match="threadgroup memory"):
        run1(huge, [mx.ones(1)], 1, tg=1)


def test_verbose_prints_like_mlx(capfd):
    case = PARITY_CASES[1]
    metal_kernel(**case["kernel"])(**case["call"], verbose=True)
    printed = capfd.readouterr().out
    assert printed == (
        "Generated source code for `p2`:\n```\n" + emu.mlx_generated_source(case["kernel"], case["call"]) + "\n```\n"
    )


def _memory_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_kernel_libraries_share_fiber_stacks():
    """Each compiled kernel is its own library with its own copy of the runtime; they must all
    run on one process-wide set of fiber stacks and threadgroup arena. Per-library stacks left
    ~520 memory mappings behind per distinct kernel, and about 125 kernels exhausted
    vm.max_map_count (65530): launches failed with "cannot allocate fiber stacks"."""
    k = metal_kernel(
        name="many_tiny",
        input_names=["x"],
        output_names=["out"],
        source="""
    threadgroup float t[256];
    uint i = thread_index_in_threadgroup;
    t[i] = x[i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[i] = t[255 - i] + float(N);
    """,
    )
    x = mx.arange(256, dtype=mx.float32)
    n_kernels = 40  # distinct template values: one library each
    before = None
    for n in range(n_kernels):
        out = k(
            inputs=[x],
            grid=(256, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[(256,)],
            output_dtypes=[mx.float32],
            template=[("N", 7000 + n)],
        )[0]
        np.testing.assert_array_equal(np.array(out), np.arange(255, -1, -1) + 7000 + n)
        if before is None:  # after the first launch: the shared stacks exist by now
            before = _memory_mappings()
    grown = _memory_mappings() - before
    # A library's own segments are a handful of mappings; 256 stacks would be over 500.
    assert grown <= 16 * (n_kernels - 1), f"{grown / (n_kernels - 1):.0f} mappings per kernel"
    for _ in range(3):  # relaunching keeps the count
        k(
            inputs=[x],
            grid=(256, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[(256,)],
            output_dtypes=[mx.float32],
            template=[("N", 7000)],
        )
    assert _memory_mappings() - before <= grown + 8  # (slack for the allocator's own arenas)


def test_include_dir_follows_the_checkout(tmp_path, monkeypatch):
    """Two checkouts with the same shim get their own include directories: the headers there name
    the shim by absolute path, so a removed checkout's must never serve another (it did: every
    kernel failed with "metal_shim.h file not found" after a worktree was deleted)."""
    import shutil

    from mlxpaged.metal_emu import compiler

    monkeypatch.setenv("MLXPAGED_EMU_CACHE", str(tmp_path / "cache"))
    dirs, source = [], compiler.HERE
    for name in ("a", "b"):
        here = tmp_path / name
        here.mkdir()
        for header in compiler.SHIM_HEADERS:
            shutil.copy(source / header, here / header)
        monkeypatch.setattr(compiler, "HERE", here)
        d = compiler.include_dir()
        assert f'#include "{here / "metal_shim.h"}"' in (d / "metal_stdlib").read_text()
        dirs.append(d)
        if name == "a":
            shutil.rmtree(here)
    assert dirs[0] != dirs[1]
