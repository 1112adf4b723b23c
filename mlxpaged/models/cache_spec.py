"""A model's paged cache, declared: what each layer of the text model keeps (its `LayerSpec`).

The adapter (paged_adapter.py `cache_spec`) reads it off an mlx-lm model once, from mlx-lm's own
`make_prompt_cache` (which cache each layer gets) and the layers' attention modules (KV heads,
head_dim); the pools (worker/kv_cache.py), the block manager's groups (core/kv_groups.py), the
model runner and the paged forward pass read this spec, and nothing is set on mlx-lm's modules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

# What a layer keeps: the kinds of KV cache group (core/kv_groups.py `GROUP_KINDS`) for a layer
# with K/V of its own or another's, and "recurrent" for a layer with a state and no K/V.
RECURRENT = "recurrent"
# A layer that keeps nothing: no attention (Nemotron-NAS's attention-free layers).
NO_CACHE = "none"


@dataclass(frozen=True)
class LayerSpec:
    """One layer of the text model.

    `kind`: "full", "sliding_window" or "chunked_local" (its KV cache group's kind), "recurrent",
    or "none" (no attention: nothing kept);
    `span`: its window or chunk in tokens (None for full attention and recurrent layers);
    `pool`: its K/V pool's index (`CacheSpec.pool_layers` order), None when it writes no K/V (a
    recurrent layer, or one that reads another layer's: `source`);
    `kv_heads`, `head_dim`: a pool row's shape (0 without a pool);
    `source`: the layer whose K/V it reads instead of writing its own (Gemma 4, 3n), or None;
    `state_arrays`: a recurrent layer's number of state arrays (mlx-lm's ArraysCache), else None;
    `tiled_heads`: its module tiles its KV heads (query head h reads KV head h mod kv_heads, plamo)
    instead of grouping them (h // (heads / kv_heads));
    `extra_dims`: a layer with two KV caches (LongCat-Flash's two attentions), the rows' shape of
    its further pools, numbered `pool + 1`, ...;
    `gathered`: a layer whose KV caches different modules write (DeepSeek sparse attention: an
    indexer's keys beside the latent rows), run on each token's whole context gathered from its
    pools (`GatheredLayerCache`);
    `parts`: a layer with two caches (mlx-lm's CacheList: Falcon-H1's Mamba-2 state and K/V), what
    each entry of its CacheList is, "state" or "kv", in order; () for a layer with one cache. Such
    a layer has both a pool (its KV cache group entry) and `state_arrays` (its state group entry).
    """

    kind: str
    span: int | None = None
    pool: int | None = None
    kv_heads: int = 0
    head_dim: int = 0
    source: int | None = None
    state_arrays: int | None = None
    tiled_heads: bool = False
    parts: tuple[str, ...] = ()
    extra_dims: tuple[tuple[int, int], ...] = ()
    gathered: bool = False


@dataclass(frozen=True)
class CacheSpec:
    """Every layer's `LayerSpec`, in the text model's order. Invariant: the layers with a pool
    number 0, 1, ... in order; a layer with a `source` has no pool and its source's kind and span.

    `front_state`: the number of state arrays of a cache mlx-lm keeps before the layers' (LongCat-Flash
    n-gram's embedding reads each sequence's last tokens from it), or None; it is the first state;
    `latent`: an MLA model (one latent row per token, read as both key and value: a keys-only pool);
    `shared_by_model`: the model hands a layer with a `source` its source's cache object itself
    (Gemma 3n), so such a layer gets no cache of its own; `ropes`: (attention module, its rope,
    the rope's table key) of each layer whose rope only rotates (rotary.py), found once;
    `cache_slots`: the layer of each entry of the cache list the model's forward takes, where
    that list is not one per layer (Nemotron-NAS: only the layers with attention; afm7: only the
    layers before its KV-reuse ones), else None; `passes`: how many times each layer attends a
    forward pass, each time with its own cache (iquestloopcoder: 2): entry `i` of `layers` is then
    pass `i // n`'s cache of model layer `i % n`; `stand_ins`: (layer, attention module, its name,
    the class it runs as) of each layer whose attention a pass runs through a stand-in (Gemma 2's
    soft-capped scores, afm7's KV-reuse layers), found once.
    """

    layers: tuple[LayerSpec, ...]
    latent: bool = False
    front_state: int | None = None
    shared_by_model: bool = False
    ropes: tuple = field(default=(), compare=False, repr=False)
    cache_slots: tuple[int, ...] | None = None
    passes: int = 1
    stand_ins: tuple = field(default=(), compare=False, repr=False)

    @functools.cached_property  # read each pass: found once (the spec is frozen)
    def pool_layers(self) -> list[int]:
        """Per K/V pool, its layer (a layer with two KV caches: twice), in pool order."""
        return [i for i, lay in enumerate(self.layers) if lay.pool is not None for _ in range(1 + len(lay.extra_dims))]

    @functools.cached_property  # read each pass: found once (the spec is frozen)
    def pool_dims(self) -> list[tuple[int, int]]:
        """Per pool, its rows' (KV heads, head_dim)."""
        return [
            d for lay in self.layers if lay.pool is not None for d in ((lay.kv_heads, lay.head_dim), *lay.extra_dims)
        ]

    @functools.cached_property  # read each pass: found once (the spec is frozen)
    def num_recurrent(self) -> int:
        front = self.front_state is not None
        return front + sum(lay.state_arrays is not None for lay in self.layers)

    @functools.cached_property  # read each pass: found once (the spec is frozen)
    def recurrent_sizes(self) -> list[int | None]:
        """Per layer, its number of state arrays, or None for a layer without a state."""
        return [lay.state_arrays for lay in self.layers]

    def groups(self) -> tuple[list[tuple[str, int | None]], tuple[int, ...]]:
        """(the KV cache groups as (kind, span), full attention first; each pool's group): one
        group per kind, spanning the largest of its layers' spans."""
        kinds = [(self.layers[i].kind, self.layers[i].span) for i in self.pool_layers]
        spans: dict[str, int | None] = {"full": None}
        for kind, span in kinds:
            if kind != "full":
                spans[kind] = max(span, spans.get(kind) or 0)
        order = list(spans)
        return [(k, spans[k]) for k in order], tuple(order.index(k) for k, _ in kinds)
