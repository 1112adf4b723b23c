"""The split path's merge pass (`paged_attention_merge`), run alone in the MSL emulator on random
partials against a numpy log-sum-exp combine: its simdgroups each fold a subset of the
partitions, then combine across simdgroups, in fp32, under every lane order.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxpaged.metal_emu as emu  # noqa: E402  (the project's own emulator: never skipped)
from mlxpaged.attention import metal

ORDERS = ("forward", "reverse", "random:5")
FINITE_MIN = -np.finfo(np.float32).max


def partials(rng, seqs: int, heads: int, parts: int, head_dim: int, empty: float):
    """Random unnormalised partial outputs with their (log2-domain) maxes and sums; a fraction
    `empty` of the partitions is past its sequence's end (output 0, max -FLT_MAX, sum 0), as
    the partitioned kernel writes them. Sequence 0 keeps at least one real partition."""
    out = rng.standard_normal((seqs, heads, parts, head_dim)).astype(np.float32)
    pmax = (4 * rng.standard_normal((seqs, heads, parts))).astype(np.float32)
    psum = rng.uniform(1.0, 50.0, (seqs, heads, parts)).astype(np.float32)
    gone = rng.random((seqs, heads, parts)) < empty
    gone[0, :, 0] = False
    out[gone], pmax[gone], psum[gone] = 0.0, FINITE_MIN, 0.0
    return out, pmax, psum


def reference(out, pmax, psum):
    """sum_p 2^(max_p - M) out_p / sum_p 2^(max_p - M) sum_p, in float64; 0 where all are empty."""
    m = pmax.astype(np.float64).max(axis=-1, keepdims=True)
    w = np.where(psum > 0, np.exp2(pmax - m), 0.0)
    total = (w * psum).sum(-1)
    num = (w[..., None] * out).sum(-2)
    return np.where(total[..., None] > 0, num / np.where(total > 0, total, 1)[..., None], 0.0)


@pytest.mark.parametrize(
    "parts,head_dim,empty", [(1, 64, 0.0), (5, 128, 0.3), (37, 64, 0.5), (128, 256, 0.2), (300, 64, 0.1)]
)
def test_merge_matches_log_sum_exp(monkeypatch, parts, head_dim, empty):
    """1 partition (one simdgroup busy), a few, 37 (uneven over 4 simdgroups), 128 (one per
    lane) and 300 (each simdgroup folds several rounds of 32 online), with empty partitions."""
    monkeypatch.setenv("MLXPAGED_METAL", "emulate")
    rng = np.random.default_rng(parts)
    arrays = partials(rng, 2, 3, parts, head_dim, empty)
    want = reference(*arrays)
    with emu.emulate():
        for order in ORDERS:
            monkeypatch.setenv("MLXPAGED_EMU_ORDER", order)
            launch = metal.merge_launch(*(mx.array(a) for a in arrays), mx.float32)
            got = np.array(launch.run()[0])
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=order)
            stats = metal.last_launch_stats(launch)
            # each partition's max and sum read once; outputs of empty partitions never read
            live = int((arrays[2] > 0).sum())
            assert stats.bytes_read["part_max"] == stats.bytes_read["part_sum"] == 4 * arrays[1].size
            assert stats.bytes_read["part_out"] == 4 * head_dim * live
            assert stats.threadgroup_memory_bytes > 0 and stats.barriers_with_exited_threads == 0
    metal.reset_kernels()


MERGE_MUTANTS = [  # (description, exact text of the merge body, replacement)
    (
        "no online rescale across rounds",
        "    acc[i] *= corr;\n  }\n  m = m_new;",
        "    acc[i] *= 1.0f;\n  }\n  m = m_new;",
    ),
    ("sum of one lane's partition only", "l += simd_sum(w * ps);", "l += w * ps;"),
    ("simdgroups combined without rescale", "x += f * tg_acc[s * HD + d];", "x += tg_acc[s * HD + d];"),
    ("partitions strided by one simdgroup", "const int p = p0 + (int)lane * NSG;", "const int p = p0 + (int)lane;"),
]


@pytest.mark.parametrize("mutant", MERGE_MUTANTS, ids=[m[0] for m in MERGE_MUTANTS])
def test_merge_mutants_are_caught(monkeypatch, mutant):
    _, old, new = mutant
    header, bodies = metal.kernel_sources()
    assert bodies["paged_attention_merge"].count(old) == 1, old
    mutated = dict(bodies, paged_attention_merge=bodies["paged_attention_merge"].replace(old, new))
    monkeypatch.setattr(metal, "kernel_sources", lambda: (header, mutated))
    monkeypatch.setenv("MLXPAGED_METAL", "emulate")
    metal.reset_kernels()
    arrays = partials(np.random.default_rng(3), 2, 3, 300, 64, 0.1)
    try:
        with emu.emulate():
            try:
                got = np.array(metal.merge_launch(*(mx.array(a) for a in arrays), mx.float32).run()[0])
            except emu.MetalEmuError:  # e.g. an out-of-bounds read: caught too
                return
    finally:
        metal.reset_kernels()
    assert not np.allclose(got, reference(*arrays), rtol=2e-5, atol=2e-6)
