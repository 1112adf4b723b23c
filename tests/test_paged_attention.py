"""`paged_attention(impl="reference")` against `mx.fast.scaled_dot_product_attention` on contiguous K/V."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from mlxpaged import paged_attention

from attention_cases import make_case, sdpa_contiguous


@pytest.mark.parametrize("head_dim,group,block_size", list(itertools.product([64, 128], [1, 2, 6, 7], [1, 16, 256])))
def test_reference_matches_sdpa(head_dim, group, block_size):
    rng = np.random.default_rng(head_dim * 100 + group * 10 + block_size)
    lens = [1, block_size, 2 * block_size, 3 * block_size + 5, 37]
    if block_size == 256:
        lens = [1, 256, 300, 37]
    for scattered in (True, False):
        q, k, v, t, c = make_case(rng, head_dim, group, block_size, lens, scattered=scattered)
        scale = head_dim**-0.5
        got = paged_attention(q, k, v, t, c, impl="reference")
        want = sdpa_contiguous(q, k, v, t, c, scale)
        assert got.shape == q.shape
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)


def test_scale_argument_and_ignored_table_tail():
    rng = np.random.default_rng(1)
    q, k, v, t, c = make_case(rng, 64, 2, 16, [20, 5])
    got = paged_attention(q, k, v, t, c, scale=0.3, impl="reference")
    want = sdpa_contiguous(q, k, v, t, c, 0.3)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)
    # Entries of the table past a sequence's last block must not matter.
    t2 = np.array(t)
    t2[1, 1:] = 0
    got2 = paged_attention(q, k, v, mx.array(t2), c, scale=0.3, impl="reference")
    np.testing.assert_allclose(np.array(got2), np.array(got), atol=1e-6)


def test_bad_shapes_and_impl():
    rng = np.random.default_rng(2)
    q, k, v, t, c = make_case(rng, 64, 2, 16, [20])
    with pytest.raises(ValueError):
        paged_attention(q[:, :3], k, v, t, c)  # 3 heads over 2 kv heads
    with pytest.raises(ValueError):
        paged_attention(q, k, v, t, c, impl="cuda")
