"""The Metal paged-attention kernel, run by the MSL emulator, against the pure-MLX reference.

Default run: a pairwise-covering subset of dtype x head_dim x heads per kv head x block size x
block layout x single/split pass, each case under every lane order (forward, reverse, random);
`MLXPAGED_FULL_SWEEP=1` runs the full product (480 cases). Also: mutants of the real source
must fail, the text the emulator compiles must equal what MLX would compile, and the kernel
reads each K/V row once.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxpaged.metal_emu as emu  # noqa: E402  (the project's own emulator: never skipped)
from mlxpaged.attention import metal
from mlxpaged.attention.reference import paged_attention_reference

from kernel_cases import (  # noqa: E402  # noqa: E402
    CLAMP_CASE,
    DTYPES,
    MUTANT_CASE,
    ORDERS,
    check_reads_only,
    make_inputs,
    mismatch,
    run_case,
    split_length,  # noqa: E402
    sweep_cases,
)


def case_id(c: dict) -> str:
    layout = "scattered" if c["scattered"] else "inorder"
    path = "split" if c["split"] else "single"
    return f"{c['dtype']}-hd{c['head_dim']}-g{c['group']}-bs{c['block_size']}-{layout}-{path}"


@pytest.mark.parametrize("case", sweep_cases(), ids=case_id)
def test_kernel_matches_reference(emulated, case):
    for order in ORDERS:
        emulated(order)
        err = run_case(case)
        assert err <= 1.0, f"mismatch {err} with lane order {order}"


def test_dispatcher_metal_impl(emulated):
    """`paged_attention(impl="metal")` reaches the kernel, scale defaulting to head_dim ** -0.5."""
    from mlxpaged.attention import paged_attention

    rng = np.random.default_rng(1)
    args = make_inputs(rng, dtype="float16", head_dim=64, group=7, block_size=16, scattered=True, context_lens=[5, 40])
    out = paged_attention(*args, impl="metal")
    ref = paged_attention_reference(*args, 64**-0.5)
    assert mismatch(out, ref, "float16") <= 1.0


# A 1,034-token context (a 1,035-block table row) in two partitions of 518 tokens (three
# 256-token chunks of block ids each, double-buffered), which a hard-coded 512 would not cover;
# two heads per group; the merge's two partitions on two of its simdgroups.
LONG_MUTANT_CASE = dict(MUTANT_CASE, block_size=1, split=True, length=1034, partition_tokens=518)
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"
MUTANTS = (
    [
        ("block table ignored", "h", "? table[b0 + i] : 0", "? b0 + i : 0", None, MUTANT_CASE),
        ("off-by-one row offset", "h", "(size_t)(t % BS) * HD", "(size_t)(t % BS + 1) * HD", None, MUTANT_CASE),
        ("no online-softmax rescale", "h", "st.acc[g][i] *= corr;", "", None, MUTANT_CASE),
        ("exp2 without log2(e) in the scale", "h", "scale * PA_LOG2E", "scale", None, MUTANT_CASE),
        (
            "sub-group scores one token too many",
            "h",
            "const bool valid = t < c1 && t >= tok_lo;",
            "const bool valid = t <= c1 && t >= tok_lo;",
            None,
            MUTANT_CASE,
        ),
        (
            "every sub-group scores the step's first token",
            "h",
            "const int t = t0 + sub;",
            "const int t = t0;",
            None,
            MUTANT_CASE,
        ),
        ("queries at the wrong lane's dims", "h", "tg_q + sl * D;", "tg_q;", None, MUTANT_CASE),
        (
            "butterfly gathers from the wrong lanes",
            "h",
            "(ushort)(base + (P <= L ? j * (L / P) : j / C))",
            "(ushort)(base + j % L)",
            None,
            MUTANT_CASE,
        ),
        (
            "butterfly gathers from sub-group 0",
            "h",
            "const uint base = lane - lane % L;",
            "const uint base = 0;",
            None,
            MUTANT_CASE,
        ),
        (
            "butterfly keeps the half it sends",
            "h",
            "x[j] = (up ? hi : lo) + simd_shuffle_xor(up ? lo : hi, o);",
            "x[j] = (up ? lo : hi) + simd_shuffle_xor(up ? lo : hi, o);",
            None,
            MUTANT_CASE,
        ),
        ("butterfly without its last steps", "h", "x[0] += simd_shuffle_xor(x[0], o);", "", None, MUTANT_CASE),
        ("one-exp update keeps the old max", "h", "st.m[g] = s[g];", "", None, MUTANT_CASE),
        ("a new max weighted by the rescale", "h", "p = 1.0f;", "", None, MUTANT_CASE),
        (
            "states combined without the other sub-groups",
            "h",
            "for (int b = 0; b < S; b++) {\n      o +=",
            "for (int b = 0; b < 1; b++) {\n      o +=",
            None,
            MUTANT_CASE,
        ),
        (
            "head groups take the same heads",
            "h",
            "const int g0 = (int)(sg % HS) * GH;",
            "const int g0 = 0;",
            None,
            dict(MUTANT_CASE, group=11, head_dim=64),
        ),
        (
            "head groups sum each other's simdgroups",
            "h",
            "for (int s = hg; s < NSG; s += HS) {\n    for (int b = 0; b < S; b++) {\n      o +=",
            "for (int s = 0; s < NSG; s += 1) {\n    for (int b = 0; b < S; b++) {\n      o +=",
            None,
            dict(MUTANT_CASE, group=11, head_dim=64),
        ),
        (
            "partition size not derived from the grid",
            "metal",
            "const int part_tokens = ((max_blocks * BS + num_parts - 1) / num_parts + BS - 1) / BS * BS;",
            "const int part_tokens = 512;",
            None,
            LONG_MUTANT_CASE,
        ),
        (
            "single pass without the context clamp",
            "metal",
            "const int ctx = clamp(PA_UNIFORM(context_lens[seq], lane), 0, max_blocks * BS);\n// A window",
            "const int ctx = PA_UNIFORM(context_lens[seq], lane);\n// A window",
            None,
            CLAMP_CASE,
        ),
        (
            "split pass without the context clamp",
            "metal",
            "const int ctx = clamp(PA_UNIFORM(context_lens[seq], lane), 0, max_blocks * BS);\nconst int win",
            "const int ctx = PA_UNIFORM(context_lens[seq], lane);\nconst int win",
            None,
            dict(CLAMP_CASE, split=True),
        ),
        (
            "uniform length from the wrong lane",
            "h",
            "simd_broadcast((lane) == 0 ? (x) : 0, (ushort)0)",
            "simd_broadcast((lane) == 0 ? (x) : 0, (ushort)1)",
            None,
            MUTANT_CASE,
        ),
        (
            "merge without partition weights",
            "metal",
            "acc[i] += wp * po[i];",
            "acc[i] += po[i];",
            None,
            dict(LONG_MUTANT_CASE, partition_tokens=128),
        ),  # 9 partitions: 2-3 per simdgroup
        (
            "merge without the cross-simdgroup rescale",
            "metal",
            "x += f * tg_acc[s * HD + d];",
            "x += tg_acc[s * HD + d];",
            None,
            LONG_MUTANT_CASE,
        ),
        (
            "merge sums only its first simdgroup",
            "metal",
            "for (int s = 0; s < NSG; s++) {\n    const float f",
            "for (int s = 0; s < 1; s++) {\n    const float f",
            None,
            LONG_MUTANT_CASE,
        ),
    ]
    + [  # every threadgroup barrier of the header, one at a time, and the merge's
        (f"missing barrier {n + 1}", "h", BARRIER, "", n, LONG_MUTANT_CASE) for n in range(3)
    ]
    + [("missing merge barrier", "metal", BARRIER, "", None, LONG_MUTANT_CASE)]
)


def mutate(monkeypatch, which: str, old: str, new: str, nth: int | None):
    """Make the wrapper build its kernels from the real source with one substitution."""
    header, bodies = metal.kernel_sources()
    text = header if which == "h" else "".join(bodies.values())
    if nth is None:
        assert text.count(old) == 1, f"mutant anchor {old!r} does not occur once"
    else:
        assert text.count(old) > nth, f"mutant anchor {old!r} occurs under {nth + 1} times"

    def sub(src: str) -> str:
        if old not in src:
            return src
        k = nth or 0
        i = -1
        for _ in range(k + 1):
            i = src.index(old, i + 1)
        return src[:i] + new + src[i + len(old) :]

    if which == "h":
        header = sub(header)
    else:
        bodies = {k: sub(b) for k, b in bodies.items()}
    monkeypatch.setattr(metal, "kernel_sources", lambda: (header, bodies))
    metal.reset_kernels()


def test_every_barrier_has_a_mutant():
    header, bodies = metal.kernel_sources()
    assert header.count(BARRIER) == 3  # chunk ids (also orders the queries), stats, outputs
    assert "".join(bodies.values()).count(BARRIER) == 1  # the merge's
    assert "".join(bodies.values()).count("threadgroup_barrier") == 1


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_mutants_are_caught(emulated, monkeypatch, mutant):
    """Every deliberately broken kernel fails the comparison (or the emulator rejects it):
    under every lane order, or for a missing barrier under at least one."""
    _, which, old, new, nth, case = mutant
    mutate(monkeypatch, which, old, new, nth)
    caught = []
    try:
        for order in ORDERS:
            emulated(order)
            try:
                err = run_case(case)
            except (emu.MetalEmuError, metal.KernelCheckError) as e:  # e.g. an out-of-bounds read
                caught.append(f"{order}: {str(e)[:80]}")
                continue
            if not err <= 1.0:  # NaN counts as caught
                caught.append(f"{order}: mismatch {err:.3g}")
    finally:
        metal.reset_kernels()  # drop the mutated kernel objects
    print(mutant[0], caught)
    needed = 1 if old == BARRIER else len(ORDERS)
    assert len(caught) >= needed, f"mutant passed under too many lane orders: {caught}"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_source_parity(emulated, dtype):
    """For every kernel shipped (single pass, partitioned, merge), the emulator compiled exactly
    the text MLX would hand the Metal compiler."""
    rng = np.random.default_rng(2)
    args = make_inputs(rng, dtype=dtype, head_dim=64, group=2, block_size=16, scattered=True, context_lens=[3, 40])
    launches = []
    for part in (0, 32):
        launches += metal.run_with_launches(*args, scale=0.125, partition_tokens=part)[1]
    assert [launch.kind for launch in launches] == list(metal.KERNEL_IO)
    for launch in launches:
        kernel = metal._kernel(metal._metal_kernel_factory(), launch.kind, launch.variant)
        expected = emu.mlx_compiled_source(launch.kernel_kwargs, launch.call)
        assert kernel.last_source == expected, launch.kind


@pytest.mark.parametrize("block_size,split", [(1, True), (16, False), (256, True)])
def test_reads_each_row_once(emulated, block_size, split):
    """Bytes read stay within 5% of the minimum (the queries, lengths and scale are read by
    every thread, and partials go through the merge), at Qwen2.5-1.5B head shapes."""
    emulated("forward")
    rng = np.random.default_rng(3)
    lens = [2000, 1500] if split else [300, 129]
    q, k, v, bt, cl = make_inputs(
        rng, dtype="float16", head_dim=128, group=6, block_size=block_size, scattered=True, context_lens=lens
    )
    _, launches = metal.run_with_launches(q, k, v, bt, cl, scale=0.1)
    assert (launches[-1].kind == "paged_attention_merge") == split
    check_reads_only(launches)
    ratio = metal.bytes_read(launches) / metal.minimum_bytes(q, k, cl)
    assert 1.0 <= ratio <= 1.05, ratio


M1 = {"device_name": "Apple M1", "architecture": "applegpu_g13g"}  # 8 GPU cores
M3_MAX = {"device_name": "Apple M3 Max", "architecture": "applegpu_g15s"}  # 40 GPU cores


def test_device_core_count():
    """Cores from an explicit count, the chip's name, the architecture's last letter (as MLX
    reads it), else the documented default."""
    assert metal.gpu_cores(M1) == 8 and metal.gpu_cores(M3_MAX) == 40
    assert metal.gpu_cores({"device_name": "Apple M9", "architecture": "applegpu_g99s"}) == 40
    assert metal.gpu_cores({"gpu_core_count": 30, "device_name": "Apple M3 Max"}) == 30
    assert metal.gpu_cores({}) == metal.DEFAULT_GPU_CORES
    assert metal.device_info() == {} or metal.gpu_cores(metal.device_info()) > 0


def threadgroups(plan_args, part):
    """Threadgroups of the longest sequence's split (or single pass) over all its kv heads."""
    _, kvh, max_blocks, bs = plan_args
    return kvh * (-(-max_blocks * bs // part) if part else 1)


def test_plan_partitions_from_the_device():
    """More cores, more partitions: a 32K context on an M3 Max fills 4 threadgroups per core
    with partitions of a few hundred tokens; an M1 needs fewer; a short batch that already
    fills the GPU is not split."""
    plan = metal.plan_partition_tokens
    one_long = (1, 2, 2048, 16)
    for device, cores in ((M1, 8), (M3_MAX, 40)):
        part = plan(*one_long, device=device)
        # (whole blocks per partition: the count may fall a little short of the target)
        assert threadgroups(one_long, part) >= 0.95 * cores * metal.THREADGROUPS_PER_CORE
        assert part % 16 == 0 and part >= metal.MIN_PARTITION_TOKENS
    assert plan(*one_long, device=M3_MAX) < plan(*one_long, device=M1)
    assert 128 <= plan(2, 2, 256, 16, device=M3_MAX) <= 256  # 4K contexts, parallelism needed
    assert plan(64, 2, 64, 16, device=M1) == 0  # 1K contexts, 128 (sequence, kv head) pairs
    assert plan(4, 2, 8, 16, device=M3_MAX) == 0  # 128 tokens: too short to split


def test_one_32k_sequence_among_short_ones_is_split():
    """The batch fills the GPU, but the longest context (the table's width) is 32K: it gets
    partitions of at most LONG_PARTITION_TOKENS on any device, not one threadgroup per kv head."""
    for device in (M1, M3_MAX, {}):
        args = (63, 2, 32768 // 16, 16)
        part = metal.plan_partition_tokens(*args, group=7, head_dim=64, device=device)
        assert 0 < part <= metal.LONG_PARTITION_TOKENS
        assert threadgroups(args, part) >= 32


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_plan_keeps_the_partials_small(bits):
    """Partitions are long enough that the bytes only the split reads (queries again, fp32
    partials through the merge) stay within PARTIAL_BYTES_FRACTION of the K/V bytes: longer for
    a quantized cache's smaller rows. Checked by counting those bytes, at every block size."""
    from mlxpaged.attention.kv_quant import row_bytes

    for group, hd in ((7, 64), (7, 128), (1, 128), (8, 256)):
        row = row_bytes(hd, bits, 32, mx.float16)
        for bs in (1, 2, 16, 64, 256):
            for ctx in (300, 513, 4096, 32768, 200000):
                max_blocks = -(-ctx // bs)
                part = metal.plan_partition_tokens(
                    1, 2, max_blocks, bs, group=group, head_dim=hd, kv_row_bytes=row, device=M3_MAX
                )
                if not part:
                    continue
                n = -(-max_blocks * bs // part)
                assert part % bs == 0 and 2 <= n <= metal.MAX_PARTITIONS
                extra = group * (hd * (2 + 4) + 8) + 8 * metal.NUM_SIMDGROUPS
                assert extra <= metal.PARTIAL_BYTES_FRACTION * part * 2 * row
    assert (
        metal.min_partition_tokens(7, 64, row_bytes(64, 4, 32, mx.float16), 2)
        > metal.min_partition_tokens(7, 64, row_bytes(64, 8, 32, mx.float16), 2)
        > metal.min_partition_tokens(7, 64, 128, 2)
        > metal.MIN_PARTITION_TOKENS
    )


@pytest.mark.parametrize("split", [False, True])
def test_inputs_under_eight_elements(emulated, split):
    """MLX passes arrays of fewer than 8 elements in the constant address space, under another
    kernel name. The wrapper pads a one-sequence block table, the lengths and the split path's
    per-partition max and sum arrays, so every kernel sees device arrays (one name per shape
    family), and the padding changes no result."""
    emulated("random:3")
    rng = np.random.default_rng(4)
    lens = [split_length(1, 64, 256, 128, 2) + 40] if split else [70]
    bs = 256 if split else 16
    args = make_inputs(
        rng, dtype="float16", head_dim=64, group=1, block_size=bs, scattered=True, context_lens=lens, num_kv_heads=1
    )
    assert args[3].size < 8
    out, launches = metal.run_with_launches(*args, scale=0.125)
    assert launches[-1].kind == ("paged_attention_merge" if split else "paged_attention")
    for launch in launches:
        arrays = [x for x in launch.call["inputs"] if x.ndim > 0]
        assert min(x.size for x in arrays) >= 8, [x.shape for x in arrays]
        source = metal._kernel(metal._metal_kernel_factory(), launch.kind, launch.variant).last_source
        signature = source[source.index("[[kernel]] void") :].split(") {")[0]
        constant = [ln.split()[3] for ln in signature.splitlines() if ln.strip().startswith("const constant")]
        assert constant and all(
            n in ("scale", "window") or n.endswith(("_shape", "_strides", "_ndim")) for n in constant
        ), constant
    assert mismatch(out, paged_attention_reference(*args, 0.125), "float16") <= 1.0


@pytest.mark.parametrize(
    "head_dim,block_size,group", [(64, 16, 6), (128, 1, 7), (128, 256, 1), (256, 16, 22)]
)  # heads split 4 ways
def test_threadgroup_memory(emulated, head_dim, block_size, group):
    """The wrapper's threadgroup-memory estimate (its 32 KiB check) matches the kernel's."""
    rng = np.random.default_rng(5)
    args = make_inputs(
        rng,
        dtype="bfloat16",
        head_dim=head_dim,
        group=group,
        block_size=block_size,
        scattered=False,
        context_lens=[3, 9],
    )
    _, (launch,) = metal.run_with_launches(*args, scale=0.1, partition_tokens=0)
    kernel = metal._kernel(metal._metal_kernel_factory(), launch.kind, launch.variant)
    expected = metal.threadgroup_bytes(head_dim, block_size, group)
    assert kernel.last_launch.threadgroup_memory_bytes == expected


def test_query_dtype_differs_from_cache(emulated):
    """A float32 query on a float16 pool: computed in the pool's dtype, returned in q's."""
    rng = np.random.default_rng(6)
    q, k, v, bt, cl = make_inputs(
        rng, dtype="float16", head_dim=64, group=6, block_size=16, scattered=True, context_lens=[7, 33]
    )
    q32 = q.astype(mx.float32)
    out = metal.paged_attention_metal(q32, k, v, bt, cl, scale=0.125)
    assert out.dtype == mx.float32
    assert mismatch(out, paged_attention_reference(q32, k, v, bt, cl, 0.125), "float16") <= 1.0


def test_unsupported_shapes_are_refused():
    rng = np.random.default_rng(7)
    q, k, v, bt, cl = make_inputs(
        rng, dtype="float16", head_dim=64, group=2, block_size=16, scattered=False, context_lens=[5]
    )
    with pytest.raises(ValueError, match="head_dim"):
        metal.paged_attention_metal(q[..., :48], k[..., :48], v[..., :48], bt, cl, scale=0.1)
    with pytest.raises(TypeError, match="dtype"):
        metal.paged_attention_metal(q, k.astype(mx.int32), v.astype(mx.int32), bt, cl, scale=0.1)
    wide = mx.zeros((1, 2 * 64, 256), dtype=mx.float16)  # 64 heads per kv head at head_dim 256
    pool = mx.zeros((2, 2, 16, 256), dtype=mx.float16)
    with pytest.raises(ValueError, match="threadgroup memory"):
        metal.paged_attention_metal(wide, pool, pool, bt, cl, scale=0.1)
