"""`paged_attention` (decode) and `paged_attention_varlen` (any number of new tokens per
sequence) over a paged KV cache, with interchangeable implementations.

`impl="reference"` is pure MLX ops (any backend); `impl="metal"` is our Metal kernel
(`metal/paged_attention.metal`), run on an Apple GPU or, with `MLXPAGED_METAL=emulate`,
on the CPU by the MSL emulator; `impl="auto"` takes the kernel when it can run natively.
Both take float pools (`mx.array`) or quantized ones (`kv_quant.QuantizedPool`, rows
quantized along head_dim) for k_cache and v_cache, the same kind for both.
A sliding `window` or per-head attention `sinks` run on the Metal kernels, decode (single pass
and split) and varlen (lanes-per-row, simdgroup_matrix and quantized), float and quantized
pools: `window` a runtime scalar read under `HAS_WINDOW` (names end `_w`), `sinks` the
`HAS_SINKS` variants (`_sk`). A varlen call whose sequences all have one new token runs the
decode kernels; one with multi-token chunks the varlen kernel (its one-token sequences the
decode kernels), checked on first use per shape family and flags; a kernel that fails falls
back to the reference. A `chunk` (Llama 4's
chunked local attention) takes the reference: no kernel has it.
The quantized rows' format is `kv_quant.py`, which the worker's writers share.
May import: `metal_emu` (the kernels' emulator, on Linux).
"""

from __future__ import annotations

import math

import mlx.core as mx

from .kv_quant import QuantizedPool
from .reference import paged_attention_reference, paged_attention_varlen_reference

IMPLS = ("auto", "reference", "metal")


def metal_native() -> bool:
    """True when the Metal kernel can run on a real GPU (an Apple Silicon Mac)."""
    try:
        return bool(mx.metal.is_available())
    except Exception:
        return False


def resolve_impl(impl: str, q: mx.array | None = None, k_cache: mx.array | None = None) -> str:
    """Map "auto" to the fastest implementation this machine can run for these shapes."""
    if impl not in IMPLS:
        raise ValueError(f"unknown paged-attention impl {impl!r}; expected one of {IMPLS}")
    if impl == "auto":
        if not metal_native():
            return "reference"
        from .metal import supports

        return "metal" if q is None or supports(q, k_cache) else "reference"
    return impl


def paged_attention(
    q: mx.array,
    k_cache: mx.array,
    v_cache: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float | None = None,
    impl: str = "auto",
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attend one query per sequence to its cached keys and values.

    q: `[num_seqs, num_heads, head_dim]`; k_cache, v_cache:
    `[num_blocks, num_kv_heads, block_size, head_dim]` (float, or `QuantizedPool`s of that
    logical shape); block_tables:
    `[num_seqs, max_blocks]` int32 (entries past a sequence's last block are ignored);
    context_lens: `[num_seqs]` int32, each >= 1. Returns `[num_seqs, num_heads, head_dim]`
    in q's dtype. `scale` defaults to `head_dim ** -0.5`. `window`: each query sees only the
    last `window` positions (its own included); `sinks`: `[num_heads]` logits added to each
    head's softmax denominator (gpt-oss's attention sinks).
    """
    scale = _check_shapes("paged_attention", q, k_cache, v_cache, scale)
    _check_window_sinks("paged_attention", q, window, sinks)
    impl = resolve_impl(impl, q, k_cache)
    if impl == "metal":
        from .metal import failed_kernel, kernel_failed, paged_attention_metal

        try:
            return paged_attention_metal(
                q, k_cache, v_cache, block_tables, context_lens, scale=scale, window=window, sinks=sinks
            )
        except Exception as e:  # any error a build or launch raised (MLX's are RuntimeError or
            # ValueError) that the start-up check did not cover; bad input is raised as it is
            if failed_kernel(e) is None or not kernel_failed(q.shape[1] // k_cache.shape[1], k_cache, e):
                raise
    return paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale, None, window, sinks)


def _decodes_only(cu_seqlens_q: mx.array) -> bool:
    """Every sequence has exactly one new token (the model runner builds cu_seqlens_q from
    numpy, as the reference's `tolist()` relies on: no device sync)."""
    cu = cu_seqlens_q.tolist()
    return all(b - a == 1 for a, b in zip(cu, cu[1:]))


def _check_window_sinks(name: str, q: mx.array, window, sinks) -> None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{name}: window must be a positive int or None, got {window!r}")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"{name}: sinks {tuple(sinks.shape)} must be one logit per query head ({q.shape[1]},)")


def _check_shapes(name: str, q: mx.array, k_cache, v_cache, scale: float | None) -> float:
    kinds = {isinstance(c, QuantizedPool) for c in (k_cache, v_cache)}
    if len(kinds) != 1:
        raise ValueError(f"{name}: k_cache and v_cache must both be float pools or both QuantizedPools")
    if kinds == {True} and (k_cache.bits, k_cache.group_size) != (v_cache.bits, v_cache.group_size):
        raise ValueError(
            f"{name}: k_cache ({k_cache.bits}-bit, group {k_cache.group_size}) and v_cache "
            f"({v_cache.bits}-bit, group {v_cache.group_size}) are quantized differently"
        )
    if q.ndim != 3 or len(k_cache.shape) != 4 or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"{name}: bad shapes q={q.shape} k_cache={k_cache.shape} v_cache={v_cache.shape}")
    if q.shape[1] % k_cache.shape[1] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(
            f"{name}: q {q.shape} does not match cache {k_cache.shape} "
            "(num_heads must be a multiple of num_kv_heads, head_dims equal)"
        )
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def paged_attention_varlen(
    q: mx.array,
    k_cache: mx.array,
    v_cache: mx.array,
    block_tables: mx.array,
    cu_seqlens_q: mx.array,
    context_lens: mx.array,
    *,
    scale: float | None = None,
    impl: str = "auto",
    scratch: dict | None = None,
    window: int | None = None,
    sinks: mx.array | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
) -> mx.array:
    """Attend the new tokens of several sequences, packed along one axis, to their caches.

    q: `[T, num_heads, head_dim]`, the new tokens of S sequences concatenated; cu_seqlens_q:
    `[S + 1]` int32 offsets (sequence s owns rows `cu[s]:cu[s + 1]`, `q_len_s` of them);
    block_tables: `[S, max_blocks]` int32; context_lens: `[S]` int32, each sequence's cached
    plus new tokens (the new tokens' keys and values are already in the cache). New token j of
    sequence s sits at position `context_lens[s] - q_len_s + j` and attends to every position
    up to its own. Returns `[T, num_heads, head_dim]` in q's dtype.

    `paged_attention` is the case q_len = 1. With `impl="metal"` the one-token sequences run
    on the Metal decode kernel and longer ones on the varlen kernel (`metal_varlen.py`).
    `scratch`: a dict kept for one forward pass (`AttentionMetadata.scratch`), in which the
    reference keeps the index arrays it derives from the tables, so later layers reuse them.
    `window` and `sinks` as in `paged_attention`, on either kernel.
    `chunk`: chunked local attention (Llama 4): a token at position p sees only the positions
    of its own chunk, `(p // chunk) * chunk .. p`; on the reference path (no kernel has it).
    `softcap`: logit soft-capping (Gemma 2): each score s becomes `softcap * tanh(s / softcap)`
    before the softmax; on the reference path (no kernel has it), without sinks.
    """
    scale = _check_shapes("paged_attention_varlen", q, k_cache, v_cache, scale)
    _check_window_sinks("paged_attention_varlen", q, window, sinks)
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1 or window is not None):
        raise ValueError(f"paged_attention_varlen: chunk must be a positive int without a window, got {chunk!r}")
    num_seqs = block_tables.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,) or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"paged_attention_varlen: cu_seqlens_q {cu_seqlens_q.shape} and context_lens {context_lens.shape} "
            f"do not match {num_seqs} block-table rows"
        )
    if softcap is not None and (not softcap > 0 or sinks is not None):
        raise ValueError(f"paged_attention_varlen: softcap must be positive and without sinks, got {softcap!r}")
    # no kernel takes a chunk or a soft cap
    metal_impl = resolve_impl(impl, q, k_cache) == "metal" and chunk is None and softcap is None
    if (
        metal_impl
        and (window is not None or sinks is not None)
        and q.shape[0] == num_seqs
        and _decodes_only(cu_seqlens_q)
    ):
        # One new token per sequence: a decode step, the decode kernels take the window and
        # the sinks.
        return paged_attention(
            q, k_cache, v_cache, block_tables, context_lens, scale=scale, impl="metal", window=window, sinks=sinks
        )
    if metal_impl:
        # Multi-token sequences on the varlen kernel, one-token ones on the decode kernel; a
        # varlen kernel that failed its first-use check on this machine (that of its window and
        # sinks flags too) leaves it to the reference.
        from .metal import failed_kernel, kernel_failed
        from .metal_varlen import paged_attention_varlen_metal, varlen_usable

        try:
            if varlen_usable(q, k_cache, cu_seqlens_q, window, sinks):
                return paged_attention_varlen_metal(
                    q,
                    k_cache,
                    v_cache,
                    block_tables,
                    cu_seqlens_q,
                    context_lens,
                    scale=scale,
                    window=window,
                    sinks=sinks,
                )
        except Exception as e:  # any error a build or launch raised that the start-up check did
            # not cover: never fail the request; one warning, then this shape takes the reference
            if failed_kernel(e) is None or not kernel_failed(q.shape[1] // k_cache.shape[1], k_cache, e):
                raise
    return paged_attention_varlen_reference(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, scratch, window, sinks, chunk, softcap
    )
