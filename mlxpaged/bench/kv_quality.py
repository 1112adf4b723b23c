"""What a quantized KV cache costs in quality, and what it buys in tokens per byte.

`paged_perplexity` runs a text through the model on the paged cache chunk by chunk, exactly as
prefill chunks run in the engine (write the chunk's K/V into the pools, then attend over every
cached row through the block table), but asks for the logits at every position so each
next-token log-likelihood is scored. With `chunk` small, nearly every token attends to K/V that
were quantized by an earlier chunk, so the cache's bits show up in the score.

`tokens_per_gb` reads the cache's own byte accounting (`CacheShape.bytes_per_block`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..attention.metadata import AttentionMetadata
from ..utils import cdiv
from ..worker.kv_cache import CacheShape, PagedKVCache, slot_mapping
from ..worker.kv_calibration import model_key_scales

SNIPPET = Path(__file__).resolve().parents[2] / "tests" / "data" / "perplexity_snippet.py"


def alpaca_text(num_records: int = 12) -> str:
    """The first `num_records` Alpaca records as plain text: instruction, input, response."""
    from .datasets import alpaca_records

    records = alpaca_records()[:num_records]
    return "\n\n".join(
        f"Instruction: {r['instruction']}\n"
        + (f"Input: {r['input']}\n" if r["input"] else "")
        + f"Response: {r['output']}"
        for r in records
    )


def paged_perplexity(
    loaded,
    ids: list[int],
    *,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    chunk: int = 16,
    block_size: int = 16,
    impl: str = "reference",
    seed: int = 0,
    calibrate: bool = True,
) -> float:
    """Perplexity of `ids` (next-token, positions 1..n-1) on a paged cache of `kv_bits`
    (with per-channel key scales from the calibration text unless `calibrate` is False).

    The sequence's blocks are a random permutation of the pool, so tables really page.
    """
    shape = CacheShape.of(loaded).quantized(kv_bits, kv_group_size)
    num_blocks = cdiv(len(ids), block_size)
    scales = model_key_scales(loaded) if calibrate and kv_bits is not None else None
    cache = PagedKVCache.for_model(  # as the engine builds it
        loaded.model, loaded.cache_spec, shape, num_blocks, block_size, scales
    )
    table = np.random.default_rng(seed).permutation(num_blocks).astype(np.int32)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):
        toks = ids[start : min(start + chunk, len(ids) - 1)]  # the last token is only a target
        n = len(toks)
        positions = np.arange(start, start + n, dtype=np.int32)
        meta = AttentionMetadata(
            slot_mapping=mx.array(slot_mapping(table, positions, block_size)),
            positions=mx.array(positions),
            block_tables=mx.array(table[None]),
            cu_seqlens_q=mx.array([0, n], dtype=mx.int32),
            context_lens=mx.array([start + n], dtype=mx.int32),
            logits_indices=mx.arange(n, dtype=mx.int32),  # every position, not only the last
            impl=impl,
        )
        logits = loaded.model(mx.array(toks, dtype=mx.int32), cache, meta).astype(mx.float32)
        targets = mx.array(ids[start + 1 : start + n + 1])
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chunk_nll = -mx.take_along_axis(logp, targets[:, None], axis=-1).sum()
        mx.eval(chunk_nll, cache.arrays)
        nll += chunk_nll.item()
        count += n
    return math.exp(nll / count)


def tokens_per_gb(
    shape: CacheShape, kv_bits: int | None, kv_group_size: int = 64, block_size: int = 16, dtype: mx.Dtype | None = None
) -> float:
    """Tokens (K and V of every layer) one GB (1e9 bytes) of pool holds, by the cache's accounting."""
    s = replace(shape, dtype=dtype or shape.dtype).quantized(kv_bits, kv_group_size)
    return 1e9 * block_size / s.bytes_per_block(block_size)
