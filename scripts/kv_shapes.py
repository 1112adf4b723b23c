"""K/V bytes per token of a real model's config, from the pools mlxpaged would allocate
(`CacheShape.of`, one `(kv_heads, head_dim)` per pool layer), without its weights.

    python scripts/kv_shapes.py gemma4_text          # mlx-lm's ModelArgs defaults: gemma-4-E2B's text model
    python scripts/kv_shapes.py --config PATH/config.json

The model is built from mlx-lm's own classes (its arrays are never evaluated) and checked as a
checkpoint would be (`paged_adapter.prepare`). Prints the pool layers' shapes, the bytes per token
of mlxpaged's pools (bf16 by default), what one shape for all of them would take (the widest row,
on the pool layers and on every layer), and which caches mlx-lm's `make_prompt_cache` makes.
This is arithmetic on the shapes, not a measurement of a run.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from types import SimpleNamespace

import mlxpaged  # noqa: F401  (first: the system OpenBLAS)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxpaged.models.paged_adapter import cache_spec, model_classes, prepare
from mlxpaged.worker.kv_cache import CacheShape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_type", nargs="?", help="a model_type, built with mlx-lm's ModelArgs defaults")
    ap.add_argument("--config", help="a checkpoint's config.json instead")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    if bool(a.model_type) == bool(a.config):
        ap.error("give a model_type or --config")
    config = json.loads(open(a.config).read()) if a.config else {"model_type": a.model_type}
    cls, args_cls = model_classes(config)
    model = prepare(cls(args_cls.from_dict(config)), config, a.config or a.model_type)
    dtype = getattr(mx, a.dtype)
    spec = cache_spec(model)
    dims = spec.pool_dims
    shape = CacheShape.of(SimpleNamespace(model=model, dtype=dtype, cache_spec=spec))
    widest = max(h * d for h, d in dims)
    per = 2 * dtype.size  # K and V
    print(
        f"layers: {len(model.layers)}, holding K/V: {len(dims)}; "
        f"pool shapes (kv_heads, head_dim): {dict(Counter(dims))}"
    )
    print(f"mlxpaged's pools: {shape.bytes_per_block(16) // 16:,} bytes per token ({a.dtype})")
    print(f"one shape, the widest row, on the {len(dims)} pool layers: {per * len(dims) * widest:,}")
    print(f"one shape, the widest row, on all {len(model.layers)} layers: {per * len(model.layers) * widest:,}")
    print(f"mlx-lm's make_prompt_cache: {dict(Counter(type(c).__name__ for c in make_prompt_cache(model)))}")


if __name__ == "__main__":
    main()
