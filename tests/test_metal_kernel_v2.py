"""Decode kernel v2: bad metadata, a fixed set of kernel names, the startup check with
its fallback, the register bound, and the cost model's targets. Kernels run in the emulator and
results are compared with the pure-MLX reference.
"""

from __future__ import annotations

import math
import warnings

import mlx.core as mx
import numpy as np
import pytest

import mlxpaged.metal_emu as emu  # noqa: E402  (the project's own emulator: never skipped)
from mlxpaged.attention import metal
from mlxpaged.attention.reference import paged_attention_reference
from mlxpaged.metal_emu.source import generated_source  # noqa: E402

from kernel_cases import (  # noqa: E402
    CLAMP_CASE,
    ORDERS,
    FaultyFactory,  # noqa: E402
    make_inputs,
    mismatch,
    run_case,
)

# These tests patch kernel sources and factories: the `emulated` fixture (conftest) resets the
# kernel caches after each one.
RESET_KERNELS = True


@pytest.mark.parametrize("split", [False, True])
def test_overlong_context_lengths_are_clamped(emulated, monkeypatch, split):
    """Lengths past the table's width read only the sequence's own row (no out-of-bounds read
    of the table or the pool): the result is attention over the whole row."""
    for order in ORDERS:
        monkeypatch.setenv("MLXPAGED_EMU_ORDER", order)
        assert run_case(dict(CLAMP_CASE, split=split)) <= 1.0


def test_debug_mode_checks_block_ids_and_lengths(emulated, monkeypatch):
    rng = np.random.default_rng(0)
    q, k, v, bt, cl = make_inputs(
        rng, dtype="float32", head_dim=64, group=2, block_size=16, scattered=True, context_lens=[20, 40]
    )
    monkeypatch.setenv("MLXPAGED_DEBUG", "1")
    out = metal.paged_attention_metal(q, k, v, bt, cl, scale=0.125)  # consistent: runs
    assert mismatch(out, paged_attention_reference(q, k, v, bt, cl, 0.125), "float32") <= 1.0
    tables = np.array(bt)
    for bad_id in (k.shape[0], -1):
        t = tables.copy()
        t[1, 2] = bad_id  # the third block of a 40-token sequence: in use
        with pytest.raises(
            ValueError,
            match=rf"block id {bad_id} at block_tables\[1, 2\] is "
            rf"outside the pool of {k.shape[0]} blocks",
        ):
            metal.paged_attention_metal(q, k, v, mx.array(t), cl, scale=0.125)
    t = tables.copy()
    t[0, 2] = k.shape[0]  # past the 20-token sequence's two blocks: never read, not an error
    metal.paged_attention_metal(q, k, v, mx.array(t), cl, scale=0.125)
    too_long = mx.array(np.array([20, bt.shape[1] * 16 + 1], np.int32))
    with pytest.raises(ValueError, match="context length .* of sequence 1 is outside"):
        metal.paged_attention_metal(q, k, v, bt, too_long, scale=0.125)


class NameRecorder:
    """A kernel factory that records every kernel name MLX would compile (its generated
    source's name) and runs the real emulator only until the family check has passed;
    afterwards it returns zeros (names, not values, are under test)."""

    def __init__(self):
        self.names: list[set[str]] = [set()]

    def __call__(self, **kernel_kwargs):
        real = emu.metal_kernel(**kernel_kwargs)
        rec = self

        def kernel(**call):
            gen = generated_source(
                name=kernel_kwargs["name"],
                input_names=kernel_kwargs["input_names"],
                output_names=kernel_kwargs["output_names"],
                source=kernel_kwargs["source"],
                header=kernel_kwargs["header"],
                atomic_outputs=False,
                inputs=call["inputs"],
                output_dtypes=call["output_dtypes"],
                template=call["template"],
            )
            rec.names[-1].add(gen.kernel_name)
            if not metal._families:
                return real(**call)
            return [mx.zeros(s, dtype=d) for s, d in zip(call["output_shapes"], call["output_dtypes"])]

        return kernel


@pytest.mark.parametrize("seqs", [1, 3])
def test_decoding_to_5000_tokens_compiles_nothing_after_the_first_step(monkeypatch, seqs):
    """Context 1, 2, ..., 5000 (the table widening by one block every 16 tokens, the planner
    switching to the split path and growing its partitions): every kernel name is known
    after the first step."""
    rec = NameRecorder()
    monkeypatch.setattr(metal, "_metal_kernel_factory", lambda: rec)
    monkeypatch.delenv("MLXPAGED_METAL", raising=False)
    metal.reset_kernels()
    bs, kvh, group, hd = 16, 2, 7, 64
    rng = np.random.default_rng(1)
    q = mx.array(rng.standard_normal((seqs, kvh * group, hd)), dtype=mx.float16)
    pool = mx.zeros((seqs * 313, kvh, bs, hd), dtype=mx.float16)
    kinds = set()
    try:
        for ctx in range(1, 5001):
            width = -(-ctx // bs)
            tables = mx.array(np.arange(seqs * width, dtype=np.int32).reshape(seqs, width))
            lens = mx.full((seqs,), ctx, dtype=mx.int32)
            _, launches = metal.run_with_launches(q, pool, pool, tables, lens, scale=0.125)
            kinds |= {launch.kind for launch in launches}
            if ctx == 1:
                after_first = set(rec.names[-1])
                cache_after_first = metal._kernel.cache_info().currsize
        cache_at_end = metal._kernel.cache_info().currsize
    finally:
        metal.reset_kernels()
    assert kinds == set(metal.KERNEL_IO)  # both paths ran
    assert rec.names[-1] == after_first, rec.names[-1] - after_first
    assert len(after_first) == 3
    assert cache_at_end == cache_after_first == 3


@pytest.mark.parametrize(
    "kind,how",
    [("paged_attention_merge", "compile"), ("paged_attention", "wrong"), ("paged_attention_partitioned", "wrong")],
)
def test_failed_variant_falls_back_to_the_reference_with_one_warning(monkeypatch, kind, how):
    factory = FaultyFactory(kind, how)
    monkeypatch.setattr(metal, "_metal_kernel_factory", lambda: factory)
    monkeypatch.delenv("MLXPAGED_METAL", raising=False)
    metal.reset_kernels()
    rng = np.random.default_rng(2)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for lens in ([5, 40], [3, 1200]):  # single pass, then the split path
                args = make_inputs(
                    rng, dtype="float16", head_dim=64, group=2, block_size=16, scattered=True, context_lens=lens
                )
                out = metal.paged_attention_metal(*args, scale=0.125)
                ref = paged_attention_reference(*args, 0.125)
                assert mismatch(out, ref, "float16") <= 1.0
        msgs = [str(m.message) for m in w if "kernel check failed" in str(m.message)]
        assert len(msgs) == 1, msgs
        assert "hd64_bs16_g2" in msgs[0]
        assert ("simulated compiler failure" in msgs[0]) == (how == "compile")
        # strict: the same failure is an error, not a fallback
        metal.reset_kernels()
        monkeypatch.setenv("MLXPAGED_METAL", "strict")
        err = emu.CompileError if how == "compile" else metal.KernelCheckError
        with pytest.raises(err):
            metal.paged_attention_metal(*args, scale=0.125)
    finally:
        metal.reset_kernels()


def test_healthy_kernels_pass_the_check_silently(emulated):
    rng = np.random.default_rng(3)
    args = make_inputs(
        rng, dtype="bfloat16", head_dim=128, group=7, block_size=1, scattered=True, context_lens=[9, 600]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = metal.paged_attention_metal(*args, scale=128**-0.5)
    assert all(metal._families.values()) and metal._families
    assert mismatch(out, paged_attention_reference(*args, 128**-0.5), "bfloat16") <= 1.0


def test_registers_per_lane_are_bounded():
    """Every shape the kernel accepts fits the register budget with its head split; a group
    that would not fit even over 8 simdgroups is refused."""
    for hd in (32, 64, 128, 256):
        for group in range(1, 33):
            hs = metal.head_splits(group, hd)
            assert hs in (1, 2, 4, 8)
            fits = metal.lane_registers(-(-group // hs), hd) <= metal.REGISTER_BUDGET
            assert fits or hs == 8
            if hs > 1:  # split only when one simdgroup holding every head would not fit
                assert metal.lane_registers(-(-group // (hs // 2)), hd) > metal.REGISTER_BUDGET
    pool = mx.zeros((2, 2, 16, 256), dtype=mx.float16)
    assert metal.supports(mx.zeros((1, 2 * 22, 256), dtype=mx.float16), pool)
    q = mx.zeros((1, 2 * 100, 64), dtype=mx.float16)  # 13 heads per simdgroup split 8 ways
    with pytest.raises(ValueError, match="159 registers per lane even split over 8 simdgroups"):
        metal._check(q, mx.zeros((2, 2, 16, 64), dtype=mx.float16))


# (G, head_dim) -> head groups: 2 (G=11: a padding head), 2, 4 (Qwen-like G=22 at 256; two
# padding heads), 8 (G=48), and 2 at head_dim 96 (6 dims per lane).
HEAD_SPLIT_SHAPES = [(11, 256, 2), (20, 128, 2), (22, 256, 4), (48, 64, 8), (13, 96, 2)]


@pytest.mark.parametrize("group,head_dim,splits", HEAD_SPLIT_SHAPES)
def test_query_heads_split_across_simdgroups(emulated, monkeypatch, group, head_dim, splits):
    """Shapes whose G query heads would overflow a lane's registers run on the kernel with the
    heads split over groups of simdgroups: single pass and split path match the reference under
    every lane order, the emulator's register estimate stays within budget, and each K/V row is
    read once per head group."""
    assert metal.head_splits(group, head_dim) == splits
    rng = np.random.default_rng(group)
    args = make_inputs(
        rng, dtype="float16", head_dim=head_dim, group=group, block_size=16, scattered=True, context_lens=[37, 300]
    )
    ref = paged_attention_reference(*args, head_dim**-0.5)
    for order in ORDERS:
        monkeypatch.setenv("MLXPAGED_EMU_ORDER", order)
        for part in (0, 64):
            with warnings.catch_warnings():
                warnings.simplefilter("error", emu.RegisterBudgetWarning)
                out, launches = metal.run_with_launches(*args, scale=head_dim**-0.5, partition_tokens=part)
            assert mismatch(out, ref, "float16") <= 1.0, (order, part)
            for launch in launches:
                stats = metal.last_launch_stats(launch)
                assert stats.array_registers <= metal.REGISTER_BUDGET, (launch.kind, stats.array_registers)
    q, k, v, bt, cl = args
    _, (launch,) = metal.run_with_launches(*args, scale=0.1, partition_tokens=0)
    kv = metal.bytes_read([launch]) - q.nbytes
    rows = 2 * sum(cl.tolist()) * k.shape[1] * k.shape[3] * 2  # K and V rows in context, fp16
    assert rows * splits <= kv <= rows * splits * 1.05


# (G, head_dim): lanes per token L = 8, 8, 4, 4, 16, 32, 16, 32 against P = G rounded up to a
# power of two: P < L, P > L (2 totals per lane), P = 2 L, P = 4 L with N < P, P = L / 2,
# P = L / 2 with N < P, 6 dims per lane (head_dim 96), 5 dims per lane (head_dim 160).
BUTTERFLY_SHAPES = [(3, 64), (10, 64), (7, 32), (10, 32), (8, 128), (9, 256), (5, 96), (4, 160)]


@pytest.mark.parametrize("group,head_dim", BUTTERFLY_SHAPES)
def test_token_butterfly_at_every_width(emulated, monkeypatch, group, head_dim):
    """Each sub-group's G scores are summed over its lanes and gathered back by one butterfly
    (pa_token_sums) at every (G, lanes per token) relation; every lane order, both paths,
    against the reference, with no simd_sum left in the token loop."""
    rng = np.random.default_rng(group)
    args = make_inputs(
        rng, dtype="float32", head_dim=head_dim, group=group, block_size=16, scattered=True, context_lens=[5, 77]
    )
    ref = paged_attention_reference(*args, head_dim**-0.5)
    assert metal.head_splits(group, head_dim) == 1
    for order in ORDERS:
        monkeypatch.setenv("MLXPAGED_EMU_ORDER", order)
        for part in (0, 32):
            out, launches = metal.run_with_launches(*args, scale=head_dim**-0.5, partition_tokens=part)
            assert mismatch(out, ref, "float32") <= 1.0, (order, part)
            assert metal.last_launch_stats(launches[0]).simd_reductions == 0


TOKEN_SUMS_KERNEL = """
const uint lane = thread_index_in_simdgroup;
float x[N];
for (int j = 0; j < N; j++) {
  x[j] = parts[lane * N + j];
}
pa_token_sums<N, L>(x, lane);
for (int j = 0; j < N; j++) {
  out[lane * N + j] = x[j];
}
"""


@pytest.mark.parametrize("lanes", [1, 2, 4, 8, 16, 32])
def test_token_sums_helper(emulated, monkeypatch, lanes):
    """pa_token_sums alone, in a one-simdgroup kernel: every lane ends with its sub-group's
    totals of all N values (numpy sums), for N = 1..32 and every lane order."""
    header, _ = metal.kernel_sources()
    kernel = emu.metal_kernel(
        name="pa_token_sums_test", input_names=["parts"], output_names=["out"], source=TOKEN_SUMS_KERNEL, header=header
    )
    rng = np.random.default_rng(lanes)
    for order in ORDERS:
        monkeypatch.setenv("MLXPAGED_EMU_ORDER", order)
        for n in (1, 2, 3, 5, 7, 8, 9, 16, 17, 32):
            parts = rng.standard_normal((32, n)).astype(np.float32)
            (out,) = kernel(
                inputs=[mx.array(parts)],
                template=[("N", n), ("L", lanes)],
                grid=(32, 1, 1),
                threadgroup=(32, 1, 1),
                output_shapes=[(32, n)],
                output_dtypes=[mx.float32],
            )
            want = np.repeat(parts.reshape(32 // lanes, lanes, n).sum(axis=1), lanes, axis=0)
            np.testing.assert_allclose(np.array(out), want, rtol=1e-5, atol=1e-5, err_msg=f"N={n} L={lanes} {order}")


@pytest.mark.parametrize("group,head_dim", [(7, 64), (7, 128)])
def test_cost_model_targets(group, head_dim):
    """Qwen2.5-0.5B and -7B head shapes: sub-groups of head_dim / 8 lanes score 4 (head_dim 64)
    or 2 (128) tokens per simdgroup step; each token's 7 scores are summed over its sub-group
    and gathered back by one butterfly of 14 (15) shuffles, so at most 4 (8) shuffle steps per
    token where the 4-token, 32-lane butterfly took 15 and 7 simd_sums 35; about one exp2 per
    (token, query head) in each sub-group (1 / 4 and 1 / 2 SIMD-wide); each lane's 8 dims of
    K and of V as one 16-byte load; about one barrier per 256 tokens in the token loop; a
    register estimate within Apple's budget."""
    from mlxpaged.bench.kernel import cost_model

    c = cost_model(group, head_dim, seqs=2, tokens=1000)
    lanes = head_dim // 8
    assert c["max_error"] < 2e-3
    assert c["simd_reductions_per_token"] == 0
    steps = 5 * c["simd_reductions_per_token"] + c["simd_shuffles_per_token"]
    assert steps <= {64: 4, 128: 8}[head_dim]
    assert c["exp_per_token_head"] <= {64: 0.35, 128: 0.6}[head_dim]
    assert c["loop_barriers_per_256_tokens"] <= 1.1
    assert c["device_loads_per_token"][16] >= 2 * lanes  # K and V: one 16-byte load per lane
    assert c["device_loads_per_token"].get(2, 0) < 1  # no scalar fp16 K/V loads
    assert c["device_loads_per_token"].get(8, 0) < 1
    # Scalars counted too: 256 threads x the estimate fit one core's register file;
    # the arrays' spill budget is test_query_heads_split_across_simdgroups's.
    assert 4 * 256 * c["registers"] <= 208 * 1024
    assert math.isfinite(c["barriers_per_256_tokens"])


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_bytes_read_within_5_percent_at_every_block_size(emulated, block_size):
    """Each K/V row once, table entries once per threadgroup: bytes read <= 1.05 x the minimum
    for the single pass and the planner's split, at Qwen2.5-1.5B head shapes."""
    from kernel_cases import check_reads_only

    rng = np.random.default_rng(8)
    for lens, split in (([300, 129], False), ([1100, 1030], True)):
        q, k, v, bt, cl = make_inputs(
            rng, dtype="float16", head_dim=128, group=6, block_size=block_size, scattered=True, context_lens=lens
        )
        out, launches = metal.run_with_launches(q, k, v, bt, cl, scale=0.1, partition_tokens=None if split else 0)
        assert (launches[-1].kind == "paged_attention_merge") == split
        check_reads_only(launches)
        ratio = metal.bytes_read(launches) / metal.minimum_bytes(q, k, cl)
        assert 1.0 <= ratio <= 1.05, (lens, ratio)
        assert mismatch(out, paged_attention_reference(q, k, v, bt, cl, 0.1), "float16") <= 1.0


def test_one_long_context_among_many_short_ones_is_split():
    """64 sequences x 2 kv heads fill the GPU, but one 32K context among them must not run on
    one threadgroup per kv head: it gets partitions of at most LONG_PARTITION_TOKENS."""
    plan = metal.plan_partition_tokens
    part = plan(64, 2, 32768 // 16, 16)
    assert 0 < part <= metal.LONG_PARTITION_TOKENS
    assert -(-32768 // part) >= 16  # threadgroups per kv head for the long sequence
    assert plan(64, 2, 4096 // 16, 16) == 0  # a 4K longest context: the batch fills the GPU
    assert plan(1, 2, 300000 // 16, 16) and -(-300000 // plan(1, 2, 300000 // 16, 16)) <= metal.MAX_PARTITIONS
