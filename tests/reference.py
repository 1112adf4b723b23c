"""Independent references: mlx-lm's own Qwen2 on its contiguous KVCache."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxpaged.sampler import sample_token, seed_key
from mlxpaged.sampling_params import SamplingParams


def contiguous_generate(model, prompt_ids: list[int], max_tokens: int, params: SamplingParams | None = None,
                        seed: int = 0) -> list[int]:
    """Generate with mlx-lm's model and contiguous cache, drawing from the stream `seed`."""
    params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens)
    cache = make_prompt_cache(model)
    key = None if params.greedy else seed_key(seed)
    x = mx.array([prompt_ids])
    out = []
    for _ in range(max_tokens):
        logits = model(x, cache=cache)[0, -1]
        tok, key = sample_token(logits, params, key)
        out.append(int(tok.item()))
        x = mx.array([[out[-1]]])
    return out
