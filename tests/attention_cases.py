"""Attention test cases shared by the reference, quantized-cache and kernel tests: random paged
pools with scattered block tables, and SDPA over the same keys gathered contiguously (the reference)."""

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mlxpaged.worker.kv_calibration import calibration_ids


def make_case(rng, head_dim, group, block_size, context_lens, num_kv_heads=2, scattered=True, dtype=mx.float32):
    num_seqs = len(context_lens)
    max_blocks = max(-(-c // block_size) for c in context_lens)
    num_blocks = num_seqs * max_blocks + 3
    ids = rng.permutation(num_blocks) if scattered else np.arange(num_blocks)
    tables = ids[: num_seqs * max_blocks].reshape(num_seqs, max_blocks).astype(np.int32)
    k_cache = rng.normal(size=(num_blocks, num_kv_heads, block_size, head_dim)).astype(np.float32)
    v_cache = rng.normal(size=(num_blocks, num_kv_heads, block_size, head_dim)).astype(np.float32)
    q = rng.normal(size=(num_seqs, num_kv_heads * group, head_dim)).astype(np.float32)
    return (
        mx.array(q, dtype=dtype),
        mx.array(k_cache, dtype=dtype),
        mx.array(v_cache, dtype=dtype),
        mx.array(tables),
        mx.array(np.array(context_lens, dtype=np.int32)),
    )


def sdpa_contiguous(q, k_cache, v_cache, tables, context_lens, scale):
    """Each sequence's keys laid out contiguously (numpy gather), then MLX's fused SDPA."""
    outs = []
    kc, vc, tb = np.array(k_cache), np.array(v_cache), np.array(tables)
    bs = kc.shape[2]
    for i, n in enumerate(np.array(context_lens).tolist()):
        rows = [(tb[i][p // bs], p % bs) for p in range(n)]
        k = np.stack([kc[b, :, o] for b, o in rows], axis=1)  # [kvh, n, d]
        v = np.stack([vc[b, :, o] for b, o in rows], axis=1)
        o = mx.fast.scaled_dot_product_attention(q[i][None, :, None], mx.array(k)[None], mx.array(v)[None], scale=scale)
        outs.append(o[0, :, 0])
    return mx.stack(outs)


def make_varlen_case(rng, head_dim, group, block_size, q_lens, prefixes, num_kv_heads=2):
    ctx = [q + p for q, p in zip(q_lens, prefixes)]
    max_blocks = max(-(-c // block_size) for c in ctx)
    num_blocks = len(ctx) * max_blocks + 3
    tables = rng.permutation(num_blocks)[: len(ctx) * max_blocks].reshape(len(ctx), max_blocks).astype(np.int32)
    kc = rng.normal(size=(num_blocks, num_kv_heads, block_size, head_dim)).astype(np.float32)
    vc = rng.normal(size=(num_blocks, num_kv_heads, block_size, head_dim)).astype(np.float32)
    q = rng.normal(size=(sum(q_lens), num_kv_heads * group, head_dim)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return q, kc, vc, tables, cu, np.array(ctx, dtype=np.int32)


def sdpa_with_mask(q, kc, vc, tables, cu, ctx, scale):
    """Numpy gathers each sequence's keys contiguously; SDPA with an explicit causal-plus-prefix mask."""
    bs = kc.shape[2]
    outs = []
    for s in range(len(ctx)):
        n, c = cu[s + 1] - cu[s], ctx[s]
        rows = [(tables[s][p // bs], p % bs) for p in range(c)]
        k = np.stack([kc[b, :, o] for b, o in rows], axis=1)[None]  # [1, kvh, c, d]
        v = np.stack([vc[b, :, o] for b, o in rows], axis=1)[None]
        qs = q[cu[s] : cu[s + 1]].transpose(1, 0, 2)[None]  # [1, H, n, d]
        mask = np.arange(c - n, c)[:, None] >= np.arange(c)[None, :]
        o = mx.fast.scaled_dot_product_attention(
            mx.array(qs), mx.array(k), mx.array(v), scale=scale, mask=mx.array(mask)
        )
        outs.append(np.array(o[0]).transpose(1, 0, 2))
    return np.concatenate(outs)


CASES = [  # (q_lens, cached prefixes): ragged lengths, decodes mixed with chunks, in any order
    ([1, 7, 16, 100, 513], [0, 1, 15, 16, 1000]),
    ([1, 1, 1], [5, 0, 40]),
    ([7, 1, 16, 1], [1000, 3, 0, 15]),
    ([100], [0]),
]


def rounded_caches(model, tokenizer, bits, gs):
    """One `RoundedKVCache` per layer, with numpy offsets and the calibration text's scales."""
    ids = calibration_ids(tokenizer, model.args.vocab_size)
    return [RoundedKVCache(c, s, bits, gs) for c, s in zip(numpy_key_offsets(model), numpy_key_scales(model, ids))]


def numpy_key_offsets(model, num_positions=4096):
    """Each layer's k_proj bias rotated by RoPE (Qwen2: pairs (j, j + d/2), angle pos * base^(-2j/d)),
    averaged over positions 0..num_positions-1, in numpy."""
    args = model.args
    d = args.hidden_size // args.num_attention_heads
    theta = args.rope_theta ** (-np.arange(0, d, 2) / d)
    rot = np.exp(1j * np.outer(np.arange(num_positions), theta)).mean(0)  # [d/2]
    out = []
    for layer in model.model.layers:
        b = np.array(layer.self_attn.k_proj.bias, dtype=np.float64).reshape(-1, d)
        z = (b[:, : d // 2] + 1j * b[:, d // 2 :]) * rot
        out.append(np.concatenate([z.real, z.imag], axis=-1))
    return out


def numpy_key_scales(model, ids):
    """Each layer's per-channel key spread over `ids`, from mlx-lm's own forward pass into its
    contiguous KVCache (numpy float64): std per (KV head, channel), floored at 1e-3 of the
    head's widest, over its geometric mean."""
    cache = [KVCache() for _ in model.model.layers]
    mx.eval(model(mx.array([ids]), cache=cache))
    out = []
    for c in cache:
        std = np.array(c.keys[0, :, : len(ids)].astype(mx.float32), dtype=np.float64).std(axis=1)  # [kvh, d]
        std = np.maximum(std, 1e-3 * std.max(axis=-1, keepdims=True) + 1e-12)
        out.append(std / np.exp(np.log(std).mean(axis=-1, keepdims=True)))
    return out


class RoundedKVCache(KVCache):
    """mlx-lm's contiguous cache holding K/V exactly as rounded by a quantized paged cache:
    keys `s * dequantize(quantize((k - c) / s))` (per KV head offsets c, per-channel scales s)
    and values `dequantize(quantize(v))`; attention is then mlx-lm's own, on float rows."""

    def __init__(self, offset, scale, bits, group_size):
        super().__init__()
        # Not `offset`/`bits`: KVCache.offset is the position counter RoPE reads, and mlx-lm takes a
        # cache with `bits` for a quantized one.
        self.key_offset = mx.array(offset.astype(np.float32))[None, :, None, :]
        self.key_scale = mx.array(scale.astype(np.float32))[None, :, None, :]
        self.round_bits, self.round_group_size = bits, group_size

    def _round(self, x):
        gs, bits = self.round_group_size, self.round_bits
        return mx.dequantize(*mx.quantize(x, group_size=gs, bits=bits), group_size=gs, bits=bits)

    def update_and_fetch(self, keys, values):
        keys = self.key_scale * self._round((keys - self.key_offset) / self.key_scale)
        return super().update_and_fetch(keys, self._round(values))
