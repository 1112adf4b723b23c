"""Run mlx-lm's own model modules (`mlx_lm.models.<family>`) on the paged KV cache.

Every attention layer of the supported families does, in `mlx_lm/models/<family>.py`:

    queries = self.rope(queries, offset=cache.offset)
    keys = self.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)

A step's T packed new tokens enter as T batch rows of length one (ids `[T, 1]`): nothing is
padded, and `cache.offset` can be the per-token positions, as `mx.fast.rope` takes one offset
per batch row. Each layer gets a `PagedLayerCache`, whose `update_and_fetch` writes the new K/V
into the pool through the slot mapping; the family module's `scaled_dot_product_attention`
(replaced once per module by `_paged_sdpa`, which hands any other cache to mlx-lm's function)
then runs `paged_attention_varlen` over the step's `AttentionMetadata`. Only the rows at
`meta.logits_indices` reach the output layer (the final norm gathers them first).

A sliding-window layer (mlx-lm's own `make_prompt_cache` gives it a RotatingKVCache) attends
with that cache's window, and attention sinks passed to the call (gpt-oss) are kept; a chunked
layer (Llama 4: a ChunkedKVCache) attends within its chunk. A wrapper's
text model is found under `Model.model` or `Model.language_model.model`, and the function is
replaced in the module that defines each layer's attention class.

If a future mlx-lm stops making these calls, the first pass raises `AdapterError` naming the
file and function, instead of attending to nothing.
"""

from __future__ import annotations

import importlib
import inspect
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from ..attention import paged_attention_varlen
from ..attention.metadata import AttentionMetadata
from ..attention.reference import gather_blocks
from ..errors import MlxPagedError
from .cache_spec import NO_CACHE, RECURRENT, CacheSpec, LayerSpec
from .recurrent import SegmentedLayer, StepStates
from .rotary import Rotary, is_rotation, table_key

# The families tested in depth (tests/test_families.py) and named by the tensor-parallel
# refusals below. Whether a model runs is not decided by these names but by its structure
# (`_refusal`; every mlx-lm model type is tried in tests/test_zoo.py). The MoE ones route each
# token's MLP through mlx-lm's SwitchGLU experts: rows of one token route as mlx-lm's rows do.
DENSE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "granite", "olmo2", "starcoder2", "llama4_text")
MOE = ("qwen3_moe", "mixtral", "glm4_moe", "phimoe")
# The text model sits inside another module (mistral3: `language_model`) or reuses another
# family's layers (smollm3: llama's, some without RoPE); ministral3 scales queries by position.
WRAPPERS = ("mistral3", "smollm3", "ministral3")
# Families with sliding-window layers, each run with its per-layer window (mlx-lm's own
# `make_prompt_cache` gives those layers a RotatingKVCache of that size); gpt_oss adds per-head
# attention sinks and MoE. The Metal kernels (decode and varlen) take both.
WINDOWED = ("gemma3_text", "gemma3", "gpt_oss", "olmo3")  # gemma3: gemma3_text under `language_model`
# Hybrid families: recurrent layers (an ArraysCache in mlx-lm's `make_prompt_cache`: gated
# DeltaNet, Mamba-2, short convolutions) beside full-attention ones; the recurrent layers run on
# each sequence's own state (recurrent.py), the attention layers on the paged cache.
HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "granitemoehybrid")
# Multi-head latent attention (MLA): one latent row per token, attended in latent space with a
# rope-score term (`LatentLayerCache`); kimi_k2 is deepseek_v3's module (mlx-lm's remapping).
MLA = ("deepseek_v3", "kimi_k2", "glm4_moe_lite")
# Recurrent and state-space types beyond HYBRID (tests/test_zoo.py): without attention, with Mamba-2
# and attention in one layer (falcon_h1), with a state before the layers (longcat_flash_ngram).
STATE = (
    "mamba",
    "falcon_mamba",
    "mamba2",
    "rwkv7",
    "recurrent_gemma",
    "falcon_h1",
    "kimi_linear",
    "kimi_k3",
    "olmo_hybrid",
    "bailing_moe_linear",
    "bailing_hybrid",
    "longcat_flash_ngram",
)
# Chunked local attention (Llama 4 Scout/Maverick): 3 of 4 layers attend only within their chunk of
# `attention_chunk_size` positions (mlx-lm's ChunkedKVCache), the 4th is global attention without
# RoPE and with position-scaled queries; the text model sits under `language_model`; MoE.
CHUNKED = ("llama4",)
# Per-layer KV shapes (Gemma 4): the full layers' K/V rows are wider (`global_head_dim`) and may
# have other KV heads than the sliding ones (`CacheShape.layer_dims`), and the last
# `num_kv_shared_layers` layers attend to an earlier layer's K/V, writing none of their own
# (`SharedLayerCache`); sliding windows as in WINDOWED. gemma4: gemma4_text under `language_model`.
# Gemma 3n: uniform shapes, and its module hands a shared layer the source's cache itself.
PER_LAYER = ("gemma4_text", "gemma4", "gemma3n")
FAMILIES = DENSE + MOE + WRAPPERS + WINDOWED + HYBRID + MLA + CHUNKED + PER_LAYER
_SDPA_PARAMS = ["queries", "keys", "values", "cache", "scale", "mask"]


class AdapterError(MlxPagedError):
    """mlx-lm's model code no longer makes the calls the adapter relies on."""


def family_module(model_type: str):
    """`mlx_lm.models.<module>` for a checkpoint's model_type (mlx-lm's own remapping: mistral -> llama)."""
    from mlx_lm import utils

    name = getattr(utils, "MODEL_REMAPPING", {}).get(model_type, model_type)
    return importlib.import_module(f"mlx_lm.models.{name}")


class PagedLayerCache:
    """What one mlx-lm attention layer sees as its cache during one paged pass.

    `window`: this layer's sliding window (None: full attention), from mlx-lm's own cache for
    the layer (`cache_spec`); the attention call masks by it, so the model's mask is not needed.
    `chunk`: this layer's attention chunk (Llama 4), likewise.
    `tiled_heads`: the module tiles its KV heads (plamo: query head h reads KV head h mod
    kv_heads), where the attention groups them (h // group): the query heads are reordered.
    """

    def __init__(
        self,
        kv_cache,
        layer: int,
        meta: AttentionMetadata,
        window: int | None = None,
        chunk: int | None = None,
        tiled_heads: bool = False,
    ):
        self.kv_cache = kv_cache
        self.layer = layer
        self.meta = meta
        self.window = window
        self.chunk = chunk
        self.tiled_heads = tiled_heads
        self.offset = meta.positions  # [T]: one RoPE offset per batch row, i.e. per token
        self.pools = None  # this layer's (k_pool, v_pool) after the write
        self.v_dim = None  # the width of the values written (narrower than the pool's rows: zero-padded)
        self.fetched = None  # the keys update_and_fetch returned (`reader`)
        self.peers = None  # every cache of the pass, where a layer attends more than once a pass
        self.attended = False

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        # Rows of length one need no mask; causality lives in the block tables and context_lens,
        # the window in `self.window`, which must be the one the model asks for.
        # plamo3 asks a mask one wider than its own RotatingKVCache keeps: mlx-lm's prefill sees one
        # position more there than its decode steps do; the paged layer attends over the cache's window
        if window_size is not None and window_size not in (self.window, (self.window or 0) + 1):
            raise AdapterError(
                f"mlx_lm base.create_attention_mask: a window of {window_size} was asked of layer {self.layer}, "
                f"whose mlx-lm cache has window {self.window}: the paged adapter needs updating"
            )
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys, values `[T, kv_heads, 1, head_dim]` (post-RoPE): written at the step's slots.

        Values narrower than the keys (deepseek_v2, minicpm3: nope + rope key columns, v_head_dim
        value columns) are stored zero-padded to the key width; `attend` drops the padded columns."""
        if keys.ndim != 4 or keys.shape[2] != 1 or keys.shape[0] != self.offset.shape[0]:
            raise AdapterError(
                f"cache.update_and_fetch got keys {keys.shape}; the paged adapter feeds "
                f"[T={self.offset.shape[0]}, kv_heads, 1, head_dim] (rows of one token)"
            )
        T, kvh, _, hd = keys.shape
        pool = self.kv_cache.shape.layer_dims[self.layer]
        vd = values.shape[-1]
        if (kvh, hd) != pool or values.shape[1] != kvh or vd > hd:
            raise AdapterError(
                f"layer {self.layer}'s attention writes keys of {kvh} KV heads x {hd} and values of "
                f"{values.shape[1]} x {vd}, its pool holds {pool[0]} x {pool[1]}: the paged adapter needs updating"
            )
        self.v_dim = vd
        v = values.reshape(T, kvh, vd)
        if vd < hd:
            v = mx.concatenate([v, mx.zeros((T, kvh, hd - vd), v.dtype)], axis=-1)
        self.pools = self.kv_cache.write(self.layer, keys.reshape(T, kvh, hd), v, self.meta.slot_mapping)
        self.fetched = keys
        return keys, values

    def reader(self, keys: mx.array) -> PagedLayerCache:
        """The cache whose pools an attention call with these keys reads: this one, or, where a
        layer attends more than once a pass (iquestloopcoder: its second pass attends to the first
        pass's keys with `cache=` its own second cache), the cache of this pass whose
        `update_and_fetch` returned them."""
        if self.peers is None or keys is self.fetched:
            return self
        return next((c for c in self.peers if c is not None and c.fetched is keys), self)

    def keys_and_values(self):
        """What a layer reading this layer's cache sees (Gemma 3n's KV-shared layers, which then
        attend with `cache=` this cache): the pools, which `attend` reads through the block tables."""
        if self.pools is None:
            raise AdapterError(
                f"layer {self.layer}'s cache was read before it was written: the paged adapter needs updating"
            )
        return self.pools

    def attend(self, queries: mx.array, scale: float, mask, sinks=None, softcap=None) -> mx.array:
        """queries `[T, heads, 1, head_dim]` -> `[T, heads, 1, head_dim]` over the paged pools
        (`softcap`: each score soft-capped, Gemma 2's `_CappedAttention`)."""
        if self.pools is None:
            raise AdapterError("scaled_dot_product_attention was called before cache.update_and_fetch")
        if not (mask is None or isinstance(mask, str)):
            raise AdapterError(
                "scaled_dot_product_attention got an explicit mask; the paged cache supports causal "
                "attention, with a per-layer sliding window and attention sinks"
            )
        T, H, _, D = queries.shape
        q = queries.reshape(T, H, D)
        if self.tiled_heads:  # head r * kvh + j (reads KV head j) to j * group + r, and back
            kvh = self.kv_cache.shape.layer_dims[self.layer][0]
            q = q.reshape(T, H // kvh, kvh, D).swapaxes(1, 2).reshape(T, H, D)
        out = self._paged(q, scale, sinks, softcap)
        if self.tiled_heads:
            out = out.reshape(T, kvh, H // kvh, -1).swapaxes(1, 2).reshape(T, H, -1)
        v = self.v_dim or D
        return (out if v == D else out[..., :v]).reshape(T, H, 1, v)

    def _paged(self, q: mx.array, scale: float, sinks=None, softcap=None) -> mx.array:
        """q `[T, heads, D]` -> `[T, heads, D]`: paged attention over this layer's pools."""
        q = self.kv_cache.scale_queries(self.layer, q)
        m = self.meta
        out = paged_attention_varlen(
            q,
            *self.pools,
            m.block_tables,
            m.cu_seqlens_q,
            m.context_lens,
            scale=scale,
            impl=m.impl,
            scratch=m.scratch,
            window=self.window,
            sinks=sinks,
            chunk=self.chunk,
            softcap=softcap,
        )
        self.attended = True
        return out


class SharedLayerCache(PagedLayerCache):
    """A layer that attends to another layer's K/V and writes none (Gemma 4's last
    `num_kv_shared_layers`). mlx-lm's gemma4_text hands such a layer its source layer's
    `update_and_fetch` result as `shared_kv` and still calls `cache.update_and_fetch` on it when it
    has a cache; here that call stores nothing, and attention reads the source layer's pools
    (and key scales) with this layer's queries and the source's window."""

    def __init__(self, source: PagedLayerCache):
        super().__init__(source.kv_cache, source.layer, source.meta, source.window, source.chunk, source.tiled_heads)
        self.source = source

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return keys, values

    def attend(self, queries: mx.array, scale: float, mask, sinks=None, softcap=None) -> mx.array:
        self.pools = self.source.pools  # None if the source has not written yet: attend raises
        return super().attend(queries, scale, mask, sinks, softcap)


class LatentLayerCache(PagedLayerCache):
    """An MLA layer's cache (deepseek_v3, glm4_moe_lite): one row `[latent, k_pe]` per token, a
    single KV head, `kv_lora_rank + rope_dim` wide, read as both key and value (a keys-only pool).

    mlx-lm's MLA attention, on rows of one token, does (mlx_lm/models/deepseek_v3.py):

        kv_latent, k_pe = cache.update_and_fetch(kv_latent, k_pe)
        pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)
        q_nope = self.embed_q(q_nope); k = v = kv_latent          # latent space
        out = scaled_dot_product_attention(q_nope, k, v, cache=cache, scale=self.scale, mask=pe_scores)

    Its scores are `scale * (q_latent . latent + q_pe . k_pe)`: one dot product of `[q_latent, q_pe]`
    with the K row. So `update_and_fetch` hands back an identity for `k_pe`, which makes the
    model's `pe_scores` its own `q_pe * scale`, and `attend` rebuilds the query from it; the
    output's first `kv_lora_rank` columns are the latent output the model unembeds (the value
    rows' k_pe columns only add output columns that are dropped).
    """

    rope_dim = 0

    def update_and_fetch(self, kv_latent: mx.array, k_pe: mx.array):
        """kv_latent `[T, 1, 1, kv_lora_rank]`, k_pe `[T, 1, 1, rope_dim]` (post-RoPE)."""
        T = self.offset.shape[0]
        if kv_latent.shape[:3] != (T, 1, 1) or k_pe.shape[:3] != (T, 1, 1):
            raise AdapterError(
                f"an MLA layer's cache.update_and_fetch got {kv_latent.shape} and {k_pe.shape}; the paged "
                f"adapter feeds [T={T}, 1, 1, kv_lora_rank] and [T, 1, 1, rope_dim]"
            )
        self.rope_dim = p = k_pe.shape[-1]
        k = mx.concatenate([kv_latent, k_pe], axis=-1).reshape(T, 1, -1)
        # a keys-only pool (kv_cache.CacheShape): the values are these rows, whose last rope_dim
        # output columns attend's slice drops
        self.pools = self.kv_cache.write(self.layer, k, k, self.meta.slot_mapping)
        return kv_latent, mx.eye(p, dtype=k_pe.dtype)[None, None]

    def attend(self, queries: mx.array, scale: float, mask, sinks=None) -> mx.array:
        """queries `[T, heads, 1, kv_lora_rank]` (latent), mask the model's `q_pe * scale` -> latent output."""
        if self.pools is None:
            raise AdapterError("scaled_dot_product_attention was called before cache.update_and_fetch")
        T, H, _, R = queries.shape
        if not isinstance(mask, mx.array) or mask.shape != (T, H, 1, self.rope_dim):
            raise AdapterError(
                f"an MLA layer's attention got mask {getattr(mask, 'shape', mask)}, not its rope scores "
                f"[{T}, {H}, 1, {self.rope_dim}]: the paged adapter needs updating"
            )
        q = mx.concatenate([queries, mask / scale], axis=-1).reshape(T, H, -1)
        return self._paged(q, scale)[..., :R].reshape(T, H, 1, R)


class GatheredLayerCache(PagedLayerCache):
    """One KV cache of a layer whose caches different modules write (DeepSeek sparse attention,
    deepseek_v32 and glm_moe_dsa: the latent rows `[latent, k_pe]` and an indexer's keys), run on
    each token's whole context: `update_and_fetch` writes the new rows into the pool (a keys-only
    one) and hands back, per packed row, its sequence's rows gathered from the pool, `[T, 1, C, d]`
    (C: the step's longest block table, in tokens), and `make_mask` the mask of the positions each
    row may read (its own and earlier ones). mlx-lm's module then does the rest on those as on a
    contiguous cache: the indexer scores the context and picks its top-k rows, the attention takes
    them and calls mlx-lm's own attention (its cache argument is the layer's CacheList, not one of
    these). Exact, not fast: the gathered copy is T x C rows a layer."""

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        m = self.meta
        T, C = self.offset.shape[0], m.block_tables.shape[1] * self.kv_cache.block_size
        return (mx.arange(C)[None] <= self.offset[:, None]).reshape(T, 1, 1, C)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys `[T, 1, 1, a]` and values `[T, 1, 1, b]` (the latent and k_pe), or the keys twice
        (the indexer's): one row `[keys, values]` (or `keys`) a token, handed back gathered."""
        T = self.offset.shape[0]
        if keys.shape[:3] != (T, 1, 1) or values.shape[:3] != (T, 1, 1):
            raise AdapterError(
                f"a sparse-attention layer's cache.update_and_fetch got {keys.shape} and {values.shape}; the paged "
                f"adapter feeds [T={T}, 1, 1, width]"
            )
        row = keys if values is keys else mx.concatenate([keys, values], axis=-1)
        self.pools = self.kv_cache.write(
            self.layer, row.reshape(T, 1, -1), row.reshape(T, 1, -1), self.meta.slot_mapping
        )
        self.attended = True  # mlx-lm's module attends over what it is handed
        ctx = gather_blocks(self.pools[0], self.meta.block_tables)[self._rows()]  # [T, 1, C, width]
        self.keys = ctx  # (the indexer reads and sets these, as on mlx-lm's KVCache)
        if values is keys:
            return ctx, ctx
        a = keys.shape[-1]
        return ctx[..., :a], ctx[..., a:]

    def _rows(self) -> mx.array:
        """Each packed row's sequence (its block table's row), built once a pass."""
        sc = self.meta.scratch
        if "gathered_rows" not in sc:
            cu = self.meta.cu_seqlens_q.tolist()  # host-built (metadata.py): reading it forces nothing
            sc["gathered_rows"] = mx.array([s for s in range(len(cu) - 1) for _ in range(cu[s + 1] - cu[s])])
        return sc["gathered_rows"]


def kv_dims(model: nn.Module) -> tuple[int, int]:
    """(KV heads, head_dim) of `model`'s attention rows: its (local, under tensor parallelism) KV
    heads and head_dim."""
    args = model.args
    return getattr(model, "num_local_kv_heads", args.num_key_value_heads), args.head_dim


def text_body(model: nn.Module) -> nn.Module:
    """The module holding the text model's layers (and, in most families, its final norm):
    `model.model` for most families, `model.language_model.model` for a wrapper such as mistral3,
    `model.transformer` for gpt2-style ones (their layers named `h` or `blocks`)."""
    return _body_at(model)[2]


def _body_at(model: nn.Module) -> tuple[nn.Module, str, nn.Module]:
    """(parent, name, body): the text body (`text_body`) and where its parent holds it. The
    first module down `_BODIES` with a layer list and a final norm module; failing that, the
    first with a layer list (nanochat, talkie: a functional final norm; phixtral: the norm sits
    in its output head)."""
    found, m = [], model
    for _ in range(4):
        name = next((n for n in _BODIES if isinstance(m.get(n), nn.Module)), None)
        if name is None:
            break
        inner = m[name]
        if any(n in inner for n in _LAYER_LISTS):
            if _final_norm(inner) is not None:
                return m, name, inner
            found.append((m, name, inner))
        m = inner
    if found:
        return found[0]
    raise AdapterError(
        f"{inspect.getfile(type(model))}: no text model with a layer list under Model.model, "
        "Model.language_model or Model.transformer: the paged adapter needs updating"
    )


_BODIES = ("language_model", "model", "transformer", "backbone")
_LAYER_LISTS = ("layers", "h", "blocks")
# lfm2 names its final norm embedding_norm; gpt2-style models ln_f, dbrx norm_f, phi final_layernorm,
# afm7 output_norm, recurrent_gemma final_norm
_FINAL_NORMS = (
    "norm",
    "embedding_norm",
    "ln_f",
    "norm_f",
    "final_layernorm",
    "final_layer_norm",
    "output_norm",
    "final_norm",
)


def _final_norm(body: nn.Module) -> str | None:
    """The name of a text model's final norm, or None."""
    return next((n for n in _FINAL_NORMS if isinstance(body.get(n), nn.Module)), None)


def paged_layers(model: nn.Module, spec: CacheSpec | None = None) -> list:
    """The layers whose K/V the paged cache holds (`spec`, default `cache_spec(model)`): every
    layer but the recurrent ones (recurrent.py), whose state is no key/value cache, and those that
    read another layer's. Their position in this list is their pool index."""
    spec = spec or cache_spec(model)
    return [model.layers[i % len(model.layers)] for i in spec.pool_layers]


def cache_spec(model: nn.Module) -> CacheSpec:
    """`model`'s paged cache, declared (cache_spec.py): each layer's kind from the cache mlx-lm's
    own `make_prompt_cache` gives it (a RotatingKVCache: a sliding window of its size; a
    ChunkedKVCache: an attention chunk; an ArraysCache: a recurrent state; a KVCache: full
    attention), its rows' shape from its attention module (an MLA layer: one latent row per token,
    `kv_lora_rank + rope_dim` wide), and the layers that read an earlier layer's K/V. Read off the
    model as it is now (under tensor parallelism, after its layers are split)."""
    from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, RotatingKVCache, make_prompt_cache

    caches = make_prompt_cache(model)
    front = None
    if _front_state(model, caches):  # a state before the layers' caches (n-gram embeddings)
        front, caches = len(caches[0].cache), caches[1:]
    slots = _attention_slots(model, caches)
    passes = len(caches) // len(model.layers) if len(caches) > len(model.layers) else 1
    if passes > 1:  # iquestloopcoder: each layer attends once a pass, each pass with its own cache
        shared, by_model, own = None, False, list(caches)
    elif slots is not None:  # Nemotron-NAS: mlx-lm's caches go to the layers with an attention module
        shared, by_model = None, False
        by_layer = dict(zip(slots, caches))
        own = [by_layer.get(i) if _uses_cache(la) else None for i, la in enumerate(model.layers)]
    else:
        shared, by_model = _shared_layers(model, len(caches))
        own = list(caches)
        if shared is not None and _reads_last_cache(model):  # afm7: its forward hands on cache[-1]'s K/V
            slots = tuple(range(len(caches)))
    kinds, parts = [], []
    for c in own:
        if c is None:
            kinds.append((NO_CACHE, None, None))
            parts.append(())
            continue
        # a CacheList layer (Falcon-H1): a state and a KV cache, each its own group entry
        entries = list(c.caches) if type(c) is CacheList else [c]
        state = next((len(x.cache) for x in entries if isinstance(x, ArraysCache)), None)
        kv = next((x for x in entries if not isinstance(x, ArraysCache)), None)
        parts.append(
            tuple("state" if isinstance(x, ArraysCache) else "kv" for x in entries) if type(c) is CacheList else ()
        )
        if kv is None:
            kinds.append((RECURRENT, None, state))
        elif isinstance(kv, RotatingKVCache):
            kinds.append(("sliding_window", kv.max_size, state))
        elif isinstance(kv, ChunkedKVCache):
            kinds.append(("chunked_local", kv.chunk_size, state))
        else:
            kinds.append(("full", None, state))
    # per pool (layer, its j-th KV cache): a layer with two KV caches has two pools
    pooled = [
        (i, j)
        for i, (k, _, _) in enumerate(kinds)
        if k not in (RECURRENT, NO_CACHE)
        for j in range(max(1, parts[i].count("kv")))
    ]
    n = len(model.layers)
    attns = [
        attention_of(model.layers[i % n]) if parts[i].count("kv") < 2 else attentions_of(model.layers[i])[j]
        for i, j in pooled
    ]
    latent = bool(attns) and _is_latent(attns[0])
    if latent:  # (a sparse-attention indexer beside the latent rows: one key row per token)
        dims = [(1, a.kv_lora_rank + a.qk_rope_head_dim) if _is_latent(a) else (1, a.head_dim) for a in attns]
    else:
        dims = [_kv_shape(a, model.args) for a in attns]
        if len(set(dims)) <= 1 and hasattr(model, "num_local_kv_heads"):  # split by tensor parallelism
            dims = [kv_dims(model)] * len(attns)
        # else Gemma 4's full layers' rows are wider, OpenELM's heads vary: a row shape per layer
    layers = []
    for i, (kind, span, arrays) in enumerate(kinds):
        if kind == RECURRENT:
            layers.append(LayerSpec(kind, state_arrays=arrays))
        elif kind == NO_CACHE:
            layers.append(LayerSpec(kind))
        else:
            p = pooled.index((i, 0))
            more = tuple(dims[p + 1 : p + parts[i].count("kv")])
            writers = {type(attns[q]) for q, (li, _) in enumerate(pooled) if li == i}
            tiled = "mx.tile(keys" in _source(type(attns[p]))  # plamo: query head h reads KV head h mod kv_heads
            layers.append(
                LayerSpec(
                    kind,
                    span,
                    p,
                    *dims[p],
                    state_arrays=arrays,
                    tiled_heads=tiled,
                    parts=parts[i],
                    extra_dims=more,
                    gathered=len(writers) > 1,
                )
            )
    for src in (shared or [])[len(kinds) :]:  # the layers make_prompt_cache gives no cache (Gemma 4, 3n)
        lay = layers[src] if src is not None else LayerSpec("full")  # attends as its source does, writing no K/V
        layers.append(LayerSpec(lay.kind, lay.span, source=src))
    return CacheSpec(
        tuple(layers),
        latent,
        front_state=front,
        shared_by_model=by_model,
        ropes=tuple(_plain_ropes(model.layers)),
        cache_slots=slots,
        passes=passes,
        stand_ins=_stand_ins(model, layers),
    )


def _stand_ins(model: nn.Module, specs: list[LayerSpec]) -> tuple:
    """(layer index, attention module, its name in the layer, the class it runs as for a pass) of
    each layer whose attention the paged pass runs through a stand-in: Gemma 2's soft-capped
    scores (`_CappedAttention`), afm7's KV-reuse layers (`_ReusedKVAttention`, on a
    `SharedLayerCache` of the layer they read)."""
    out = []
    for i, (layer, lay) in enumerate(zip(model.layers, specs)):
        attn = attention_of(layer)
        if _capped(attn):
            out.append((i, attn, _child_name(layer, attn), _CappedAttention))
        elif lay.source is not None and _reuses_kv(attn):
            out.append((i, attn, _child_name(layer, attn), _ReusedKVAttention))
    return tuple(out)


def _uses_cache(layer: nn.Module) -> bool:
    """Whether a layer's attention module calls `cache.update_and_fetch` (not Nemotron-NAS's
    linear stand-in for attention)."""
    attn = attention_of(layer)
    return attn is not None and "update_and_fetch" in _source(type(attn))


def _attention_slots(model: nn.Module, caches: list) -> tuple[int, ...] | None:
    """The layer of each of mlx-lm's caches when the model gives them only to the layers that
    have an attention module, in order, and none to the rest (Nemotron-NAS's attention-free
    layers: its `make_cache` and forward skip a layer whose `self_attn` is None), else None."""
    from mlx_lm.models.cache import ArraysCache

    layers = model.layers
    if len(caches) == len(layers) or any(isinstance(c, ArraysCache) for c in caches):
        return None
    holders = [
        i
        for i, la in enumerate(layers)
        if isinstance(la, nn.Module) and any(isinstance(la.get(n), nn.Module) for n in _ATTENTION_NAMES)
    ]
    if len(holders) != len(caches) or len(holders) == len(layers):
        return None
    return tuple(holders)


def _reads_last_cache(model: nn.Module) -> bool:
    """Whether the text model hands its layers beyond mlx-lm's caches the last cached layer's
    keys and values itself (afm7's KV-reuse layers: `cache[-1].keys_and_values()`)."""
    return "cache[-1].keys_and_values()" in _source(type(text_body(model)))


def _front_state(model: nn.Module, caches: list) -> bool:
    """Whether mlx-lm's first cache is a state read before the layers (LongCat-Flash n-gram's
    embedding), not a layer's: one ArraysCache more than the layers, and the text model has one
    child module besides its layers that takes a `cache` (`front_module`)."""
    from mlx_lm.models.cache import ArraysCache

    return len(caches) == len(model.layers) + 1 and type(caches[0]) is ArraysCache and front_module(model) is not None


def front_module(model: nn.Module) -> str | None:
    """The name of the text model's one child module, besides its layers, that takes a `cache`."""
    from .recurrent import call_params

    body = text_body(model)
    names = [n for n, m in body.children().items() if isinstance(m, nn.Module) and "cache" in call_params(type(m))]
    return names[0] if len(names) == 1 else None


def attentions_of(layer: nn.Module) -> list:
    """A layer's modules that call `cache.update_and_fetch`, by their paths (LongCat-Flash's
    `self_attn.0`, `self_attn.1`): the order of the caches in its CacheList."""
    found = [(n, m) for n, m in layer.named_modules() if m is not layer and "update_and_fetch" in _source(type(m))]
    key = lambda nm: [int(p) if p.isdigit() else p for p in nm[0].split(".")]  # noqa: E731 - 10 after 9
    return [m for _, m in sorted(found, key=key)]


def attention_modules(model: nn.Module, spec: CacheSpec | None = None) -> list:
    """The mlx-lm modules that define the attention classes of `model`'s layers (a wrapper's
    layers come from another module: smollm3's and mistral3's from llama's or ministral3's)."""
    import sys

    attns = [attention_of(layer) for layer in paged_layers(model, spec)]
    names = dict.fromkeys(type(a).__module__ for a in attns if not _capped(a))  # those call no SDPA
    return [sys.modules[n] for n in names]


def _install_sdpa(module) -> None:
    """Route `module.scaled_dot_product_attention` to the paged cache for a `PagedLayerCache`."""
    where = f"{module.__file__}: scaled_dot_product_attention"
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None:
        raise AdapterError(f"{where} is not defined: mlx-lm changed how {module.__name__} calls attention")
    if getattr(original, "_mlxpaged", False):
        return
    params = list(inspect.signature(original).parameters)
    if params[: len(_SDPA_PARAMS)] != _SDPA_PARAMS:
        raise AdapterError(f"{where} takes {params}, not {_SDPA_PARAMS}: the paged adapter needs updating")

    def _paged_sdpa(*args, **kwargs):
        cache = args[3] if len(args) > 3 else kwargs.get("cache")
        if isinstance(cache, PagedLayerCache):
            a = dict(zip(params, args), **kwargs)  # the names were checked above (inspect's bind: ~40 us a call)
            return cache.reader(a["keys"]).attend(a["queries"], a["scale"], a.get("mask"), a.get("sinks"))
        return original(*args, **kwargs)

    _paged_sdpa._mlxpaged = True
    module.scaled_dot_product_attention = _paged_sdpa


# The pass-only stand-ins below are plain callables, not modules: they are put in the module's
# dict for one pass (`_swapped`) and hold no parameters.
class _NormRows:
    """The final norm on only the rows whose logits are sampled (norm is per row); its output is
    the pass's `meta.hidden` (pooled requests read it)."""

    __slots__ = ("norm", "meta")

    def __init__(self, norm: nn.Module, meta: AttentionMetadata):
        self.norm = norm
        self.meta = meta

    def __call__(self, h: mx.array) -> mx.array:
        out = self.meta.hidden = self.norm(h[self.meta.logits_indices])
        return out

    def __getattr__(self, name):  # a forward may read the norm's weight (Idefics3's casts to its dtype)
        return getattr(self.norm, name)


class _BodyRows:
    """The text model for one pass, handing on only the rows whose logits are sampled: for a
    model whose final norm is no module of the body (a function in its forward, or a part of
    the output head), everything after the body is per row."""

    __slots__ = ("body", "meta")

    def __init__(self, body: nn.Module, meta: AttentionMetadata):
        self.body = body
        self.meta = meta

    def __call__(self, *args, **kwargs) -> mx.array:
        out = self.meta.hidden = self.body(*args, **kwargs)[self.meta.logits_indices]
        return out

    def __getattr__(self, name):  # the model's own forward may read the body's layers
        return getattr(self.body, name)


class _TabledRope:
    """A layer's `nn.RoPE` for one pass, from cosine/sine tables shared by every layer (rotary.py)."""

    __slots__ = ("rotary",)

    def __init__(self, rotary: Rotary):
        self.rotary = rotary

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if offset is not self.rotary.positions:  # someone else's call: the plain rope
            return self.rotary.rope(x, offset=offset)
        return self.rotary(x)  # x [T, heads, 1, head_dim]


@contextmanager
def _swapped(pairs):
    """Replace child modules (module, name, stand-in) for the duration of one pass's graph
    building. A module is a dict of its children, and attribute access reads that dict; a plain
    attribute (an int setting) lives in the instance's `__dict__` instead."""
    old = [(m, k, m.__dict__[k] if k in m.__dict__ else m[k]) for m, k, _ in pairs]
    try:
        for m, k, v in pairs:
            _put(m, k, v)
        yield
    finally:
        for m, k, v in reversed(old):
            _put(m, k, v)


def _put(m: nn.Module, k: str, v) -> None:
    if k in m.__dict__:
        object.__setattr__(m, k, v)
    else:
        m[k] = v


class _LayersWithoutMasks:
    """Llama 4's text model (mlx-lm's `llama4.LlamaModel`) for one pass. Its forward builds the
    chunk and global masks from a contiguous cache's scalar offset and start position; the paged
    caches mask by each token's position themselves (`PagedLayerCache.chunk`), so here the same
    embedding, layers and norm run with no mask."""

    __slots__ = ("body",)

    def __init__(self, body: nn.Module):
        self.body = body

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.body.embed_tokens(inputs)
        for layer, c in zip(self.body.layers, cache):
            h = layer(h, None, cache=c)
        return self.body.norm(h)


class _ScaledQueries:
    """A layer's `q_proj` for one pass, times each token's query scale: Llama 4's global (NoPE)
    layers scale their queries by `log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1` from
    the contiguous cache's scalar offset; per packed row, its position p (no RoPE or q norm comes
    between the projection and that product on those layers, so it can be taken here)."""

    __slots__ = ("proj", "scales")

    def __init__(self, proj: nn.Module, scales: mx.array):
        self.proj = proj
        self.scales = scales  # [T, 1, 1]

    def __call__(self, x: mx.array) -> mx.array:
        q = self.proj(x)
        return (q * self.scales).astype(q.dtype)


_CAPPED_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")


def _capped(attn: nn.Module | None) -> bool:
    """Whether an attention module computes its scores itself, soft-capped by
    `attn_logit_softcapping` (mlx-lm's gemma2), from the parts `_CappedAttention` calls."""
    if attn is None or "scaled_dot_product_attention(" in _source(type(attn)):
        return False
    return isinstance(getattr(attn, "attn_logit_softcapping", None), (int, float)) and all(
        hasattr(attn, n) for n in _CAPPED_PARTS
    )


def _child_name(parent: nn.Module, child: nn.Module) -> str:
    return next(n for n, m in parent.children().items() if m is child)


class _CappedAttention:
    """mlx-lm's gemma2 `Attention` for one pass. It computes its scores itself (queries times
    keys, `cap * tanh(s / cap)`, mask, softmax) instead of calling scaled_dot_product_attention;
    here its own projections and rope run on the packed rows, and the paged cache attends with
    the same soft cap (attention/reference.py)."""

    __slots__ = ("attn",)

    def __init__(self, attn: nn.Module):
        self.attn = attn

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        a, T = self.attn, x.shape[0]
        q = a.q_proj(x).reshape(T, 1, a.n_heads, -1).transpose(0, 2, 1, 3)
        k = a.k_proj(x).reshape(T, 1, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = a.v_proj(x).reshape(T, 1, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = a.rope(q, offset=cache.offset), a.rope(k, offset=cache.offset)
        cache.update_and_fetch(k, v)
        out = cache.attend(q, a.scale, None, softcap=a.attn_logit_softcapping)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(T, 1, -1))


_REUSE_PARTS = ("q_proj", "out_proj", "rope", "q_norm", "n_heads", "scale")


def _reuses_kv(attn: nn.Module | None) -> bool:
    """Whether an attention module takes an earlier layer's keys and values as arguments and
    writes none (afm7's KVReuseAttention), from the parts `_ReusedKVAttention` calls."""
    if attn is None or "update_and_fetch" in _source(type(attn)):
        return False
    params = list(inspect.signature(type(attn).__call__).parameters)
    return params[1:4] == ["x", "keys", "values"] and all(hasattr(attn, n) for n in _REUSE_PARTS)


class _ReusedKVAttention:
    """afm7's `KVReuseAttention` for one pass. mlx-lm's text model hands it the last cached
    layer's keys and values, and it rotates its queries by their length less its own (one
    scalar offset); here its own projection, rope and query norm run at each packed token's
    position, and it attends to that layer's pools (`cache`, a `SharedLayerCache`)."""

    __slots__ = ("attn", "cache")

    def __init__(self, attn: nn.Module, cache: SharedLayerCache):
        self.attn = attn
        self.cache = cache

    def __call__(self, x: mx.array, keys=None, values=None, mask=None) -> mx.array:
        a, T = self.attn, x.shape[0]
        q = a.q_proj(x).reshape(T, 1, a.n_heads, -1).transpose(0, 2, 1, 3)
        q = a.q_norm(a.rope(q, offset=self.cache.offset))
        out = self.cache.attend(q, a.scale, None)
        return a.out_proj(out.transpose(0, 2, 1, 3).reshape(T, 1, -1))


def _numpy_positions(body: nn.Module) -> bool:
    """Whether the text model computes its learned positions with numpy from one scalar
    `cache.offset` (gpt_bigcode), which per-token positions cannot be."""
    return "np.arange(cache" in _source(type(body))


class _LearnedPositions:
    """gpt_bigcode's text model (mlx-lm's `GPTBigCodeModel`) for one pass: its forward takes the
    positions from numpy's `arange` over one scalar cache offset; here its own token and position
    embeddings, layers and final norm run with each packed token's own position (rows of one
    token need no mask)."""

    __slots__ = ("body", "positions")
    PARTS = ("wte", "wpe", "h", "ln_f")

    def __init__(self, body: nn.Module, positions: mx.array):
        self.body = body
        self.positions = positions

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        b = self.body
        h = b.wte(inputs) + b.wpe(self.positions)[:, None]
        for layer, c in zip(b.h, cache):
            h = layer(h, None, cache=c)
        return b.ln_f(h)

    def __getattr__(self, name):  # the model's head reads the body's token embedding (tied weights)
        return getattr(self.body, name)


def _chunked_swaps(model: nn.Module, body: nn.Module, meta: AttentionMetadata) -> list:
    """A chunked family's stand-ins for one pass (Llama 4): its text model without the masks,
    and the position-scaled queries of its NoPE layers taken from the packed positions."""
    parent = model.language_model if isinstance(model.get("language_model"), nn.Module) else model
    if parent.get("model") is not body:
        raise AdapterError(f"{inspect.getfile(type(model))}: the chunked text model is not at language_model.model")
    swaps = [(parent, "model", _LayersWithoutMasks(body))]
    scales = {}
    for layer in body.layers:
        attn = attention_of(layer)
        if attn.use_rope or not attn.attn_temperature_tuning:
            continue
        key = (attn.floor_scale, attn.attn_scale)
        if key not in scales:
            p = meta.positions + 1
            scales[key] = (mx.log(mx.floor(p / attn.floor_scale) + 1.0) * attn.attn_scale + 1.0)[:, None, None]
        swaps += [(attn, "q_proj", _ScaledQueries(attn.q_proj, scales[key])), (attn, "attn_temperature_tuning", 0)]
    return swaps


class PagedModelMixin:
    """Mixed into a family's `Model`: `model(ids [T], paged_kv_cache, meta)` -> logits `[S, V]`.

    Called with anything else it is mlx-lm's model unchanged. `args` is mlx-lm's settings of the
    model, whichever name its Model keeps them under (`args`; youtu_llm and plamo3: `config`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not hasattr(self, "args") and hasattr(self, "config"):
            self.args = self.config  # the same object: what prepare fills in, the module reads

    def sanitize(self, weights: dict) -> dict:
        """mlx-lm's own, after naming a bare text model's weights as the whole model's: a checkpoint
        saved from transformers' `AutoModel` (Qwen3-Embedding's) says `layers.0...` for
        `model.layers.0...`, and has no output layer; where the model has an untied one, the
        embedding stands in for it (such a checkpoint embeds: its logits are never read)."""
        if "embed_tokens.weight" in weights and isinstance(self.get("model"), nn.Module):
            weights = {f"model.{k}": v for k, v in weights.items()}
            if isinstance(self.get("lm_head"), nn.Module) and "lm_head.weight" not in weights:
                for part in ("weight", "scales", "biases"):
                    if f"model.embed_tokens.{part}" in weights:
                        weights[f"lm_head.{part}"] = weights[f"model.embed_tokens.{part}"]
        return super().sanitize(weights) if hasattr(super(), "sanitize") else weights

    def __call__(self, inputs, cache=None, meta: AttentionMetadata | None = None, **kwargs):
        if meta is None:
            return super().__call__(inputs, cache, **kwargs)
        layers = self.layers
        spec = cache.spec if cache.spec is not None else cache_spec(self)
        caches = pass_caches(spec, cache, meta)
        chunked = any(lay.kind == "chunked_local" for lay in spec.layers)
        # the state before the layers' caches (n-gram embeddings): its module's stand-in holds it
        given = caches if spec.front_state is None else [None] + caches
        parent, name, body = _body_at(self)
        norm = _final_norm(body)
        if norm is not None:
            swaps = [(body, norm, _NormRows(body[norm], meta))]
        else:  # no final norm module: the rows are taken where the text model hands them to the head
            swaps = [(parent, name, _BodyRows(body, meta))]
        swaps += _rope_swaps(spec, meta.positions)
        if spec.num_recurrent:
            swaps += _segmented(self, body, spec, meta)
        if chunked:
            swaps += _chunked_swaps(self, body, meta)
        for i, attn, name, runs_as in spec.stand_ins:  # found once per model, with its spec
            stand_in = _CappedAttention(attn) if runs_as is _CappedAttention else runs_as(attn, caches[i])
            swaps.append((layers[i], name, stand_in))
        if _numpy_positions(body):
            swaps.append((parent, name, _LearnedPositions(body, meta.positions)))
        # each targeted linear adds its rows' own adapters (lora.py), swapped in first: Llama 4's
        # scaled queries (`_chunked_swaps`) then wrap a q_proj with its adapters
        lora = meta.lora.swaps() if meta.lora is not None else []
        try:
            with _swapped(lora), _swapped(swaps):
                passed = given if spec.cache_slots is None else [caches[i] for i in spec.cache_slots]
                logits = super().__call__(inputs[:, None], cache=passed)  # [S, 1, V]
        except ValueError as e:  # a shape error in a layer that bypassed the paged cache (MLA's rope scores)
            _check_attended(layers, caches, e)
            raise
        _check_attended(layers, caches)
        return logits.reshape(logits.shape[0], -1)


def pass_caches(spec: CacheSpec, cache, meta: AttentionMetadata) -> list:
    """Each layer's cache object for one pass over the paged `cache`. A recurrent layer gets
    None: its stand-in (recurrent.py) holds the step's states."""
    kind = LatentLayerCache if spec.latent else PagedLayerCache
    caches = []
    for lay in spec.layers:
        window = lay.span if lay.kind == "sliding_window" else None
        chunk = lay.span if lay.kind == "chunked_local" else None
        if lay.source is not None:  # reads an earlier layer's pools (Gemma 4); Gemma 3n's model hands them itself
            caches.append(None if spec.shared_by_model else SharedLayerCache(caches[lay.source]))
        elif lay.pool is None:
            caches.append(None)
        else:
            # a layer reads its own KV cache group's tables (worker/kv_cache.py `groups`)
            m = meta.groups[cache.groups[lay.pool]] if meta.groups else meta
            if not lay.parts:
                caches.append(kind(cache, lay.pool, m, window, chunk, lay.tiled_heads))
            else:  # a CacheList layer: its j-th KV cache on pool + j; its state's entry is None
                pools = iter(range(lay.pool, lay.pool + 1 + len(lay.extra_dims)))
                each = GatheredLayerCache if lay.gathered else kind
                caches.append(
                    tuple(each(cache, next(pools), m, window, chunk) if e == "kv" else None for e in lay.parts)
                )
    if spec.passes > 1:  # a layer attending more than once a pass reads the cache that gave its keys
        for c in caches:
            c.peers = caches
    return caches


def _check_attended(layers, caches, cause: Exception | None = None) -> None:
    """Raise naming the first attention layer that did not write and read its paged cache."""
    for i, entry in enumerate(caches):
        for c in entry if isinstance(entry, tuple) else (entry,):  # a CacheList layer: each of its KV entries
            if c is not None and (c.pools is None or not c.attended):
                attn = attention_of(layers[i % len(layers)])
                raise AdapterError(
                    f"{inspect.getfile(type(attn))}: "
                    f"{type(attn).__name__}.__call__ no longer calls cache.update_and_fetch and "
                    "scaled_dot_product_attention(..., cache=cache): the paged adapter needs updating"
                ) from cause


def _segmented(model: nn.Module, body: nn.Module, spec: CacheSpec, meta: AttentionMetadata) -> list:
    """The stand-ins of one pass's recurrent modules (`SegmentedLayer`, on the pass's states
    `meta.states`; a pass without them starts every entry empty): a recurrent layer's whole
    decoder layer, or a two-cache layer's recurrent module (`recurrent_child`) beside its attention."""
    states = meta.states
    if states is None:
        cu = meta.cu_seqlens_q.tolist()  # host-built (metadata.py): reading it forces nothing
        states = StepStates.fresh([b - a for a, b in zip(cu, cu[1:])], spec.num_recurrent)
    layers, swaps, k = [], [], 0
    if spec.front_state is not None:  # the first state: the module before the layers that reads it
        name = front_module(model)
        swaps.append((body, name, SegmentedLayer(body[name], 0, spec.front_state, states)))
        k = 1
    for layer, lay in zip(body.layers, spec.layers):
        if lay.state_arrays is None:
            layers.append(layer)
            continue
        if lay.parts:
            name = recurrent_child(layer)
            swaps.append((layer, name, SegmentedLayer(layer[name], k, lay.state_arrays, states)))
            layers.append(layer)
        else:
            layers.append(SegmentedLayer(layer, k, lay.state_arrays, states))
        k += 1
    return [(body, "layers", layers)] + swaps


def recurrent_child(layer: nn.Module) -> str | None:
    """The name of a two-cache layer's recurrent module: its one child, besides its attention,
    that takes a `cache` (Falcon-H1's `mamba`), or None when there is not exactly one."""
    from .recurrent import call_params

    attn = attention_of(layer)
    names = [
        n
        for n, m in layer.children().items()
        if isinstance(m, nn.Module) and m is not attn and "cache" in call_params(type(m))
    ]
    return names[0] if len(names) == 1 else None


def _plain_ropes(layers) -> list:
    """(attention module, its rope, the rope's table key) of every layer whose rope only rotates (rotary.py)."""
    out = []
    for layer in layers:
        attn = attention_of(layer)
        rope = attn.get("rope") if isinstance(attn, nn.Module) else None
        if rope is not None and is_rotation(rope):
            out.append((attn, rope, table_key(rope)))
    return out


def _rope_swaps(spec: CacheSpec, positions: mx.array) -> list:
    """On the CPU, plain RoPE layers share one pass's cos/sin tables (rotary.py: ~25 ops fewer per call)."""
    if mx.default_device() != mx.cpu:
        return []
    swaps, tables = [], {}
    for attn, rope, key in spec.ropes:  # found once per model, with its spec
        if key not in tables:
            tables[key] = _TabledRope(Rotary(rope, positions))
        swaps.append((attn, "rope", tables[key]))
    return swaps


_classes: dict = {}


def model_classes(config: dict):
    """`(Paged Model class, ModelArgs class)` of a checkpoint's family, for mlx-lm's `load_model`."""
    module = family_module(config["model_type"])  # its attention modules are patched by `prepare`
    if module.Model not in _classes:
        _classes[module.Model] = type(
            f"Paged{module.__name__.rsplit('.', 1)[-1].title()}Model", (PagedModelMixin, module.Model), {}
        )
    return _classes[module.Model], module.ModelArgs


# The names mlx-lm's decoder layers give their attention module (most: self_attn).
_ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")


def attention_of(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's attention module: its `self_attn` (or `attn`, `attention`), else the one
    module inside it whose class calls `cache.update_and_fetch` (dbrx: `norm_attn_norm.attn`,
    exaone: `attn.attention`). None for a layer with neither."""
    if not isinstance(layer, nn.Module):
        return None
    named = next((layer[n] for n in _ATTENTION_NAMES if isinstance(layer.get(n), nn.Module)), None)
    if named is not None and "update_and_fetch" in _source(type(named)):
        return named
    for _, m in layer.named_modules():
        if m is not layer and "update_and_fetch" in _source(type(m)):
            return m
    return named


_sources: dict = {}


def _source(cls) -> str:
    """The source of `cls.__call__` (empty when there is none to read), read once per class."""
    if cls not in _sources:
        try:
            _sources[cls] = inspect.getsource(cls.__call__)
        except (OSError, TypeError):
            _sources[cls] = ""
    return _sources[cls]


def _cache_kind(c) -> str:
    """What an mlx-lm cache object holds, in words."""
    from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache

    if type(c) is CacheList:
        inner = " and ".join(type(x).__name__ for x in c.caches)
        many = "two caches in one layer" if len(c.caches) == 2 else f"{len(c.caches)} caches in one layer"
        return f"{many} (mlx-lm's CacheList of {inner})" if len(c.caches) != 1 else f"mlx-lm's CacheList of {inner}"

    if isinstance(c, RotatingKVCache):
        return f"a sliding window of {c.max_size} that always keeps the first {c.keep} tokens"
    if isinstance(c, ArraysCache) or type(c).__name__ == "MambaCache":
        return "linear-attention / state-space (an ArraysCache)"
    if isinstance(c, (KVCache, ChunkedKVCache)):
        return type(c).__name__
    # name what it keeps (deepseek_v41's LayerCache: a window, compressed groups and their
    # indexer keys, the open group's rows), as the class holds it
    held = [k for k, v in vars(c).items() if v is None or isinstance(v, mx.array)]
    keeps = f": {', '.join(held)}" if held else ""
    return f"a cache class mlxpaged does not know ({type(c).__module__}.{type(c).__name__}{keeps})"


def _refusal(model_type: str, model: nn.Module, config: dict) -> str | None:
    """One line naming the first thing in `model`'s structure the paged cache cannot run, or None.

    Structural, not by name: each layer's cache from mlx-lm's own `make_prompt_cache` must be one
    the paged cache holds (a KVCache; a RotatingKVCache that keeps no prefix: a sliding window; a
    ChunkedKVCache; an ArraysCache: recurrent state, recurrent.py; a CacheList of those: a state
    beside a KV cache, or KV caches for two attentions or a latent attention and its indexer), and
    each attention layer's module must call `cache.update_and_fetch` and its module's
    `scaled_dot_product_attention`.
    """
    from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache, make_prompt_cache

    try:
        caches = make_prompt_cache(model)
    except Exception as e:  # noqa: BLE001 - a module whose cache cannot be made is refused, not crashed on
        return f"{model_type}: mlx-lm's make_prompt_cache fails for it ({type(e).__name__}: {str(e)[:100]})"
    types = config.get("layer_types") or (config.get("text_config") or {}).get("layer_types") or []
    try:
        layers = list(model.layers)
    except Exception:  # noqa: BLE001 - no layer list to page
        return f"{model_type}: its Model has no `layers` list the paged cache can walk; refused"
    if len(caches) == len(layers) + 1 and type(caches[0]) is ArraysCache:  # longcat_flash_ngram
        if not _front_state(model, caches):
            return (
                f"{model_type}: mlx-lm's make_prompt_cache gives an ArraysCache before the layers' caches, and no "
                "one module of the text model besides its layers takes it as `cache`; refused"
            )
        caches = caches[1:]
    if len(caches) > len(layers) and len(caches) % len(layers):
        return (
            f"{model_type}: mlx-lm's make_prompt_cache gives {len(caches)} caches for {len(layers)} layers, "
            "not a whole number of caches per layer (a cache per layer, or one per pass of each layer); refused"
        )

    def held(c) -> bool:
        return type(c) in (KVCache, ChunkedKVCache, ArraysCache) or (type(c) is RotatingKVCache and c.keep == 0)

    def listed(c, layer) -> bool:
        """A CacheList of one KV cache (MiniMax-M3's full layers), of a state and one (Falcon-H1), or
        of KV caches each written by its own attention module (LongCat-Flash's two)."""
        kinds = sorted(isinstance(x, ArraysCache) for x in getattr(c, "caches", ()))
        if type(c) is not CacheList or not all(held(x) for x in c.caches):
            return False
        writers = attentions_of(layer)
        return kinds in ([False], [False, True]) or (
            not any(kinds)
            and len(writers) == len(kinds)
            and (len({type(m) for m in writers}) == 1 or _is_latent(writers[0]))  # a latent attention's indexer
        )

    for i, c in enumerate(caches):
        if held(c) or (i < len(layers) and listed(c, layers[i])):
            continue
        named = f" ({types[i]})" if i < len(types) else ""
        writers = sorted({type(m).__name__ for m in attentions_of(layers[i])}) if i < len(layers) else []
        if type(c) is CacheList and len(writers) > 1:  # an indexer's keys beside attention that is not latent
            return (
                f"{model_type}: layer {i}{named} keeps {_cache_kind(c)} written by different modules "
                f"({', '.join(writers)}): sparse attention, which the paged cache runs only beside latent "
                "attention (DeepSeek's); refused"
            )
        return (
            f"{model_type}: layer {i}{named} keeps {_cache_kind(c)}, which the paged cache does not hold "
            "(a KVCache, sliding-window RotatingKVCache, ChunkedKVCache or ArraysCache per layer, or a CacheList "
            "of a state and a KV cache, or of KV caches one attention class writes); refused"
        )
    recurrent = [isinstance(c, ArraysCache) for c in caches] + [False] * (len(layers) - len(caches))
    slots = _attention_slots(model, caches)
    try:
        reads_last = _reads_last_cache(model)
        body_writes = "update_and_fetch" in _source(type(text_body(model)))
    except AdapterError:  # no text body: refused below
        reads_last = body_writes = False
    for i, layer in enumerate(layers):
        if slots is not None and not _uses_cache(layer):  # Nemotron-NAS: a layer without attention
            continue
        if recurrent[i]:
            reason = _recurrent_refusal(layer)
            if reason:
                named = f" ({types[i]})" if i < len(types) else ""
                return f"{model_type}: layer {i}{named}: {reason}; refused"
            continue
        state_and_kv = (
            any(isinstance(x, ArraysCache) for x in getattr(caches[i], "caches", ())) if i < len(caches) else False
        )
        if state_and_kv and recurrent_child(layer) is None:
            attn = attention_of(layer)
            where = f"{type(attn).__module__}.{type(attn).__name__}" if attn is not None else type(layer).__name__
            return (
                f"{model_type}: layer {i} keeps a state and a KV cache (mlx-lm's CacheList), and {where} reads "
                "the state itself beside its KV cache, where the paged cache runs a state only in a module of its "
                "own beside the attention (Falcon-H1's mixer); refused"
            )
        reason = _attention_refusal(layer, body_writes)
        if reason and len(caches) < len(layers) and attention_of(layer) is None:  # nemotron-nas
            return (
                f"{model_type}: layer {i} has no attention (mlx-lm's make_prompt_cache gives {len(caches)} caches "
                f"for {len(layers)} layers), and the caches do not map onto the layers with an attention module; "
                "refused"
            )
        if reason and i >= len(caches) and reads_last and _reuses_kv(attention_of(layer)):
            continue  # afm7's KV-reuse layers: `_ReusedKVAttention` on the last cached layer's pools
        if reason and i >= len(caches):
            return (
                f"{model_type}: layer {i} has no cache of its own in mlx-lm's make_prompt_cache and reads an "
                f"earlier layer's keys and values ({type(attention_of(layer)).__name__}) in a way the paged "
                "adapter does not map (Gemma 4's previous_kvs, Gemma 3n's layer_idx_to_cache_idx, afm7's "
                "KV-reuse layers); refused"
            )
        if reason:
            return f"{model_type}: layer {i}: {reason}; refused"
    try:
        text_body(model)
    except AdapterError:
        return (
            f"{model_type}: no text model with a layer list under Model.model, Model.language_model or "
            "Model.transformer; refused"
        )
    if not (hasattr(model, "args") or hasattr(model, "config")):
        return f"{model_type}: its Model keeps its settings neither as `args` nor as `config`; refused"
    body = text_body(model)
    if _numpy_positions(body) and not all(n in body for n in _LearnedPositions.PARTS):
        return (
            f"{model_type}: {type(body).__module__}.{type(body).__name__} computes its learned positions "
            "with numpy from one scalar cache.offset; the paged cache's offset is one position per token; refused"
        )
    return None


def _recurrent_refusal(layer: nn.Module) -> str | None:
    """Why a layer with recurrent state (an ArraysCache) is not one recurrent.py runs, or None: it
    runs any decoder layer that takes its `cache` by that name (it hands each sequence's run an
    ArraysCache there); whether the tokens are mlx-lm's is what tests/test_zoo.py checks per type."""
    from .recurrent import call_params

    if "cache" in call_params(type(layer)):
        return None
    return (
        f"linear attention / state space ({type(layer).__module__}.{type(layer).__name__}), whose __call__ "
        "takes no `cache` argument recurrent.py could hand each sequence's state"
    )


def _attention_refusal(layer: nn.Module, body_writes: bool = False) -> str | None:
    """Why one attention layer's module is not one the paged cache runs, or None. `body_writes`:
    the text model's forward itself calls `update_and_fetch` and the attention module's methods
    (iquestloopcoder), so the module's whole class is read, not only its `__call__`."""
    attn = attention_of(layer)
    if attn is None:
        return f"{type(layer).__name__} has no attention module that calls cache.update_and_fetch"
    cls = type(attn)
    src = _source(cls)
    if body_writes and "update_and_fetch" not in src:
        src = "update_and_fetch " + inspect.getsource(cls)
    where = f"{cls.__module__}.{cls.__name__}"
    if "update_and_fetch" not in src:
        return f"{where} does not call cache.update_and_fetch (its keys and values are not cached per layer)"
    if _capped(attn):
        return None
    if "scaled_dot_product_attention(" not in src:
        capped = " with logit soft-capping" if "softcap" in src else ""
        return (
            f"{where} computes its attention scores itself{capped}, not through "
            "scaled_dot_product_attention(..., cache=cache), which the paged cache replaces"
        )
    if getattr(attn, "block_sparse", False):  # phi3small: its own block-sparse attention on these layers
        return (
            f"{where} attends block-sparsely on this layer (each head its own pattern of local and strided "
            "key blocks), which the paged cache does not run"
        )
    module = inspect.getmodule(cls)
    sdpa = getattr(module, "scaled_dot_product_attention", None)
    if getattr(sdpa, "_mlxpaged", False):  # already routed to the paged cache (_install_sdpa)
        return None
    if sdpa is None or list(inspect.signature(sdpa).parameters)[: len(_SDPA_PARAMS)] != _SDPA_PARAMS:
        return f"{where} calls a scaled_dot_product_attention that is not mlx-lm's base function"
    return None


def _not_run(model_type: str, config: dict) -> str | None:
    """Why mlxpaged does not run `model_type`: one line naming what the paged cache lacks, or None
    when its mlx-lm module's structure is one the paged cache runs."""
    import contextlib
    import io

    printed = io.StringIO()
    try:  # some modules print and exit when an optional package is missing (olmo: ai2-olmo)
        with contextlib.redirect_stdout(printed):
            module = family_module(model_type)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("mlx_lm.models"):
            from mlx_lm import __version__

            return f"unsupported model_type {model_type!r}: mlx-lm {__version__} has no model module for it"
        return f"unsupported model_type {model_type!r}: its mlx-lm module needs the missing package {e.name!r}"
    except (Exception, SystemExit) as e:
        why = (printed.getvalue().strip() or str(e).strip() or type(e).__name__).splitlines()[0][:120]
        return f"unsupported model_type {model_type!r}: its mlx-lm module fails to import ({why})"
    if not hasattr(module, "Model"):
        return f"unsupported model_type {model_type!r}: {module.__name__} defines no Model"
    try:  # built lazily (its random weights are never evaluated) only to see its layers
        model = module.Model(module.ModelArgs.from_dict(config))
    except Exception as e:  # noqa: BLE001 - a config the module cannot build is refused in one line
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        return f"{model_type}: {module.__name__} cannot build this config ({type(e).__name__}: {why})"
    return _refusal(model_type, model, config)


def check_family(model_type: str | None, config: dict, where) -> None:
    """Raise one line unless `model_type`'s mlx-lm module is one the paged cache runs (`_not_run`)."""
    reason = _not_run(model_type, config) if model_type else "no model_type in the config"
    if reason:
        raise MlxPagedError(f"{reason} in {where}")


# Tensor parallelism (distributed/sharding.py) splits dense attention and MLP layers; these
# families it does not split yet, each for the reason given.
_MOE_TP = "its MoE experts (mlx-lm's SwitchGLU, stacked [experts, out, in]) are not split by mlxpaged's shard loader"
TP_REFUSED = {
    **dict.fromkeys(MOE + ("gpt_oss", "llama4"), _MOE_TP),
    "llama4_text": "its MLP is `feed_forward`, which the split in distributed/sharding.py does not name",
    **dict.fromkeys(("mistral3", "gemma3"), "the shard loader reads a flat config; this wrapper nests its text config"),
    **dict.fromkeys(HYBRID + STATE, "its recurrent layers (recurrent.py) are not split by mlxpaged's shard loader"),
    **dict.fromkeys(
        ("longcat_flash", "deepseek_v32", "glm_moe_dsa", "minimax_m3_vl"),
        "its layers' CacheList of caches is not split by mlxpaged's shard loader",
    ),
    **dict.fromkeys(MLA, "its latent attention (one latent row per token) is not split by mlxpaged's shard loader"),
    **dict.fromkeys(PER_LAYER, "its per-layer KV shapes and shared-KV layers are not split by mlxpaged's shard loader"),
}


def check_tensor_parallel(model_type: str | None) -> None:
    """Raise one line naming why `model_type` cannot run tensor-parallel, if it cannot."""
    if model_type in TP_REFUSED:
        raise MlxPagedError(
            f"tensor parallelism does not support model_type {model_type!r}: {TP_REFUSED[model_type]}; "
            "run it on one process"
        )


_TEXT_ARGS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "max_position_embeddings",
)


def prepare(model: nn.Module, config: dict, where) -> nn.Module:
    """Check a built family model and give its `args` what the engine reads (head_dim, KV heads)."""
    reason = _refusal(config.get("model_type"), model, config)
    if reason:
        raise MlxPagedError(f"{reason} in {where}")
    args = model.args
    body = text_body(model)
    text_args = getattr(body, "args", None) or getattr(body, "config", None)  # gemma3n: LanguageModel.config
    if text_args is None and isinstance(model.get("language_model"), nn.Module):  # qwen3_5: args on TextModel
        text_args = getattr(model.language_model, "args", None)
    for name in _TEXT_ARGS:  # a wrapper's args hold only its text_config: the engine reads these
        if getattr(args, name, None) is None and getattr(text_args, name, None) is not None:
            setattr(args, name, getattr(text_args, name))
    _args_from_attention(model, args)
    if getattr(args, "num_key_value_heads", None) is None:
        args.num_key_value_heads = args.num_attention_heads
    if getattr(args, "head_dim", None) is None:
        args.head_dim = args.hidden_size // args.num_attention_heads  # every supported family's default
    spec = cache_spec(model)  # raises if the layers that read another's K/V cannot be told
    for module in attention_modules(model, spec):
        _install_sdpa(module)
    for layer in paged_layers(model, spec):
        attn = attention_of(layer)
        if getattr(attn, "head_dim", None) is None:
            attn.head_dim = args.head_dim  # kv_quant.key_offsets reads it
    _check_kv_shapes(model, spec)
    return model


# What mlx-lm's attention modules call their head counts and width (gpt2: n_head; dbrx: num_heads).
_HEADS = ("n_heads", "num_heads", "num_attention_heads", "n_head")
_KV_HEADS = ("n_kv_heads", "num_kv_heads", "num_key_value_heads", "k_num_heads")


def _is_latent(attn: nn.Module | None) -> bool:
    """Whether an attention module is mlx-lm's multi-head latent attention, as deepseek_v3's (a
    latent cache row; `LatentLayerCache`): whatever the checkpoint's model_type (kimi_k25, joyai_llm_flash)."""
    return attn is not None and hasattr(attn, "kv_lora_rank") and hasattr(attn, "embed_q")


def _check_kv_shapes(model: nn.Module, spec: CacheSpec) -> None:
    """Raise unless each pool layer's rows are as wide as its attention module's K/V: a layer
    writing more KV heads than its pool has would be broadcast into it, not refused."""
    if spec.latent:  # one latent row per token, not per-head rows
        return
    for i, (layer, have) in enumerate(zip(paged_layers(model, spec), spec.pool_dims)):
        want = _kv_shape(attention_of(layer), model.args)
        if tuple(want) != tuple(have):
            raise AdapterError(
                f"{inspect.getfile(type(model))}: layer {i}'s attention writes {want[0]} KV heads of {want[1]}, "
                f"the config says {have[0]} of {have[1]}: the paged adapter needs updating"
            )


def _kv_shape(attn: nn.Module, args) -> tuple[int, int]:
    """(KV heads, head_dim) of one attention layer's K/V rows, as its module names them."""
    kv = next((getattr(attn, n) for n in _KV_HEADS if isinstance(getattr(attn, n, None), int)), None)
    hd = getattr(attn, "head_dim", None)
    if kv is None and isinstance(getattr(attn, "q_head_dim", None), int):
        # deepseek_v2, minicpm3, youtu_llm: latent attention expanded per head before caching, a key
        # (nope + rope columns, the query's width) and a narrower value on every query head
        return next(getattr(attn, n) for n in _HEADS if isinstance(getattr(attn, n, None), int)), attn.q_head_dim
    return (kv or args.num_key_value_heads, hd if isinstance(hd, int) else args.head_dim)


def _args_from_attention(model: nn.Module, args) -> None:
    """Fill what the engine reads (num_attention_heads, num_key_value_heads, head_dim,
    hidden_size) from the first attention layer, where the family's args name them otherwise
    (gpt2's n_head and n_embd, openelm's per-layer lists)."""
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    # the first layer with K/V (not `paged_layers`: the spec reads the args this fills)
    caches = make_prompt_cache(model)[-len(model.layers) :]  # (LongCat-Flash n-gram's first is its embedding's)
    first = next((la for la, c in zip(model.layers, caches) if not isinstance(c, ArraysCache)), None)
    attn = attention_of(first)
    if attn is None:
        if first is None:  # no attention layer (mamba, rwkv7): no K/V pools to size
            for name in ("num_attention_heads", "num_key_value_heads", "head_dim"):
                if not isinstance(getattr(args, name, None), int):
                    setattr(args, name, 0)
        return
    heads = next((getattr(attn, n) for n in _HEADS if isinstance(getattr(attn, n, None), int)), None)
    kv = next((getattr(attn, n) for n in _KV_HEADS if isinstance(getattr(attn, n, None), int)), None)
    if not isinstance(getattr(args, "num_attention_heads", None), int) and heads is not None:
        args.num_attention_heads = heads
    if not isinstance(getattr(args, "num_key_value_heads", None), int) and (kv or heads) is not None:
        args.num_key_value_heads = kv or heads  # step3p5 names its KV heads num_attention_groups
    if not isinstance(getattr(args, "head_dim", None), int) and isinstance(getattr(attn, "head_dim", None), int):
        args.head_dim = attn.head_dim
    if getattr(args, "hidden_size", None) is None or getattr(args, "vocab_size", None) is None:
        # phixtral names them model_dim and num_vocab: its token embedding's shape says both
        embed = next((m for _, m in text_body(model).named_modules() if isinstance(m, nn.Embedding)), None)
        if embed is not None:
            vocab, hidden = embed.weight.shape[0], embed.weight.shape[-1]
            if getattr(args, "hidden_size", None) is None:
                args.hidden_size = hidden
            if getattr(args, "vocab_size", None) is None:
                args.vocab_size = vocab


def _shared_layers(model: nn.Module, num_cached: int) -> tuple[list | None, bool]:
    """(per layer, the index of the layer whose K/V it attends to instead of its own, or None for
    a layer with its own; whether the model hands that layer its source's cache object itself):
    Gemma 4's `previous_kvs` (it passes the source's K/V, not its cache), Gemma 3n's
    `layer_idx_to_cache_idx` (it passes the cache). (None, False) for a model without such layers."""
    layers = model.layers
    if num_cached == len(layers):
        return None, False
    if _reads_last_cache(model):  # afm7: every layer past the cached ones reads the last one's K/V
        return [None] * num_cached + [num_cached - 1] * (len(layers) - num_cached), False
    body = text_body(model)
    by_model = hasattr(body, "layer_idx_to_cache_idx")
    previous = body.layer_idx_to_cache_idx if by_model else getattr(body, "previous_kvs", None)
    if previous is None or len(previous) != len(layers) or any(previous[i] != i for i in range(num_cached)):
        raise AdapterError(
            f"{inspect.getfile(type(model))}: mlx-lm's make_prompt_cache gives {num_cached} of "
            f"{len(layers)} layers a cache, and the text model names no `previous_kvs` (or "
            "`layer_idx_to_cache_idx`) for the rest: the paged adapter needs updating"
        )
    return [None if p == i else p for i, p in enumerate(previous)], by_model
