"""The MSL emulator's <metal_simdgroup_matrix>: small kernels against numpy.

Loads and stores with strides, origins and transposes from device and threadgroup memory,
multiply(-accumulate) in fp32 and half, the per-lane `thread_elements()` layout (MLX's
BaseMMAFrag::get_coord, written out independently below), the byte and cost counters, and the
divergence errors (a matrix function called by only some lanes).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxpaged.metal_emu as emu  # noqa: E402  (the project's own emulator: never skipped)

HEADER = "#include <metal_stdlib>\n#include <metal_simdgroup_matrix>\nusing namespace metal;\n"


def coord(lane: int) -> tuple[int, int]:
    """(row, first column) lane `lane` holds: MLX steel/gemm/mma.h BaseMMAFrag::get_coord."""
    qid = lane // 4
    return (qid & 4) + (lane // 2) % 4, (qid & 2) * 2 + (lane % 2) * 2


def window(epr: int, ox: int, oy: int, transpose: bool) -> np.ndarray:
    """[8, 8] flat offsets of M[r][c] in a layout with `epr` elements per row, origin (ox, oy)."""
    r, c = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    base = oy * epr + ox
    return base + (c * epr + r if transpose else r * epr + c)


COPY_DEVICE = """
const uint sg = simdgroup_index_in_threadgroup;
simdgroup_matrix<T, 8, 8> m;
simdgroup_load(m, src + sg * SRC_SG, EPR_IN, ulong2(OX, OY), TR);
simdgroup_store(m, out + sg * DST_SG, EPR_OUT, ulong2(PX, PY), TS);
"""

COPY_THREADGROUP = """
const uint tid = thread_index_in_threadgroup;
threadgroup T tg_in[NSRC];
threadgroup T tg_out[NDST];
for (uint i = tid; i < NSRC; i += 32) tg_in[i] = src[i];
for (uint i = tid; i < NDST; i += 32) tg_out[i] = T(0);
threadgroup_barrier(mem_flags::mem_threadgroup);
simdgroup_matrix<T, 8, 8> m;
simdgroup_load(m, tg_in, EPR_IN, ulong2(OX, OY), TR);
simdgroup_store(m, tg_out, EPR_OUT, ulong2(PX, PY), TS);
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint i = tid; i < NDST; i += 32) out[i] = tg_out[i];
"""

# (elements per row in, origin x, origin y, transpose on load, out: same, transpose on store)
LAYOUTS = [
    (8, 0, 0, False, 8, 0, 0, False),
    (13, 3, 2, False, 11, 1, 4, False),
    (13, 3, 2, True, 11, 1, 4, False),
    (10, 2, 1, False, 12, 3, 0, True),
    (9, 1, 1, True, 16, 5, 2, True),
]


def copy_reference(src: np.ndarray, layout, ndst: int) -> np.ndarray:
    epr_in, ox, oy, tr, epr_out, px, py, ts = layout
    m = src[window(epr_in, ox, oy, tr)]
    out = np.zeros(ndst, src.dtype)
    out[window(epr_out, px, py, ts)] = m
    return out


def sizes(layout) -> tuple[int, int]:
    epr_in, ox, oy, _, epr_out, px, py, _ = layout
    return (oy + 8) * epr_in + ox + 8, (py + 8) * epr_out + px + 8


def template(dtype, layout, **extra):
    epr_in, ox, oy, tr, epr_out, px, py, ts = layout
    return [
        ("T", dtype),
        ("EPR_IN", epr_in),
        ("OX", ox),
        ("OY", oy),
        ("TR", tr),
        ("EPR_OUT", epr_out),
        ("PX", px),
        ("PY", py),
        ("TS", ts),
    ] + list(extra.items())


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_store_device(dtype, layout):
    """Two simdgroups each copy an 8x8 window of device memory to device memory; every load and
    store of the matrix functions is counted in the byte counters."""
    nsrc, ndst = sizes(layout)
    rng = np.random.default_rng(0)
    src = rng.standard_normal((2, nsrc)).astype(np.float32)
    k = emu.metal_kernel(
        name="sgm_copy_device", input_names=["src"], output_names=["out"], source=COPY_DEVICE, header=HEADER
    )
    out = k(
        inputs=[mx.array(src).astype(dtype)],
        template=template(dtype, layout, SRC_SG=nsrc, DST_SG=ndst),
        grid=(64, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[(2, ndst)],
        output_dtypes=[dtype],
        init_value=0,
    )[0]
    srcr = np.array(mx.array(src).astype(dtype).astype(mx.float32))
    want = np.stack([copy_reference(srcr[i], layout, ndst) for i in range(2)])
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)), want)
    st = k.last_launch
    assert k.last_stats["src"] == 2 * 64 * dtype.size  # each element once, per simdgroup
    assert st.bytes_written["out"] == 2 * 64 * dtype.size
    assert (st.simdgroup_matrix_loads, st.simdgroup_matrix_stores, st.simdgroup_mma) == (2, 2, 0)
    assert st.simd_shuffles == 0


@pytest.mark.parametrize("order", ["forward", "reverse", "random:3"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_store_threadgroup(layout, order):
    """The same through threadgroup memory, under every lane order (the race detector sees the
    matrix functions' accesses)."""
    nsrc, ndst = sizes(layout)
    src = np.random.default_rng(1).standard_normal(nsrc).astype(np.float16)
    k = emu.metal_kernel(
        name="sgm_copy_tg", input_names=["src"], output_names=["out"], source=COPY_THREADGROUP, header=HEADER
    )
    out = k(
        inputs=[mx.array(src)],
        template=template(mx.float16, layout, NSRC=nsrc, NDST=ndst),
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(ndst,)],
        output_dtypes=[mx.float16],
        order=order,
    )[0]
    np.testing.assert_array_equal(np.array(out), copy_reference(src, layout, ndst))


MMA = """
simdgroup_matrix<TA, 8, 8> A;
simdgroup_matrix<TB, 8, 8> B;
simdgroup_matrix<TC, 8, 8> C;
simdgroup_matrix<TD, 8, 8> D;
simdgroup_load(A, a, 8, ulong2(0, 0), TRA);
simdgroup_load(B, b);
simdgroup_load(C, c);
if (ACC) {
  simdgroup_multiply_accumulate(D, A, B, C);
} else {
  simdgroup_multiply(D, A, B);
}
simdgroup_store(D, out);
"""


def run_mma(ta, tb, tc, td, *, acc=True, transpose_a=False, seed=0):
    rng = np.random.default_rng(seed)
    a, b, c = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3))
    a, b, c = mx.array(a).astype(ta), mx.array(b).astype(tb), mx.array(c).astype(tc)
    k = emu.metal_kernel(name="sgm_mma", input_names=["a", "b", "c"], output_names=["out"], source=MMA, header=HEADER)
    out = k(
        inputs=[a, b, c],
        template=[("TA", ta), ("TB", tb), ("TC", tc), ("TD", td), ("ACC", acc), ("TRA", transpose_a)],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(8, 8)],
        output_dtypes=[td],
    )[0]
    f64 = [np.array(x.astype(mx.float32)).astype(np.float64) for x in (a, b, c)]
    am = f64[0].T if transpose_a else f64[0]
    want = am @ f64[1] + (f64[2] if acc else 0)
    return np.array(out.astype(mx.float32)).astype(np.float64), want, k.last_launch


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("acc", [True, False])
def test_multiply_accumulate_fp32(acc, transpose_a):
    got, want, st = run_mma(mx.float32, mx.float32, mx.float32, mx.float32, acc=acc, transpose_a=transpose_a)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (st.simdgroup_mma, st.simdgroup_matrix_loads, st.simdgroup_matrix_stores) == (1, 3, 1)


def test_multiply_accumulate_half_inputs_fp32_accumulator():
    """half A and B, fp32 C and D: products of halves are exact in fp32, so D is A @ B + C to
    fp32 rounding."""
    got, want, _ = run_mma(mx.float16, mx.float16, mx.float32, mx.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_multiply_accumulate_low_precision_out(dtype):
    """All in half (bfloat): accumulated in fp32, rounded once: within half an ulp of the
    exact result, plus fp32 summation error."""
    got, want, _ = run_mma(dtype, dtype, dtype, dtype, seed=4)
    eps = 2.0**-11 if dtype == mx.float16 else 2.0**-8
    assert np.all(np.abs(got - want) <= eps * np.abs(want) + 1e-5)


LAYOUT_KERNEL = """
const uint lane = thread_index_in_simdgroup;
simdgroup_float8x8 m;
simdgroup_load(m, src);
out[4 * lane + 0] = m.thread_elements()[0];
out[4 * lane + 1] = m.thread_elements()[1];
simdgroup_float8x8 d = simdgroup_float8x8(3.0f);
simdgroup_float8x8 f = make_filled_simdgroup_matrix<float, 8, 8>(2.5f);
out[4 * lane + 2] = d.thread_elements()[0] + 10.0f * d.thread_elements()[1];
out[4 * lane + 3] = f.thread_elements()[0] + f.thread_elements()[1];
simdgroup_float8x8 w;
w.thread_elements() = float2(lane, 100 + lane);
simdgroup_store(w, out2);
"""


def test_thread_elements_layout():
    """Lane l holds M[fm][fn] and M[fm][fn + 1] (MLX's get_coord); writing thread_elements and
    storing puts each lane's values there; the diagonal constructor and make_filled fill the
    right elements."""
    src = np.arange(64, dtype=np.float32)
    k = emu.metal_kernel(
        name="sgm_layout", input_names=["src"], output_names=["out", "out2"], source=LAYOUT_KERNEL, header=HEADER
    )
    out, out2 = k(
        inputs=[mx.array(src)],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(32, 4), (8, 8)],
        output_dtypes=[mx.float32, mx.float32],
    )
    out, out2 = np.array(out), np.array(out2)
    want2 = np.full((8, 8), -1.0, np.float32)
    for lane in range(32):
        r, c = coord(lane)
        assert out[lane, 0] == 8 * r + c and out[lane, 1] == 8 * r + c + 1, lane
        assert out[lane, 2] == 3.0 * (r == c) + 30.0 * (r == c + 1), lane
        assert out[lane, 3] == 5.0
        want2[r, c], want2[r, c + 1] = lane, 100 + lane
    np.testing.assert_array_equal(out2, want2)  # every element written exactly by its lane
    assert sorted((coord(lane)[0], coord(lane)[1] + i) for lane in range(32) for i in (0, 1)) == [
        (r, c) for r in range(8) for c in range(8)
    ]


DIVERGENT = {
    "half the lanes call it": """
simdgroup_float8x8 m;
simdgroup_load(m, src);
if (thread_index_in_simdgroup < 16) {
  simdgroup_multiply_accumulate(m, m, m, m);
}
simdgroup_store(m, out);
""",
    "half the lanes return first": """
if (thread_index_in_simdgroup >= 16) {
  return;
}
simdgroup_float8x8 m;
simdgroup_load(m, src);
simdgroup_store(m, out);
""",
    "lanes at different call sites": """
simdgroup_float8x8 m;
if (thread_index_in_simdgroup < 16) {
  simdgroup_load(m, src);
} else {
  simdgroup_load(m, src + 1);
}
simdgroup_store(m, out);
""",
}


@pytest.mark.parametrize("case", list(DIVERGENT))
def test_divergent_call_is_an_error(case):
    """A matrix function reached by only some lanes of the simdgroup is reported."""
    k = emu.metal_kernel(
        name="sgm_diverge", input_names=["src"], output_names=["out"], source=DIVERGENT[case], header=HEADER
    )
    with pytest.raises(emu.MetalEmuError, match="divergent"):
        k(
            inputs=[mx.array(np.ones(72, np.float32))],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(64,)],
            output_dtypes=[mx.float32],
        )


def test_out_of_bounds_matrix_load_is_caught():
    """A window past the end of a device buffer is an out-of-bounds read naming it."""
    k = emu.metal_kernel(
        name="sgm_oob",
        input_names=["src"],
        output_names=["out"],
        source="simdgroup_float8x8 m;\nsimdgroup_load(m, src, 8, ulong2(1, 0));\nsimdgroup_store(m, out);\n",
        header=HEADER,
    )
    with pytest.raises(emu.MetalEmuError, match="out-of-bounds read of buffer 'src'"):
        k(
            inputs=[mx.array(np.ones(64, np.float32))],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(64,)],
            output_dtypes=[mx.float32],
        )
