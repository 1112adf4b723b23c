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


def decode_in_turns(loaded, prompts: list[list[int]], num_tokens: int, num_blocks: int = 256, block_size: int = 16):
    """Greedy-decode several prompts in one pool, one token each in turn (A, B, A, B, ...).

    Drives the allocator and the model runner directly, so consecutive blocks go to different
    sequences. Returns the sequences (generated ids in `output_token_ids`, tables in `block_ids`).
    """
    from mlxpaged.block_manager import BlockManager
    from mlxpaged.kv_cache import CacheShape, PagedKVCache
    from mlxpaged.model_runner import ModelRunner
    from mlxpaged.sequence import Sequence

    args = loaded.model.args
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    shape = CacheShape(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, loaded.dtype)
    runner = ModelRunner(loaded.model, PagedKVCache(shape, num_blocks, block_size), "reference")
    seqs = [Sequence(i, list(p), len(p)) for i, p in enumerate(prompts)]
    for s in seqs:
        assert bm.reserve(s, s.num_tokens) == []
        logits = runner.prefill(s, s.num_tokens)
        s.num_computed_tokens = s.num_tokens
        s.token_ids.append(int(mx.argmax(logits).item()))
    for _ in range(num_tokens - 1):
        for s in seqs:
            assert bm.reserve(s, 1) == []
            logits = runner.decode([s])
            s.num_computed_tokens += 1
            s.token_ids.append(int(mx.argmax(logits[0]).item()))
    bm.check(seqs)
    return seqs


def tables_interleave(seqs) -> bool:
    """No block is shared, and neither sequence's blocks form one run that the other's avoid."""
    a, b = (set(s.block_ids) for s in seqs[:2])
    return not a & b and max(a) > min(b) and max(b) > min(a)
