"""Per-channel key scales for a quantized KV cache, measured once on a short built-in text.

Why: after RoPE, a key's channels differ wildly in spread (Qwen2.5-0.5B layer 0: standard
deviations from 0.08 to 38 across one head's 64 channels), so one scale per row group of 32 or
64 channels spends 4-bit levels on the widest channels and rounds the narrow ones to nothing.
Dividing channel c of every key by `s[c]` and multiplying channel c of every query by the same
`s[c]` leaves each score `q . k` exactly as it was, but evens out what gets quantized. `s` is
each channel's standard deviation over the keys of `data/kv_calibration.txt` (prose, code, a
table and a little German and Chinese, written for this), normalized to geometric mean 1 per
head. `python scripts/kv_quality.py --no-key-scales` measures the cache without them.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..attention.metadata import AttentionMetadata
from ..models.cache_spec import CacheSpec

CALIBRATION_TEXT = Path(__file__).resolve().parent.parent / "data" / "kv_calibration.txt"
MIN_RELATIVE_STD = 1e-3  # a channel that never moves keeps a floor: its keys stay finite after dividing


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    """The calibration text's token ids (those inside the model's vocabulary)."""
    return [t for t in tokenizer.encode(CALIBRATION_TEXT.read_text()) if 0 <= t < vocab_size]


def model_key_scales(loaded) -> list[mx.array]:
    """`key_scales` of a `LoadedModel` on the calibration text, measured on first use and kept
    on it: every later quantized engine (or perplexity run) on the same weights reuses them."""
    if loaded.key_scales is None:
        ids = calibration_ids(loaded.tokenizer, loaded.model.args.vocab_size)
        loaded.key_scales = key_scales(loaded.model, loaded.cache_spec, ids)
    return loaded.key_scales


def key_scales(model, spec: CacheSpec, ids: list[int], block_size: int = 16) -> list[mx.array]:
    """Per layer, `[num_kv_heads, head_dim]` float32: each key channel's spread over `ids`.

    Runs `ids` through `model` (its layers' cache as `spec` declares it) once on a small float
    paged cache (every rank of a tensor-parallel model takes part, each measuring its own KV
    heads) and reads the keys back from the pools, so they are exactly the post-RoPE keys
    attention sees.
    """
    from .kv_cache import CacheShape, PagedKVCache, slot_mapping

    if len(ids) < 2:
        raise ValueError(f"key_scales needs at least 2 calibration tokens, got {len(ids)}")
    dims = spec.pool_dims
    if not dims:  # no attention layer (mamba, rwkv7): no keys to scale
        return []
    shape = CacheShape(len(dims), *dims[0], mx.float32, layer_dims=tuple(dims))
    n = len(ids)
    num_blocks = -(-n // block_size)
    cache = PagedKVCache(shape, num_blocks, block_size, spec=spec)
    table = np.arange(num_blocks, dtype=np.int32)
    positions = np.arange(n, dtype=np.int32)
    meta = AttentionMetadata(
        slot_mapping=mx.array(slot_mapping(table, positions, block_size)),
        positions=mx.array(positions),
        block_tables=mx.array(table[None]),
        cu_seqlens_q=mx.array([0, n], dtype=mx.int32),
        context_lens=mx.array([n], dtype=mx.int32),
        logits_indices=mx.array([n - 1], dtype=mx.int32),
        impl="reference",
    )
    mx.eval(model(mx.array(ids, dtype=mx.int32), cache, meta), cache.arrays)
    scales = []
    for pool in cache.keys:  # [num_blocks, kvh, bs, d] -> the n written rows [n, kvh, d]
        keys = pool.transpose(0, 2, 1, 3).reshape(num_blocks * block_size, pool.shape[1], pool.shape[3])[:n]
        std = mx.sqrt(mx.var(keys, axis=0))
        std = mx.maximum(std, MIN_RELATIVE_STD * std.max(axis=-1, keepdims=True) + 1e-12)
        scales.append(std / mx.exp(mx.log(std).mean(axis=-1, keepdims=True)))
    mx.eval(scales)
    return scales
