"""Chi-square goodness of fit (closed form, no scipy) and the logits the sampler tests draw from."""

from __future__ import annotations

import math

import numpy as np

# Ten tokens; at temperature 2 vLLM's order keeps 5 of them, filtering before temperature keeps 4.
LOGITS = np.array([2.0, 1.6, 1.3, 1.0, 0.8, 0.5, 0.2, -0.3, -1.0, -2.0], dtype=np.float32)


ALPHA = 1e-3


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of `counts` to the fully specified `probs` (0 where impossible)."""
    counts, probs = counts.ravel(), probs.ravel()
    if counts[probs == 0].any():
        return 0.0  # a draw the distribution forbids
    n, live = counts.sum(), probs > 0
    expected = n * probs[live]
    assert expected.min() >= 5, "too few draws for a chi-square test"
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int(live.sum()) - 1)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df), in closed form (no scipy)."""
    half = x / 2
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for j in range(1, df // 2):
            term *= half / j
            total += term
        return math.exp(-half) * total
    total, term = 0.0, 1.0
    for j in range(1, (df - 1) // 2 + 1):
        total += term
        term *= x / (2 * j + 1)
    return math.erfc(math.sqrt(half)) + math.sqrt(2 * x / math.pi) * math.exp(-half) * total
