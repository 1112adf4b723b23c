"""The Metal kernels over a quantized KV cache (`kv_quant.QuantizedPool`), run by the MSL
emulator, against the pure-MLX reference on the dequantized pools.

The kernels dequantize in fp32 (scale * code + bias), so the reference runs in float32 on
`QuantizedPool(data, fp32 scales, fp32 biases).dequantize()` (`metal.dequantized`; the varlen
kernel stages those values rounded once to the dtype, and its reference takes them so), and its
result is rounded to the dtype once, as the float kernels' tests do. Default run: a
pairwise-covering subset of dtype x head_dim x heads per kv head x block size x bits x group
size (decode: also single/split pass; varlen: a ragged batch of q_lens), one lane order per
case (rotating). Also: MLX's packing order, mutants (wrong group size, scales and biases
swapped, nibbles swapped), bytes read against the quantized minimum, the startup check's
quantized variants and its fallback, refused shapes, source parity, and the engine (tiny
model) decoding through the quantized kernels.
"""

from __future__ import annotations

import re
import warnings

import mlx.core as mx
import numpy as np
import pytest

import mlxpaged.metal_emu as emu  # noqa: E402  (the project's own emulator: never skipped)
from mlxpaged.attention import metal
from mlxpaged.attention import metal_varlen as mv
from mlxpaged.attention.kv_quant import QuantizedPool, row_bytes
from mlxpaged.attention.reference import paged_attention_reference, paged_attention_varlen_reference

from kernel_cases import pairwise  # noqa: E402

# These tests patch kernel sources and factories: the `emulated` fixture (conftest) resets the
# kernel caches after each one.
RESET_KERNELS = True

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
# (atol, rtol) per dtype: the kernel and the reference both round an fp32 result to the dtype;
# the varlen kernel also stages dequantized K/V rows as the dtype (one more rounding).
TOLERANCE = {"float16": (1e-3, 4e-3), "bfloat16": (8e-3, 2e-2), "float32": (1e-5, 1e-4)}
ORDERS = ("forward", "reverse", "random:7")

DECODE_FACTORS = {
    "dtype": tuple(DTYPES),
    "head_dim": (64, 128, 256),
    "group": (1, 2, 7, 8),
    "block_size": (8, 16, 32),
    "bits": (4, 8),
    "kv_group": (32, 64),
    "split": (False, True),
}
VARLEN_FACTORS = {
    "dtype": tuple(DTYPES),
    "head_dim": (64, 128),
    "group": (1, 4, 7),
    "block_size": (8, 16, 32),
    "bits": (4, 8),
    "kv_group": (32, 64),
}
VARLEN_BATCH = ([1, 7, 16, 33, 20], [300, 1, 15, 0, 16])  # (q_lens, cached prefixes)


def case_id(c: dict) -> str:
    path = ("-split" if c["split"] else "-single") if "split" in c else ""
    return f"{c['dtype']}-hd{c['head_dim']}-g{c['group']}-bs{c['block_size']}-q{c['bits']}-gs{c['kv_group']}{path}"


def tables_for(rng, context_lens, block_size):
    """Scattered block tables over a pool a little larger than needed; entries past each
    sequence's last block hold random ids the kernels must ignore. -> (tables, pool blocks)"""
    nblocks = [-(-n // block_size) for n in context_lens]
    pool = sum(nblocks) + 3
    ids = rng.permutation(pool)
    tables = rng.integers(0, pool, size=(len(context_lens), max(nblocks) + 1)).astype(np.int32)
    start = 0
    for i, n in enumerate(nblocks):
        tables[i, :n] = ids[start : start + n]
        start += n
    return mx.array(tables), pool


def quantized_pools(rng, pool, num_kv_heads, block_size, head_dim, dtype, bits, kv_group):
    shape = (pool, num_kv_heads, block_size, head_dim)
    return [
        QuantizedPool.quantize(mx.array(rng.standard_normal(shape), dtype=DTYPES[dtype]), bits, kv_group)
        for _ in range(2)
    ]


def decode_inputs(rng, c, context_lens, num_kv_heads=2):
    tables, pool = tables_for(rng, context_lens, c["block_size"])
    k, v = quantized_pools(
        rng, pool, num_kv_heads, c["block_size"], c["head_dim"], c["dtype"], c["bits"], c["kv_group"]
    )
    q = mx.array(
        1.5 * rng.standard_normal((len(context_lens), num_kv_heads * c["group"], c["head_dim"])),
        dtype=DTYPES[c["dtype"]],
    )
    return q, k, v, tables, mx.array(np.array(context_lens, np.int32))


def varlen_inputs(rng, c, q_lens, prefixes, num_kv_heads=2):
    ctx = [n + p for n, p in zip(q_lens, prefixes)]
    tables, pool = tables_for(rng, ctx, c["block_size"])
    k, v = quantized_pools(
        rng, pool, num_kv_heads, c["block_size"], c["head_dim"], c["dtype"], c["bits"], c["kv_group"]
    )
    q = mx.array(
        1.5 * rng.standard_normal((sum(q_lens), num_kv_heads * c["group"], c["head_dim"])), dtype=DTYPES[c["dtype"]]
    )
    cu = mx.array(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    return q, k, v, tables, cu, mx.array(np.array(ctx, np.int32))


def mismatch(out: mx.array, ref: mx.array, dtype: str) -> float:
    """Largest |out - ref| / (atol + rtol |ref|): at most 1 passes; NaN never does."""
    atol, rtol = TOLERANCE[dtype]
    o, r = out.astype(mx.float32), ref.astype(mx.float32)
    return float(mx.max(mx.abs(o - r) / (atol + rtol * mx.abs(r))).item())


def decode_reference(q, k, v, bt, cl, scale):
    f32 = q.astype(mx.float32), metal.dequantized(k), metal.dequantized(v)
    return paged_attention_reference(*f32, bt, cl, scale).astype(q.dtype)


def varlen_reference(q, k, v, *rest, scale):
    """The varlen kernel stages each dequantized value (fp32) rounded once to the dtype, so the
    reference runs on those values (`dequantize()` in a half dtype rounds twice)."""
    kv = (metal.dequantized(p).astype(q.dtype).astype(mx.float32) for p in (k, v))
    return paged_attention_varlen_reference(q.astype(mx.float32), *kv, *rest, scale).astype(q.dtype)


def run_decode(c: dict, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    bs = c["block_size"]
    row = row_bytes(c["head_dim"], c["bits"], c["kv_group"], DTYPES[c["dtype"]])
    shortest = metal.min_partition_tokens(c["group"], c["head_dim"], row, DTYPES[c["dtype"]].size)
    lens = [1, 2 * bs, bs + 3] + ([2 * shortest + 3 * bs + 5] if c["split"] else [])
    q, k, v, bt, cl = decode_inputs(rng, c, lens)
    scale = c["head_dim"] ** -0.5
    out, launches = metal.run_with_launches(q, k, v, bt, cl, scale=scale, partition_tokens=None if c["split"] else 0)
    kinds = [launch.kind for launch in launches]
    assert kinds == (
        ["paged_attention_partitioned_quant", "paged_attention_merge"] if c["split"] else ["paged_attention_quant"]
    ), kinds
    assert out.dtype == q.dtype and out.shape == q.shape
    return mismatch(out, decode_reference(q, k, v, bt, cl, scale), c["dtype"])


def run_varlen(c: dict, batch=VARLEN_BATCH, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    args = varlen_inputs(rng, c, *batch)
    scale = c["head_dim"] ** -0.5
    out, launches = mv.run_with_launches(*args, scale=scale)
    assert launches[0].kind == mv.QUANT_KERNEL  # the varlen kernel ran (decodes may follow)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    return mismatch(out, varlen_reference(*args, scale=scale), c["dtype"])


def test_mlx_packs_codes_lsb_first():
    """What the kernels assume of `mx.quantize`: value j of a row is code j, packed `bits` at a
    time from the least significant bit of uint32 word j * bits // 32, and
    value = scale * code + bias per group (checked with numpy against `mx.dequantize`)."""
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((3, 128)), dtype=mx.float32)
    for bits in (4, 8):
        for gs in (32, 64):
            pool = QuantizedPool.quantize(x, bits, gs)
            words = np.array(pool.data).astype(np.uint64)
            j = np.arange(128)
            codes = (words[:, j * bits // 32] >> ((j * bits) % 32).astype(np.uint64)) & (2**bits - 1)
            scales = np.repeat(np.array(pool.scales), gs, axis=1)
            biases = np.repeat(np.array(pool.biases), gs, axis=1)
            np.testing.assert_array_equal(scales * codes.astype(np.float32) + biases, np.array(pool.dequantize()))


DECODE_CASES = pairwise(DECODE_FACTORS)


@pytest.mark.parametrize("i,case", list(enumerate(DECODE_CASES)), ids=[case_id(c) for c in DECODE_CASES])
def test_decode_kernel_matches_reference(emulated, i, case):
    order = ORDERS[i % len(ORDERS)]
    emulated(order)
    err = run_decode(case)
    assert err <= 1.0, f"mismatch {err} with lane order {order}"


VARLEN_CASES = pairwise(VARLEN_FACTORS)


@pytest.mark.parametrize("i,case", list(enumerate(VARLEN_CASES)), ids=[case_id(c) for c in VARLEN_CASES])
def test_varlen_kernel_matches_reference(emulated, i, case):
    order = ORDERS[i % len(ORDERS)]
    emulated(order)
    err = run_varlen(case)
    assert err <= 1.0, f"mismatch {err} with lane order {order}"


# Mutants: (description, regular expression over the kernel file's header, replacement,
# occurrences: all are replaced). The decode mutants break paged_attention.h, the varlen ones
# the varlen file's header.
WRONG_GS = r"\1<T, HD, BITS, (GS == 32 ? 64 : 32)> \2_cache"  # the other group size
SWAPPED = r"{\1_data, \1_biases, \1_scales}"
DECODE_MUTANTS = [
    ("wrong group size", r"(PAQuantPool)<T, HD, BITS, GS> ([kv])_cache", WRONG_GS, 2),
    ("scales and biases swapped", r"{([kv])_data, \1_scales, \1_biases}", SWAPPED, 2),
    ("nibble order swapped", re.escape("((i * BITS) % 32)"), "((((i ^ 1) * BITS)) % 32)", 1),
    ("every lane takes group 0's scale", re.escape("(ushort)(base + sl * D / GS)"), "(ushort)base", 1),
]
VARLEN_MUTANTS = [
    ("wrong group size", r"(PAVQuantPool)<T, HD, BITS, GS> ([kv])_cache", WRONG_GS, 2),
    ("scales and biases swapped", r"{([kv])_data, \1_scales, \1_biases}", SWAPPED, 2),
    ("nibble order swapped", re.escape("(x >> (k * BITS))"), "(x >> ((k ^ 1) * BITS))", 1),
    # Staging over all threads: a group's scale and bias come from its first lane.
    ("scale and bias not shuffled from the group's lane", re.escape("(ushort)(lane - lane % W)"), "(ushort)lane", 1),
]
MUTANT_CASE = dict(dtype="float32", head_dim=64, group=2, block_size=16, bits=4, kv_group=32, split=False)


def caught(run) -> list[str]:
    """The lane orders under which `run` fails: an emulator error, a failed startup check or a
    mismatch (NaN included)."""
    out = []
    for order in ORDERS:
        try:
            err = run(order)
        except (emu.MetalEmuError, metal.KernelCheckError) as e:
            out.append(f"{order}: {str(e)[:80]}")
            continue
        if not err <= 1.0:
            out.append(f"{order}: mismatch {err:.3g}")
    return out


@pytest.mark.parametrize("mutant", DECODE_MUTANTS, ids=[m[0] for m in DECODE_MUTANTS])
def test_decode_mutants_are_caught(emulated, monkeypatch, mutant):
    name, old, new, count = mutant
    header, bodies = metal.kernel_sources()
    mutated, n = re.subn(old, new, header)
    assert n == count, f"mutant anchor {old!r} occurs {n} times, not {count}"
    monkeypatch.setattr(metal, "kernel_sources", lambda: (mutated, bodies))
    metal.reset_kernels()

    def run(order):
        emulated(order)
        return run_decode(MUTANT_CASE)

    try:
        found = caught(run)
    finally:
        metal.reset_kernels()
    print(name, found)
    assert len(found) == len(ORDERS), f"mutant passed under some lane order: {found}"


@pytest.mark.parametrize("mutant", VARLEN_MUTANTS, ids=[m[0] for m in VARLEN_MUTANTS])
def test_varlen_mutants_are_caught(emulated, monkeypatch, mutant):
    name, old, new, count = mutant
    header, body = mv.kernel_sources()
    mutated, n = re.subn(old, new, header)
    assert n == count, f"mutant anchor {old!r} occurs {n} times, not {count}"
    monkeypatch.setattr(mv, "kernel_sources", lambda: (mutated, body))
    mv._kernel.cache_clear()

    def run(order):
        emulated(order)
        return run_varlen(MUTANT_CASE, ([7, 40, 20], [0, 50, 16]))  # no decode row: varlen kernel only

    try:
        found = caught(run)
    finally:
        mv._kernel.cache_clear()
    print(name, found)
    assert len(found) == len(ORDERS), f"mutant passed under some lane order: {found}"


def quant_minimum_decode(q, k, cl) -> int:
    """Codes, scales and biases of every K and V row in context once, the queries, the table
    entries in use and the lengths (computed here, not by the wrapper)."""
    _, kvh, bs, hd = k.shape
    lens = [int(n) for n in cl.tolist()]
    rows = 2 * sum(lens) * kvh
    per_row = hd * k.bits // 8 + 2 * (hd // k.group_size) * k.dtype.size
    return rows * per_row + q.nbytes + 4 * sum(-(-n // bs) for n in lens) + 4 * len(lens)


@pytest.mark.parametrize("group,head_dim,bits,lens", [(7, 64, 4, [1000, 700]), (7, 128, 8, [300, 129])])
def test_decode_reads_the_quantized_rows_once(emulated, group, head_dim, bits, lens):
    """Qwen2.5-0.5B (G 7, head_dim 64) at 4 bits and -7B (head_dim 128) at 8 bits, block 16,
    single pass: bytes read within 5% of the quantized minimum, every code, scale and bias
    byte read exactly once, and no input written."""
    emulated("forward")
    c = dict(dtype="float16", head_dim=head_dim, group=group, block_size=16, bits=bits, kv_group=32)
    q, k, v, bt, cl = decode_inputs(np.random.default_rng(3), c, lens)
    out, (launch,) = metal.run_with_launches(q, k, v, bt, cl, scale=0.1, partition_tokens=0)
    stats = metal.last_launch_stats(launch)
    rows = sum(lens) * 2  # K (or V) rows in context, over both kv heads
    assert stats.bytes_read["k_data"] == stats.bytes_read["v_data"] == rows * head_dim * bits // 8
    for name in ("k_scales", "k_biases", "v_scales", "v_biases"):
        assert stats.bytes_read[name] == rows * (head_dim // 32) * 2
    assert not any(stats.bytes_written[n] for n in metal.QUANT_KERNEL_IO[launch.kind][0])
    least = quant_minimum_decode(q, k, cl)
    assert least == metal.minimum_bytes(q, k, cl)
    assert 1.0 <= metal.bytes_read([launch]) / least <= 1.05
    assert mismatch(out, decode_reference(q, k, v, bt, cl, 0.1), "float16") <= 1.0


@pytest.mark.parametrize("bits", [4, 8])
def test_decode_head_dim_32(emulated, bits):
    """head_dim 32: sub-groups of 4 lanes, 8 codes per lane (4 bytes at 4 bits), 8 tokens per
    simdgroup step; single pass and split against the reference under every lane order, each
    code byte read once."""
    c = dict(dtype="float16", head_dim=32, group=7, block_size=16, bits=bits, kv_group=32)
    q, k, v, bt, cl = decode_inputs(np.random.default_rng(bits), c, [45, 300])
    ref = decode_reference(q, k, v, bt, cl, 0.2)
    for order in ORDERS:
        emulated(order)
        for part in (0, 64):
            out, launches = metal.run_with_launches(q, k, v, bt, cl, scale=0.2, partition_tokens=part)
            assert mismatch(out, ref, "float16") <= 1.0, (order, part)
    stats = metal.last_launch_stats(launches[0])
    assert stats.bytes_read["k_data"] == stats.bytes_read["v_data"] == 345 * 2 * 32 * bits // 8


@pytest.mark.parametrize("bits", [8, 4])
def test_split_path_reads_within_5_percent_of_the_quantized_minimum(emulated, bits):
    """The planner's split (partitioned + merge) over a quantized cache at
    Qwen2.5-0.5B head shapes reads at most 1.05x the quantized minimum: its partitions are long
    enough that the re-read queries and the fp32 partials stay small beside the short rows."""
    emulated("forward")
    c = dict(dtype="float16", head_dim=64, group=7, block_size=16, bits=bits, kv_group=32)
    rng = np.random.default_rng(11)
    q, k, v, bt, cl = decode_inputs(rng, c, [2600, 700])
    out, launches = metal.run_with_launches(q, k, v, bt, cl, scale=0.125)
    assert [launch.kind for launch in launches] == ["paged_attention_partitioned_quant", "paged_attention_merge"]
    ratio = metal.bytes_read(launches) / metal.minimum_bytes(q, k, cl)
    assert 1.0 <= ratio <= 1.05, ratio
    assert mismatch(out, decode_reference(q, k, v, bt, cl, 0.125), "float16") <= 1.0


def test_varlen_reads_the_quantized_rows_once_per_tile(emulated):
    """Qwen2.5-0.5B head shapes at 4 bits: a 32-token chunk over a 2,048-token prefix reads
    within 5% of the quantized minimum of walking each tile's visible keys once, plus the
    queries and the table entries."""
    emulated("forward")
    c = dict(dtype="float16", head_dim=64, group=7, block_size=16, bits=4, kv_group=32)
    q_lens, prefixes = [32], [2048]
    q, k, v, bt, cu, cl = varlen_inputs(np.random.default_rng(4), c, q_lens, prefixes)
    out, (launch,) = mv.run_with_launches(q, k, v, bt, cu, cl, scale=0.125)
    stats = launch.kernel.last_launch
    assert not any(stats.bytes_written[n] for n in launch.kernel.last_stats)
    rows = sum(prefixes[0] + min(i0 + mv.TILE_TOKENS, q_lens[0]) for _, i0 in mv.tile_map(cu.tolist()))
    per_row = row_bytes(64, 4, 32, mx.float16)
    blocks = -(-int(cl[0]) // 16)
    least = 2 * rows * 2 * per_row + q.nbytes + 4 * blocks * len(mv.tile_map(cu.tolist()))
    assert stats.bytes_read["k_data"] == rows * 2 * 32  # each tile's rows once, 32 code bytes each
    assert 1.0 <= sum(launch.kernel.last_stats.values()) / least <= 1.05
    assert mismatch(out, varlen_reference(q, k, v, bt, cu, cl, scale=0.125), "float16") <= 1.0


def test_startup_check_builds_the_quantized_variants(emulated):
    """`check_family` on a QuantizedPool (what the engine passes at start-up) builds and checks
    the quantized kernels, per (bits, group size), silently when they are healthy."""
    c = dict(dtype="bfloat16", head_dim=128, group=7, block_size=16, bits=8, kv_group=64)
    q, k, v, bt, cl = decode_inputs(np.random.default_rng(5), c, [9, 40])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert metal.check_family(7, k)
        assert metal.supports(q, k)
        out = metal.paged_attention_metal(q, k, v, bt, cl, scale=0.1)
    assert [key[-1] for key in metal._families] == [(8, 64)] and all(metal._families.values())
    factory = metal._metal_kernel_factory()
    for kind in (*metal.QUANT_KERNEL_IO, "paged_attention_merge"):  # each built and run once
        variant = (
            f"hd128_nsg{metal.MERGE_SIMDGROUPS}" if kind == "paged_attention_merge" else "hd128_bs16_g7_nsg8_q8_gs64"
        )
        assert metal._kernel(factory, kind, variant).last_launch is not None, kind
    assert mismatch(out, decode_reference(q, k, v, bt, cl, 0.1), "bfloat16") <= 1.0


class FaultyQuantFactory:
    """The emulator, except that the quantized single-pass kernel returns wrong values."""

    def __call__(self, **kernel_kwargs):
        real = emu.metal_kernel(**kernel_kwargs)
        if not kernel_kwargs["name"].startswith("paged_attention_quant_"):
            return real
        return lambda **call: [o + 1.0 for o in real(**call)]


def test_failed_quantized_variant_falls_back_with_one_warning(monkeypatch):
    factory = FaultyQuantFactory()
    monkeypatch.setattr(metal, "_metal_kernel_factory", lambda: factory)
    monkeypatch.delenv("MLXPAGED_METAL", raising=False)
    metal.reset_kernels()
    c = dict(dtype="float16", head_dim=64, group=2, block_size=16, bits=4, kv_group=32)
    q, k, v, bt, cl = decode_inputs(np.random.default_rng(6), c, [5, 40])
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert not metal.check_family(2, k)  # engine start-up: one warning
            out, launches = metal.run_with_launches(q, k, v, bt, cl, scale=0.125)
        msgs = [str(m.message) for m in w if "kernel check failed" in str(m.message)]
        assert len(msgs) == 1 and "hd64_bs16_g2_nsg8_q4_gs32" in msgs[0], msgs
        assert launches == []  # the reference path, over the quantized pools
        assert mx.array_equal(out, paged_attention_reference(q, k, v, bt, cl, 0.125)).item()
        # the float family of the same shapes is unaffected
        assert metal.check_family(2, k.dequantize())
    finally:
        metal.reset_kernels()


def test_unsupported_quantized_caches_are_refused():
    q = mx.zeros((1, 4, 64), dtype=mx.float16)
    k4 = QuantizedPool.zeros(2, 2, 16, 64, mx.float16, 4, 32)
    k8 = QuantizedPool.zeros(2, 2, 16, 64, mx.float16, 8, 32)
    assert metal.supports(q, k4) and metal.supports(q, k8)
    bt, cl = mx.zeros((1, 1), dtype=mx.int32), mx.array([3], dtype=mx.int32)
    with pytest.raises(ValueError, match="quantized alike"):
        metal.paged_attention_metal(q, k4, k8, bt, cl, scale=0.1)
    with pytest.raises(ValueError, match="quantized alike"):
        metal.paged_attention_metal(q, k4, k4.dequantize(), bt, cl, scale=0.1)
    q32 = mx.zeros((1, 4, 32), dtype=mx.float16)  # 8 values per lane: 4 bytes at 4 bits
    assert metal.supports(q32, QuantizedPool.zeros(2, 2, 16, 32, mx.float16, 4, 32))
    assert metal.supports(q32, QuantizedPool.zeros(2, 2, 16, 32, mx.float16, 8, 32))
    q96 = mx.zeros((1, 4, 96), dtype=mx.float16)  # 6 values per lane, not a power of two
    assert not metal.supports(q96, QuantizedPool.zeros(2, 2, 16, 96, mx.float16, 8, 32))


def test_source_parity_and_registers(emulated):
    """The emulator compiled exactly the text MLX would hand the Metal compiler for each
    quantized kernel, and the register estimate stays within budget at Qwen2.5-7B's G 7,
    head_dim 128."""
    c = dict(dtype="float16", head_dim=128, group=7, block_size=8, bits=8, kv_group=32)
    rng = np.random.default_rng(7)
    q, k, v, bt, cl = decode_inputs(rng, c, [3, 9], num_kv_heads=1)
    launches = []
    for part in (0, 8):
        launches += metal.run_with_launches(q, k, v, bt, cl, scale=0.1, partition_tokens=part)[1]
    q2, k2, v2, bt2, cu2, cl2 = varlen_inputs(rng, c, [5, 1], [3, 2], num_kv_heads=1)
    _, vl = mv.run_with_launches(q2, k2, v2, bt2, cu2, cl2, scale=0.1)
    for launch in launches:
        kernel = metal._kernel(metal._metal_kernel_factory(), launch.kind, launch.variant)
        assert kernel.last_source == emu.mlx_compiled_source(launch.kernel_kwargs, launch.call)
        assert not kernel.last_launch.over_register_budget, kernel.last_launch.registers
        if launch.kind != "paged_attention_merge":  # the wrapper's 32 KiB check holds
            assert kernel.last_launch.threadgroup_memory_bytes == metal.threadgroup_bytes(128, 8, 7)
    assert vl[0].kind == mv.QUANT_KERNEL
    assert vl[0].kernel.last_source == emu.mlx_compiled_source(vl[0].kernel_kwargs, vl[0].call)
    assert not vl[0].kernel.last_launch.over_register_budget
    assert vl[0].kernel.last_launch.threadgroup_memory_bytes == mv.threadgroup_bytes(
        mv.plan(128, 8, 7, 2, mma=False), 2
    )  # a quantized cache keeps the lanes-per-row kernel


def test_tiny_pools_are_padded_to_device_buffers(emulated):
    """A pool whose scales hold under 8 elements (MLX would pass them in the constant address
    space, which the views cannot take) gets spare zero blocks; the result is unchanged."""
    c = dict(dtype="float16", head_dim=64, group=2, block_size=2, bits=8, kv_group=64)
    rng = np.random.default_rng(8)
    k, v = quantized_pools(rng, 2, 1, 2, 64, "float16", 8, 64)
    assert k.scales.size < 8
    q = mx.array(rng.standard_normal((1, 2, 64)), dtype=mx.float16)
    bt, cl = mx.array([[1, 0]], dtype=mx.int32), mx.array([3], dtype=mx.int32)
    out, (launch,) = metal.run_with_launches(q, k, v, bt, cl, scale=0.125, partition_tokens=0)
    assert min(x.size for x in launch.call["inputs"][1:7]) >= 8
    assert mismatch(out, decode_reference(q, k, v, bt, cl, 0.125), c["dtype"]) <= 1.0


def run_engine(loaded, impl, bits):
    from mlxpaged import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        loaded, EngineConfig.of(block_size=16, num_blocks=64, attention_impl=impl, kv_bits=bits, kv_group_size=32)
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for p in ["The KV cache stores", "Paged attention borrows an idea from operating systems:"]:
        engine.add_request(p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return {k: [c.token_ids for c in o.outputs] for k, o in done.items()}


@pytest.mark.parametrize("bits", [8, 4])
def test_engine_decodes_through_the_quantized_kernels(tiny_loaded, monkeypatch, bits):
    """The tiny model with a quantized cache: the engine's start-up check and the varlen
    kernel's first-use check pass a QuantizedPool, prefill and decode run the quantized kernels
    (emulated; a failed check would raise), and greedy tokens equal the reference path's over the same cache."""
    want = run_engine(tiny_loaded, "reference", bits)
    monkeypatch.setenv("MLXPAGED_METAL", "emulate")
    metal.reset_kernels()
    mv._kernel.cache_clear()
    ran = []
    real_run = metal.Launch.run
    monkeypatch.setattr(metal.Launch, "run", lambda self: ran.append(self.kind) or real_run(self))
    real_varlen = mv.Launch.run
    monkeypatch.setattr(mv.Launch, "run", lambda self: ran.append(self.kind) or real_varlen(self))
    try:
        with emu.emulate():
            got = run_engine(tiny_loaded, "metal", bits)
        # Checked once each: the decode family at start-up, the varlen one at the first prefill.
        assert [(key[0] == "varlen", key[-1]) for key in metal._families] == [(False, (bits, 32)), (True, (bits, 32))]
        assert all(metal._families.values())
    finally:
        metal.reset_kernels()
        mv._kernel.cache_clear()
    assert {"paged_attention_quant", mv.QUANT_KERNEL} <= set(ran), set(ran)
    assert got == want
