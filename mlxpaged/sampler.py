"""Token sampling with one random stream per sequence.

Each sequence owns an MLX PRNG key; every draw splits it, so a sample's tokens depend only
on its own seed and logits, never on what else shares the batch. The logit filters are
mlx-lm's (`apply_top_k`, `apply_top_p`).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from .sampling_params import SamplingParams


def seed_key(seed: int) -> mx.array:
    return mx.random.key(seed)


def sample_token(logits: mx.array, params: SamplingParams, key: mx.array | None) -> tuple[mx.array, mx.array | None]:
    """Draw one token from `logits [V]`; returns (token as a 0-d array, the advanced key)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1), key
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    if params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    key, sub = mx.random.split(key)
    return mx.random.categorical(logprobs * (1.0 / params.temperature), key=sub), key


def sample_batch(logits: mx.array, params: list[SamplingParams], keys: list[mx.array | None]):
    """Sample row `i` of `logits [B, V]` with `params[i]` and `keys[i]`.

    Returns (tokens as a Python list, the advanced keys). Greedy rows share one argmax.
    """
    greedy = mx.argmax(logits, axis=-1)
    out, new_keys = [], []
    for i, (p, k) in enumerate(zip(params, keys)):
        if p.greedy:
            out.append(greedy[i])
            new_keys.append(k)
        else:
            tok, k = sample_token(logits[i], p, k)
            out.append(tok)
            new_keys.append(k)
    toks = mx.stack(out) if out else greedy
    mx.eval(toks, *[k for k in new_keys if k is not None])
    return toks.tolist(), new_keys
