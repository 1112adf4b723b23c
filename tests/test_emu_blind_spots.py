"""Emulator checks that used to pass silently, each with an offending kernel,
and the cost-model counters on kernels whose counts are known by construction.

Every offending kernel is paired with its corrected form, which must run and compute the right
answer, so a check that rejected everything would fail here too.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from mlxpaged.metal_emu import CompileError, MetalEmuError, RegisterBudgetWarning, metal_kernel


def run(k, x, n=64, tg=64, out_n=None, **kw):
    return k(
        inputs=[x],
        grid=(n, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[(out_n or n,)],
        output_dtypes=[mx.float32],
        **kw,
    )[0]


# A reversal through threadgroup memory: correct only if the barrier orders threadgroup memory.
REVERSE = """
threadgroup float buf[64];
uint tid = thread_index_in_threadgroup;
buf[tid] = x[tid];
threadgroup_barrier(FLAGS);
out[tid] = buf[63 - tid];
"""


@pytest.mark.parametrize("flags", ["mem_flags::mem_none", "mem_flags::mem_device"])
def test_barrier_without_threadgroup_flag_does_not_order_threadgroup_memory(flags):
    x = mx.arange(64, dtype=mx.float32)
    bad = metal_kernel(
        name="rev_" + flags[-4:], input_names=["x"], output_names=["out"], source=REVERSE.replace("FLAGS", flags)
    )
    with pytest.raises(MetalEmuError, match="data race on threadgroup array .buf."):
        run(bad, x)
    good = metal_kernel(
        name="rev_tg",
        input_names=["x"],
        output_names=["out"],
        source=REVERSE.replace("FLAGS", "mem_flags::mem_device | mem_flags::mem_threadgroup"),
    )
    np.testing.assert_array_equal(np.array(run(good, x)), np.arange(64)[::-1])
    assert good.last_launch.barriers == 1
    assert good.last_launch.barriers_without_threadgroup_fence == 0


def test_simdgroup_barrier_without_threadgroup_flag_is_a_race():
    src = """
    threadgroup float lanes[32];
    uint tid = thread_index_in_threadgroup;
    lanes[tid] = x[tid];
    simdgroup_barrier(FLAGS);
    out[tid] = lanes[tid ^ 1];
    """
    x = mx.arange(32, dtype=mx.float32)
    bad = metal_kernel(
        name="sgb_none", input_names=["x"], output_names=["out"], source=src.replace("FLAGS", "mem_flags::mem_none")
    )
    with pytest.raises(MetalEmuError, match="data race"):
        run(bad, x, 32, 32)
    good = metal_kernel(
        name="sgb_tg",
        input_names=["x"],
        output_names=["out"],
        source=src.replace("FLAGS", "mem_flags::mem_threadgroup"),
    )
    np.testing.assert_array_equal(np.array(run(good, x, 32, 32)), np.arange(32) ^ 1)


def test_cast_between_address_spaces_is_rejected():
    src = """
    threadgroup float buf[64];
    uint tid = thread_index_in_threadgroup;
    buf[tid] = x[tid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    PTR
    out[tid] = p[63 - tid];
    """
    x = mx.arange(64, dtype=mx.float32)
    bad = metal_kernel(
        name="ascast",
        input_names=["x"],
        output_names=["out"],
        source=src.replace("PTR", "device float* p = (device float*)buf;"),
    )
    with pytest.raises(CompileError, match="cast between address spaces"):
        run(bad, x)
    bad2 = metal_kernel(
        name="ascast2",
        input_names=["x"],
        output_names=["out"],
        source=src.replace("PTR", "const threadgroup float* p = (const threadgroup float*)x;"),
    )
    with pytest.raises(CompileError, match="cast between address spaces"):
        run(bad2, x)
    # Casts within one address space (type punning, dropping const, from an integer) still work.
    good = metal_kernel(
        name="ascast_ok",
        input_names=["x"],
        output_names=["out"],
        source=src.replace(
            "PTR",
            "threadgroup float* p = (threadgroup float*)(threadgroup uint*)buf; "
            "const device float4* x4 = (const device float4*)x; (void)x4; "
            "float first = *(const device float*)x4; (void)first;",
        ),
    )
    np.testing.assert_array_equal(np.array(run(good, x)), np.arange(64)[::-1])


def test_threadgroup_declaration_with_initializer_is_rejected():
    k = metal_kernel(
        name="tginit",
        input_names=["x"],
        output_names=["out"],
        source="""
    threadgroup float buf[2] = {1.0f, 2.0f};
    out[0] = buf[0] + x[0];
    """,
    )
    with pytest.raises(CompileError, match=r"tginit\.metal:\d+: a threadgroup variable cannot have an initializer"):
        run(k, mx.ones(2), 1, 1, 1)


def test_threadgroup_declaration_outside_kernel_scope_is_rejected():
    header = """
    inline float helper(float v) {
      threadgroup float scratch[32];   // not kernel scope: Metal rejects it
      scratch[0] = v;
      return scratch[0];
    }
    """
    k = metal_kernel(
        name="tgscope", input_names=["x"], output_names=["out"], header=header, source="out[0] = helper(x[0]);"
    )
    with pytest.raises(CompileError, match="only be declared in the kernel function's scope"):
        run(k, mx.ones(2), 1, 1, 1)
    # The same storage declared by the kernel and passed down is fine.
    ok = metal_kernel(
        name="tgscope_ok",
        input_names=["x"],
        output_names=["out"],
        header="""
    inline float helper(threadgroup float* scratch, float v) { scratch[0] = v; return scratch[0]; }
    """,
        source="threadgroup float scratch[32];\nout[0] = helper(scratch, x[0] + 1.0f);",
    )
    assert float(run(ok, mx.ones(2), 1, 1, 1)[0]) == 2.0


def test_conflicting_attributes_are_rejected():
    k = metal_kernel(
        name="attrs",
        input_names=["x"],
        output_names=["out"],
        source="""
    uint w = thread_execution_width + threads_per_simdgroup;
    out[thread_position_in_grid.x] = x[0] + float(w);
    """,
    )
    with pytest.raises(CompileError, match=r"thread_execution_width.*threads_per_simdgroup.*conflict"):
        run(k, mx.ones(2), 32, 32)
    ok = metal_kernel(
        name="attrs_ok",
        input_names=["x"],
        output_names=["out"],
        source="""
    out[thread_position_in_grid.x] = x[0] + float(threads_per_simdgroup);
    """,
    )
    np.testing.assert_array_equal(np.array(run(ok, mx.ones(2), 32, 32)), np.full(32, 33.0))


REGS = """
float a[N];
for (int i = 0; i < N; i++) a[i] = x[(thread_position_in_grid.x + i) % 64];
float s = 0.0f;
for (int i = 0; i < N; i++) s += a[i] * a[N - 1 - i];
out[thread_position_in_grid.x] = s;
"""


def test_register_model_flags_launches_beyond_the_budget(monkeypatch):
    x = mx.array(np.random.default_rng(0).standard_normal(64).astype(np.float32))
    k = metal_kernel(name="regs", input_names=["x"], output_names=["out"], source=REGS)
    xs = np.array(x)
    for n in (16, 200):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = k(
                inputs=[x],
                template=[("N", n)],
                grid=(64, 1, 1),
                threadgroup=(64, 1, 1),
                output_shapes=[(64,)],
                output_dtypes=[mx.float32],
            )[0]
        a = np.stack([xs[(np.arange(64) + i) % 64] for i in range(n)], 1)
        np.testing.assert_allclose(np.array(out), (a * a[:, ::-1]).sum(1), rtol=1e-4, atol=1e-4)
        # one float array of N and the float s: N + 1 live 32-bit values; the spill budget is the array's
        assert k.last_launch.registers == n + 1 and k.last_launch.array_registers == n
        flagged = [m for m in w if issubclass(m.category, RegisterBudgetWarning)]
        assert bool(flagged) == (n > 128) == k.last_launch.over_register_budget
    monkeypatch.setenv("MLXPAGED_EMU_REG_BUDGET", "8")
    with pytest.warns(RegisterBudgetWarning, match="16 live 32-bit values.*budget of 8"):
        k(
            inputs=[x],
            template=[("N", 16)],
            grid=(64, 1, 1),
            threadgroup=(64, 1, 1),
            output_shapes=[(64,)],
            output_dtypes=[mx.float32],
        )


def test_register_model_counts_structs_holding_arrays():
    header = """
    template <int N> struct Acc { float v[N]; float m; };
    """
    src = """
    Acc<12> st;
    for (int i = 0; i < 12; i++) st.v[i] = x[i];
    int idx[4];
    for (int i = 0; i < 4; i++) idx[i] = i;
    out[0] = st.v[idx[3]];
    """
    k = metal_kernel(name="regstruct", input_names=["x"], output_names=["out"], header=header, source=src)
    out = run(k, mx.arange(16, dtype=mx.float32), 1, 1, 1)
    assert float(out[0]) == 3.0
    assert k.last_launch.registers == 13 + 4  # sizeof(Acc<12>) / 4 + the index array


def test_register_model_counts_scalars_not_constants():
    """Scalars and vectors of built-in types count (a 64-bit one as 2, a bool as 1); constexpr
    and constant values, loop counters and pointers do not."""
    src = """
    constexpr int K = 3;
    const uint i = thread_position_in_grid.x;
    float s = x[i];
    size_t off = (size_t)i * K;
    float4 v = float4(s, s, s, s);
    bool odd = (i & 1) != 0;
    device const float* p = x + off;
    for (int j = 0; j < K; j++) { s += p[j] + v[j]; }
    out[i] = odd ? s : -s;
    """
    k = metal_kernel(name="regscalars", input_names=["x"], output_names=["out"], source=src)
    out = run(k, mx.arange(16, dtype=mx.float32), 1, 1, 1)
    assert float(out[0]) == -(0 + 1 + 2)  # -(x[0] + x[1] + x[2])
    st = k.last_launch
    assert st.registers == st.scalar_registers == 1 + 1 + 2 + 4 + 1  # i, s, off, v, odd


def test_cost_model_counts_exp_simd_and_loads():
    k = metal_kernel(
        name="cost",
        input_names=["x"],
        output_names=["out"],
        source="""
    uint i = thread_position_in_grid.x;
    float4 v = ((const device float4*)x)[i];       // one 16-byte load per lane
    float e = exp(v.x) + exp2(v.y) + fast::exp2(v.z);
    float s = simd_sum(e);                          // one reduction per simdgroup
    float t = simd_shuffle_xor(s, 1);               // one shuffle per simdgroup
    out[i] = t + x[0];                              // one 4-byte load per lane
    """,
    )
    x = mx.array(np.random.default_rng(1).standard_normal(256).astype(np.float32) * 0.1)
    out = run(k, x, 64, 64)
    v = np.array(x).reshape(64, 4)
    e = np.exp(v[:, 0]) + np.exp2(v[:, 1]) + np.exp2(v[:, 2])
    want = np.repeat(e.reshape(2, 32).sum(1), 32) + np.array(x)[0]
    np.testing.assert_allclose(np.array(out), want, rtol=1e-5)
    st = k.last_launch
    assert (st.exp_calls, st.exp2_calls) == (64, 128)
    assert (st.simd_reductions, st.simd_shuffles) == (2, 2)
    assert st.device_loads[16] == 64 and st.device_loads[4] == 64
    assert st.device_loads[1] == st.device_loads[2] == st.device_loads[8] == 0


ALIGN = """
threadgroup {decl};
const uint i = thread_position_in_grid.x;
{view}[i] = x[i];
threadgroup_barrier(mem_flags::mem_threadgroup);
if (i < 4) {{
  const float4 v = *(const threadgroup float4*)({view} + 4 * i);
  out[i] = v[0] + v[1] + v[2] + v[3];
}}
"""


@pytest.mark.parametrize(
    "decl,view,ok",
    [
        ("float buf[16]", "buf", False),  # 4-byte aligned: a float4 load may fault on a GPU
        ("float4 buf4[4]", "((threadgroup float*)buf4)", True),  # declared as the vector type
    ],
)
def test_vector_load_from_threadgroup_array_must_be_aligned(decl, view, ok):
    """A `threadgroup float` array read through a float4 cast is only 4-byte aligned; the
    emulator places it so and refuses the load, naming the array. The float4 declaration passes."""
    src = ALIGN.format(decl=decl, view=view)
    k = metal_kernel(name=f"align_{ok}", input_names=["x"], output_names=["out"], source=src)
    x = mx.arange(16, dtype=mx.float32)
    if not ok:
        with pytest.raises(MetalEmuError, match=r"misaligned 16-byte read of threadgroup array 'buf'"):
            run(k, x, 16, 16, 4)
        return
    out = run(k, x, 16, 16, 4)
    np.testing.assert_array_equal(np.array(out), np.arange(16).reshape(4, 4).sum(1))


def test_vector_load_from_device_memory_must_be_aligned():
    src = """
    const uint i = thread_position_in_grid.x;
    const float2 v = *(const device float2*)(x + 2 * i + off[0]);
    out[i] = v[0] + v[1];
    """
    k = metal_kernel(name="align_dev", input_names=["x", "off"], output_names=["out"], source=src)
    x = mx.arange(16, dtype=mx.float32)

    def call(o):
        off = mx.array([o] * 8, dtype=mx.int32)
        return k(
            inputs=[x, off], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)], output_dtypes=[mx.float32]
        )

    np.testing.assert_array_equal(np.array(call(2)[0]), [5, 9, 13, 17])
    with pytest.raises(MetalEmuError, match=r"misaligned 8-byte read of device memory"):
        call(1)


@pytest.mark.timeout(30)
def test_a_long_comment_lowers_in_linear_time():
    """Lowering blanks comments to spaces and then looks for register sites; a site pattern that
    began with `\\s*` rescanned a blank run from each of its positions (quadratic: 0.7 s per
    shipped kernel source, and minutes for this one). Lowering only, no compiling: the timeout is
    the lowering's alone (a fresh zig spends about a minute on its first link)."""
    from mlxpaged.metal_emu.lower import lower

    comment = "// " + "x" * 100 + "\n"
    src = (
        "kernel void k(device float* out, uint i [[thread_position_in_grid]]) {\n"
        "    uint j = i;\n" + comment * 1000 + "    float s = 1.0f;\n    out[j] = s;\n}\n"
    )
    text = lower(src, body_offset=0)
    assert text.count("mlxemu_regs(") == 2  # j and s, on either side of the comment
