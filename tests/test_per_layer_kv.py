"""Per-layer KV shapes (Gemma 4): pools of different widths per layer and layers
that attend to another layer's K/V, against mlx-lm's own gemma4_text on its own `make_prompt_cache`
(a RotatingKVCache on each sliding layer, no cache at all on the KV-shared layers).

The tiny checkpoint (tiny_model.FAMILY_CONFIGS["gemma4_text"]): four layers, sliding (0, 2) with
2 KV heads of 32 and full (1, 3) with one KV head of 128 whose values are its key projection;
layers 2 and 3 reuse the K/V of 0 and 1. tests/test_families.py runs it through the ragged,
copy-on-write, preemption and 8-bit family tests.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlxpaged import LLM, BeamSearchParams, EngineConfig, LLMEngine, SamplingParams
from mlxpaged.loading.loader import load
from mlxpaged.testing.tiny_model import write_tiny_family
from mlxpaged.worker.kv_cache import CacheShape

from drive import run_all
from reference import contiguous_generate, reference_beam_search

SYSTEM = "Paged attention borrows an idea from operating systems: virtual memory and paging. "
LONG = SYSTEM + "Copy-on-write lets many samples share the blocks of one prompt until they diverge."


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """(path, loaded, mlx-lm's model, tokenizer) per sliding window: below, at and above a block of 4."""
    out = {}
    for w in (3, 4, 9):
        path = write_tiny_family(tmp_path_factory.mktemp(f"gemma4_w{w}"), "gemma4_text", sliding_window=w)
        ref_model, tok = mlx_lm.load(str(path))
        out[w] = (path, load(str(path), "float32"), ref_model, tok)
    return out


def _engine(loaded, **kw):
    return LLMEngine(
        loaded, EngineConfig.of(**{"block_size": 4, "num_blocks": 96, "attention_impl": "reference", **kw})
    )


def test_each_layer_pool_has_its_own_shape_and_shared_layers_have_none(gemma4):
    path, loaded, ref_model, _ = gemma4[4]
    cfg = json.loads((path / "config.json").read_text())
    engine = _engine(loaded, num_blocks=10)
    # mlx-lm's own caches: one per layer that writes K/V, none for the KV-shared layers.
    ref = make_prompt_cache(ref_model)
    assert [type(c) for c in ref] == [RotatingKVCache, KVCache]
    shared = cfg["num_kv_shared_layers"]
    assert len(engine.kv_cache.keys) == len(engine.kv_cache.values) == cfg["num_hidden_layers"] - shared
    sliding = (cfg["num_key_value_heads"], cfg["head_dim"])
    full = (cfg["num_global_key_value_heads"], cfg["global_head_dim"])
    assert [tuple(p.shape) for p in engine.kv_cache.keys] == [
        (10, sliding[0], 4, sliding[1]),
        (10, full[0], 4, full[1]),
    ]
    # Bytes per block from the config alone (float32 K and V rows), and as the pools hold them.
    want = 2 * 4 * 4 * (sliding[0] * sliding[1] + full[0] * full[1])
    assert engine.cache_shape.bytes_per_block(4) == want
    assert sum(a.nbytes for a in engine.kv_cache.arrays) == 10 * want


@pytest.mark.parametrize("window", [3, 4, 9])
def test_windows_chunked_prefill_and_prefix_hits_match_mlx_lm(gemma4, window):
    """Prefill chunks of 8 over blocks of 4, a prompt and generation several windows long; the
    second request starts from the first one's cached blocks."""
    _, loaded, ref_model, tok = gemma4[window]
    engine = _engine(loaded, max_num_batched_tokens=8)
    first = engine.add_request(SYSTEM, greedy(24))
    done = run_all(engine)
    second = engine.add_request(LONG, greedy(24))
    done |= run_all(engine)
    assert len(tok.encode(LONG)) + 24 >= 5 * window
    assert done[second].num_cached_tokens >= 8
    for rid, prompt in ((first, SYSTEM), (second, LONG)):
        assert done[rid].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(prompt), 24), window


def test_llm_api_gives_mlx_lm_tokens(gemma4):
    path, _, ref_model, tok = gemma4[4]
    llm = LLM(str(path), block_size=4, num_blocks=64, dtype="float32")
    outs = llm.generate([SYSTEM, LONG], greedy(12))
    for prompt, o in zip([SYSTEM, LONG], outs):
        assert o.outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(prompt), 12)


@pytest.mark.parametrize("width", [2, 4])
def test_beams_match_a_beam_search_on_mlx_lm_caches(gemma4, width):
    _, loaded, ref_model, tok = gemma4[3]
    engine = _engine(loaded)
    prompt = tok.encode(SYSTEM)
    rid = engine.add_beam_request(prompt, BeamSearchParams(beam_width=width, max_tokens=10, ignore_eos=True))
    got = run_all(engine)[rid]
    want = reference_beam_search(ref_model, prompt, width, 10)
    assert [c.token_ids for c in got.outputs] == [toks for _, toks, _ in want]
    assert engine.stats_dict()["beam_forks"] > 0


def test_ngram_speculation_rolls_back_on_both_pool_shapes(gemma4):
    _, loaded, ref_model, tok = gemma4[3]
    phrase = tok.encode(" the cache stores blocks of keys")
    prompt = phrase * 4 + phrase[:3]  # ends inside the phrase: the first decode step has proposals
    engine = _engine(loaded, speculative="ngram", num_speculative_tokens=3, prompt_lookup_min=1, async_scheduling=False)
    rid = engine.add_request(prompt, greedy(32))
    assert run_all(engine)[rid].outputs[0].token_ids == contiguous_generate(ref_model, prompt, 32)
    assert engine.stats.spec_proposed_tokens > engine.stats.spec_accepted_tokens  # some were rejected


def test_disk_tier_stores_and_loads_pools_of_two_widths(gemma4, tmp_path):
    _, loaded, ref_model, tok = gemma4[9]
    d = str(tmp_path / "cache")
    first = _engine(loaded, prefix_cache_dir=d)
    first.add_request(SYSTEM, greedy(3))
    run_all(first)
    first.prefix_store.flush()
    second = _engine(loaded, prefix_cache_dir=d)
    rid = second.add_request(LONG, greedy(12))
    done = run_all(second)[rid]
    assert done.num_cached_tokens >= 8
    assert done.outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(LONG), 12)


def test_8bit_pools_equal_a_reference_rounding_kv_as_they_do(gemma4, monkeypatch):
    """Each pool quantizes its own rows (groups of 32 over head_dim 32 and 128): with the key scales
    off, the tokens are exactly those of mlx-lm's model whose caches round each K/V row the same way."""
    import mlx_lm.models.cache as mlx_cache

    import mlxpaged.engine.parts as parts

    _, loaded, ref_model, tok = gemma4[4]
    monkeypatch.setattr(parts, "model_key_scales", lambda loaded: None)
    engine = _engine(loaded, kv_bits=8, kv_group_size=32)
    prompts = [SYSTEM, LONG]
    rids = [engine.add_request(p, greedy(24)) for p in prompts]
    done = run_all(engine)

    def rounded(x):
        return mx.dequantize(*mx.quantize(x, group_size=32, bits=8), group_size=32, bits=8)

    for cls in (mlx_cache.KVCache, mlx_cache.RotatingKVCache):
        original = cls.update_and_fetch
        monkeypatch.setattr(cls, "update_and_fetch", lambda self, k, v, f=original: f(self, rounded(k), rounded(v)))
    for p, r in zip(prompts, rids):
        assert done[r].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(p), 24)


def test_cache_shape_checks_each_layers_head_dim():
    shape = CacheShape(2, 2, 32, mx.float16, layer_dims=((2, 32), (1, 64)))
    assert shape.quantized(8, 32).kv_group_size == 32
    with pytest.raises(ValueError, match="32"):
        shape.quantized(8, 64)  # a group of 64 does not fit the sliding layers' head_dim of 32
    with pytest.raises(ValueError, match="layer_dims has 1 entries for 2 layers"):
        CacheShape(2, 2, 32, mx.float16, layer_dims=((2, 32),))
    assert CacheShape(3, 2, 32, mx.float16).layer_dims == ((2, 32),) * 3


@pytest.mark.parametrize("window", [3, 9])
def test_gemma3n_shared_layers_read_their_source_cache(tmp_path, window):
    """Gemma 3n hands a KV-shared layer its source layer's cache object (`keys_and_values`, then
    attention with `cache=` it): the paged cache's pools and window serve both layers. Chunked
    prefill over blocks of 4 and a prefix hit, against mlx-lm's own model and caches."""
    path = write_tiny_family(tmp_path / "g3n", "gemma3n", sliding_window=window)
    ref_model, tok = mlx_lm.load(str(path))
    loaded = load(str(path), "float32")
    assert len(make_prompt_cache(ref_model)) == 2 and len(loaded.model.layers) == 4
    engine = _engine(loaded, max_num_batched_tokens=8)
    assert len(engine.kv_cache.keys) == 2
    first = engine.add_request(SYSTEM, greedy(16))
    done = run_all(engine)
    second = engine.add_request(LONG, greedy(16))
    done |= run_all(engine)
    assert done[second].num_cached_tokens >= 8
    for rid, prompt in ((first, SYSTEM), (second, LONG)):
        assert done[rid].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(prompt), 16), window
