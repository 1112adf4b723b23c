"""Every mlx-lm model type on the paged cache: one tiny checkpoint each (mlxpaged.testing.zoo),
mlxpaged's greedy tokens against mlx-lm's `generate_step` at block 16 and at block 4 with 7-token
chunks. Prints one line per type and the counts.

    python scripts/zoo_report.py [--tokens 8] [--markdown] [TYPE ...]

--markdown prints a table row per type instead (type, mlx-lm module, kind, result), as
docs/models.md lists them.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import mlxpaged  # noqa: F401  (before mlx)
from mlxpaged.testing.zoo import PROMPT, model_types, write_zoo

# (block size, tokens per step): whole-prompt prefill on blocks of 16; chunks of 7 over blocks of 4
SETTINGS = ((16, 2048), (4, 7))


def reference_tokens(model, prompt_ids: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy tokens: `generate_step` on the caches of its `make_prompt_cache`."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    steps = generate_step(mx.array(prompt_ids), model, max_tokens=n, prompt_cache=make_prompt_cache(model))
    return [int(t) for t, _ in steps]


def paged_tokens(loaded, prompt_ids: list[int], n: int, block_size: int, chunk: int) -> list[int]:
    """mlxpaged's greedy tokens for one prompt (reference attention, `chunk` tokens a step)."""
    from mlxpaged import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig.of(
        block_size=block_size, num_blocks=64, max_num_batched_tokens=chunk, attention_impl="reference"
    )
    engine = LLMEngine(loaded, config)
    rid = engine.add_request(prompt_ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
    return list(out.outputs[0].token_ids)


def verdict(path: Path, n: int = 8) -> tuple[str, str]:
    """("exact" | "refused" | "differs" | "crashes" | "reference fails", detail) for the checkpoint
    at `path`: mlxpaged's greedy tokens in both SETTINGS against mlx-lm's `reference_tokens`."""
    import mlx_lm

    from mlxpaged.errors import MlxPagedError
    from mlxpaged.loading.loader import load

    # mlxpaged's refusal first: a refused type's own module is not run (mlx-lm's phi3small, run
    # on the CPU, has corrupted this process's heap)
    try:
        loaded = load(str(path), "float32")
    except MlxPagedError as e:
        return "refused", str(e)
    except Exception as e:
        return "crashes", f"load: {type(e).__name__}: {str(e)[:200]}"
    try:
        ref_model, tok = mlx_lm.load(str(path))
        ids = tok.encode(PROMPT)
        want = reference_tokens(ref_model, ids, n)
    except Exception as e:  # mlx-lm itself cannot run this tiny checkpoint
        return "reference fails", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    try:
        for block, chunk in SETTINGS:
            got = paged_tokens(loaded, ids, n, block, chunk)
            if got != want:
                return "differs", f"block {block}, chunk {chunk}: {got} != mlx-lm's {want}"
    except Exception as e:
        return "crashes", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return "exact", ""


def module_of(model_type: str) -> str:
    from mlx_lm import utils

    return getattr(utils, "MODEL_REMAPPING", {}).get(model_type, model_type)


def structure(path: Path, model_type: str) -> str:
    """The architecture in words, from the module's own model and caches (the zoo's checkpoint config)."""
    import json

    from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, RotatingKVCache, make_prompt_cache

    from mlxpaged.models.paged_adapter import cache_spec, family_module

    try:
        config = json.loads((path / "config.json").read_text())
        module = family_module(model_type)
        model = module.Model(module.ModelArgs.from_dict(config))
        caches = make_prompt_cache(model)
    except (Exception, SystemExit):
        return "-"
    kinds = []
    if any(isinstance(c, ArraysCache) for c in caches):
        kinds.append("recurrent (linear attention / state space)")
    if any(isinstance(c, CacheList) for c in caches):
        kinds.append("two caches per layer")
    if any(isinstance(c, RotatingKVCache) for c in caches):
        kinds.append("sliding window")
    if any(isinstance(c, ChunkedKVCache) for c in caches):
        kinds.append("chunked attention")
    try:
        if cache_spec(model).latent:
            kinds.append("latent attention (MLA)")
    except Exception:  # noqa: BLE001 - no layers to look at
        pass
    names = {type(m).__name__ for _, m in model.named_modules()}
    if any("moe" in n.lower() or "switch" in n.lower() or "expert" in n.lower() for n in names):
        kinds.append("MoE")
    if "language_model" in model:
        kinds.append("text model of a multimodal wrapper")
    return ", ".join(kinds) or "dense attention"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="*", help="model types (default: all)")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--markdown", action="store_true", help="a table row per type")
    args = ap.parse_args()
    types = args.types or model_types()
    counts = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for t in types:
            t0 = time.perf_counter()
            path = Path(tmp) / t
            try:
                write_zoo(path, t)
                kind, detail = verdict(path, args.tokens)
            except (Exception, SystemExit) as e:
                kind, detail = "no checkpoint", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            counts[kind] += 1
            if args.markdown:
                result = "runs (mlx-lm's exact tokens)" if kind == "exact" else f"{kind}: {detail.split(' in /')[0]}"
                print(f"| `{t}` | `{module_of(t)}` | {structure(path, t)} | {result} |", flush=True)
            else:
                print(f"{t:24s} {kind:15s} {time.perf_counter() - t0:5.1f}s  {detail}", flush=True)
    print(f"\n{len(types)} types: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
