"""The quantized paged KV cache (`kv_bits` 8 or 4, `kv_group_size` 32 or 64).

- Attention: the reference over `QuantizedPool`s against SDPA on contiguous, `mx.dequantize`d
  K/V (numpy gathers), over the shape matrix of test_paged_attention / test_varlen; and two
  mutants of the dequantization (wrong group, scales and biases swapped) that must fail it.
- Writes and copies: pool rows against `mx.quantize` of the written rows.
- Key offsets: against a numpy RoPE of the k_proj bias; attention does not see them. Key
  scales: against numpy's per-channel spread of mlx-lm's contiguous keys over the calibration text.
- The engine: against mlx-lm's contiguous cache holding K/V rounded exactly as the quantized
  pools round them (offset keys over the scales, then `mx.quantize`/`mx.dequantize`; attention
  is mlx-lm's own) and the float cache on the tiny model; prefix caching and forked samples
  unchanged.
- Pool sizing against row-byte arithmetic done here; bad settings give one-line errors.
"""

import itertools
import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.attention import kv_quant, paged_attention, paged_attention_varlen
from mlxpaged.attention.kv_quant import QuantizedPool
from mlxpaged.cli.main import main
from mlxpaged.worker.kv_cache import CacheShape, PagedKVCache, blocks_for_memory
from mlxpaged.worker.kv_calibration import calibration_ids, key_scales

from attention_cases import (  # noqa: E402
    CASES,
    make_case,
    make_varlen_case,
    numpy_key_offsets,
    numpy_key_scales,
    rounded_caches,  # noqa: E402
    sdpa_contiguous,
    sdpa_with_mask,
)
from reference import contiguous_generate

QUANT = list(itertools.product([8, 4], [32, 64]))  # (bits, group_size)


def quantize_pools(k, v, bits, gs):
    return QuantizedPool.quantize(k, bits, gs), QuantizedPool.quantize(v, bits, gs)


# -- attention ----------------------------------------------------------------------------------


def check_decode(rng, head_dim, group, block_size, lens, bits, gs, dtype=mx.float32, atol=2e-5, rtol=1e-4):
    q, k, v, t, c = make_case(rng, head_dim, group, block_size, lens, dtype=dtype)
    qk, qv = quantize_pools(k, v, bits, gs)
    dk, dv = qk.dequantize(), qv.dequantize()
    scale = head_dim**-0.5
    got = paged_attention(q, qk, qv, t, c, impl="reference")
    assert got.shape == q.shape and got.dtype == q.dtype
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731  (the independent SDPA in float32)
    want = sdpa_contiguous(f32(q), f32(dk), f32(dv), t, c, scale)
    np.testing.assert_allclose(np.array(f32(got)), np.array(want), atol=atol, rtol=rtol)
    # And the float reference on the dequantized pool: the quantized path is that, row for row.
    np.testing.assert_allclose(
        np.array(f32(got)), np.array(f32(paged_attention(q, dk, dv, t, c, impl="reference"))), atol=1e-6, rtol=1e-6
    )


def check_varlen(rng, head_dim, group, block_size, q_lens, prefixes, bits, gs, atol=3e-5):
    q, kc, vc, tables, cu, ctx = make_varlen_case(rng, head_dim, group, block_size, q_lens, prefixes)
    qk, qv = quantize_pools(mx.array(kc), mx.array(vc), bits, gs)
    dk, dv = np.array(qk.dequantize()), np.array(qv.dequantize())
    got = paged_attention_varlen(mx.array(q), qk, qv, mx.array(tables), mx.array(cu), mx.array(ctx), impl="reference")
    want = sdpa_with_mask(q, dk, dv, tables, cu, ctx, head_dim**-0.5)
    np.testing.assert_allclose(np.array(got), want, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("head_dim,group,block_size", list(itertools.product([64, 128], [1, 2, 6, 7], [1, 16, 256])))
def test_decode_reference_on_quantized_pools(head_dim, group, block_size):
    lens = [1, 256, 300, 37] if block_size == 256 else [1, block_size, 2 * block_size, 3 * block_size + 5, 37]
    rng = np.random.default_rng(head_dim * 100 + group * 10 + block_size)
    for bits, gs in QUANT:
        check_decode(rng, head_dim, group, block_size, lens, bits, gs)


@pytest.mark.parametrize("dtype,tol", [(mx.float16, 2e-3), (mx.bfloat16, 2e-2)])
@pytest.mark.parametrize("bits,gs", QUANT)
def test_decode_reference_on_quantized_pools_half(dtype, tol, bits, gs):
    """Scales and biases in the model's 16-bit dtype; the SDPA peer runs in float32."""
    rng = np.random.default_rng(bits + gs)
    check_decode(rng, 128, 7, 16, [1, 16, 53, 37], bits, gs, dtype=dtype, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "head_dim,group,block_size", list(itertools.product([64, 128], [1, 7], [1, 16])) + [(64, 2, 256)]
)
def test_varlen_reference_on_quantized_pools(head_dim, group, block_size):
    rng = np.random.default_rng(head_dim + 10 * group + block_size)
    for (q_lens, prefixes), (bits, gs) in zip(CASES, QUANT):  # every case, every format
        check_varlen(rng, head_dim, group, block_size, q_lens, prefixes, bits, gs)


def _codes(data, bits, gs):
    """The raw codes of `data` as floats (unit scale, zero bias)."""
    n = data.shape[-1] * 32 // bits // gs
    ones = mx.ones(data.shape[:-1] + (n,), dtype=mx.float32)
    return mx.dequantize(data, ones, mx.zeros_like(ones), group_size=gs, bits=bits)


def wrong_group(data, scales, biases, bits, group_size):
    """Scales indexed as if groups had the other supported size (a kernel's index bug)."""
    codes = _codes(data, bits, group_size)
    other = 32 if group_size == 64 else 64
    idx = mx.minimum(mx.arange(codes.size) // other, scales.size - 1)
    s, b = (a.reshape(-1)[idx].reshape(codes.shape) for a in (scales, biases))
    return (codes * s + b).astype(scales.dtype)


def swapped(data, scales, biases, bits, group_size):
    return mx.dequantize(data, biases, scales, group_size=group_size, bits=bits)


@pytest.mark.parametrize("mutant", [wrong_group, swapped])
@pytest.mark.parametrize("bits,gs", QUANT)
def test_mutants_fail_the_reference_check(monkeypatch, mutant, bits, gs):
    """The checks above catch a reference that dequantizes wrongly (decode and varlen alike)."""
    rng = np.random.default_rng(3)
    check_decode(rng, 128, 2, 16, [40, 17], bits, gs)  # the real one passes
    monkeypatch.setattr(kv_quant, "dequantize_rows", mutant)
    with pytest.raises(AssertionError):
        check_decode(rng, 128, 2, 16, [40, 17], bits, gs)
    with pytest.raises(AssertionError):
        check_varlen(rng, 128, 2, 16, [5, 1], [20, 9], bits, gs)


def test_reference_dequantizes_only_the_rows_it_reads(monkeypatch):
    rng = np.random.default_rng(4)
    q, k, v, t, c = make_case(rng, 64, 2, 16, [20, 5])
    pad = mx.zeros((200,) + k.shape[1:])  # a pool much larger than the tables use
    qk, qv = quantize_pools(mx.concatenate([k, pad]), mx.concatenate([v, pad]), 8, 64)
    seen = []
    real = kv_quant.dequantize_rows
    monkeypatch.setattr(kv_quant, "dequantize_rows", lambda d, *a: seen.append(d.shape) or real(d, *a))
    monkeypatch.setattr(QuantizedPool, "dequantize", lambda self: pytest.fail("the whole pool was dequantized"))
    paged_attention(q, qk, qv, t, c, impl="reference")
    rows = [int(np.prod(s[:-1])) for s in seen]
    assert rows == [t.size * 2 * 16] * 2  # K and V: the tables' blocks x kv heads x block size


def test_mixed_or_mismatched_pools_rejected():
    rng = np.random.default_rng(5)
    q, k, v, t, c = make_case(rng, 64, 2, 16, [20])
    with pytest.raises(ValueError, match="both"):
        paged_attention(q, QuantizedPool.quantize(k, 8, 64), v, t, c, impl="reference")
    with pytest.raises(ValueError, match="quantized differently"):
        paged_attention(q, QuantizedPool.quantize(k, 8, 64), QuantizedPool.quantize(v, 4, 64), t, c, impl="reference")


# -- writes and copies --------------------------------------------------------------------------


@pytest.mark.parametrize("bits,gs", QUANT)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_write_quantizes_rows_in_place(bits, gs, dtype):
    shape = CacheShape(2, 2, 64, dtype).quantized(bits, gs)
    cache = PagedKVCache(shape, 16, 4)
    rng = np.random.default_rng(bits * gs)
    slots = rng.choice(16 * 4, size=9, replace=False).astype(np.int32)
    k = mx.array(rng.normal(size=(9, 2, 64)).astype(np.float32))
    v = mx.array(rng.normal(size=(9, 2, 64)).astype(np.float32))
    cache.write(1, k, v, mx.array(slots))
    mx.eval(cache.arrays)
    for pool, x in ((cache.keys[1], k), (cache.values[1], v)):
        want = mx.quantize(x.astype(dtype), group_size=gs, bits=bits)
        for got_arr, want_arr in zip(pool.arrays, want):
            got = np.array(got_arr).reshape(16 * 4 // 4, 2, 4, -1)  # [blocks, heads, offset, ...]
            rows = np.stack([got[s // 4, :, s % 4] for s in slots])
            np.testing.assert_array_equal(rows, np.array(want_arr))
            untouched = np.ones(16 * 4, dtype=bool)
            untouched[slots] = False
            flat = got.transpose(0, 2, 1, 3).reshape(16 * 4, 2, -1)
            assert not flat[untouched].any()
        assert pool.scales.dtype == dtype
    assert all(not a.any().item() for p in cache.keys[:1] + cache.values[:1] for a in p.arrays)  # layer 0 unwritten
    assert cache.nbytes == sum(a.nbytes for a in cache.arrays)


def test_quantized_write_in_place():
    """A step's write scatters into the three arrays: no copy of a 38 MB pool, no growth."""
    cache = PagedKVCache(CacheShape(1, 2, 64, mx.float32).quantized(8, 64), 8192, 16)
    k = mx.random.normal((8, 2, 64))
    mx.eval(k)
    slots = mx.arange(8, dtype=mx.int32) * 16
    for step in range(30):
        if step == 10:
            base = mx.get_active_memory()
            mx.reset_peak_memory()
        cache.write(0, k, k, slots + step % 16)
        mx.eval(cache.arrays)
    assert mx.get_active_memory() - base < 64 * 1024 and mx.get_peak_memory() - base < cache.nbytes // 16


def test_copy_blocks_copies_codes_scales_and_biases():
    shape = CacheShape(2, 2, 64, mx.float32).quantized(4, 32)
    cache = PagedKVCache(shape, 8, 4)
    rng = np.random.default_rng(6)
    for layer in range(2):
        x = mx.array(rng.normal(size=(32, 2, 64)).astype(np.float32))
        cache.write(layer, x, -x, mx.arange(32, dtype=mx.int32))
    before = [np.array(a) for a in cache.arrays]
    cache.copy_blocks([(1, 5), (3, 0)])
    for old, new in zip(before, cache.arrays):
        want = old.copy()
        want[5], want[0] = old[1], old[3]
        np.testing.assert_array_equal(np.array(new), want)


# -- the engine ---------------------------------------------------------------------------------

PROMPTS = [
    "The KV cache stores",
    "Paged attention borrows an idea from operating systems:",
    "Write a Python function",
    "Blocks of sixteen tokens are found through a block table, one per sequence.",
]


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_all(engine):
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            engine.check_invariants()
            if o.finished:
                done[o.request_id] = o
    return done


def quantized_contiguous_generate(model, tokenizer, prompt_ids, max_tokens, bits, gs):
    """Greedy tokens and their top-2 logit gaps on mlx-lm's contiguous cache rounding K/V as the
    quantized paged cache does."""
    cache = rounded_caches(model, tokenizer, bits, gs)
    x, out, gaps = mx.array([prompt_ids]), [], []
    for _ in range(max_tokens):
        logits = np.array(model(x, cache=cache)[0, -1].astype(mx.float32))
        top2 = np.sort(logits)[-2:]
        out.append(int(logits.argmax()))
        gaps.append(float(top2[1] - top2[0]))
        x = mx.array([[out[-1]]])
    return out, gaps


def test_key_scales_match_contiguous_keys(tiny_loaded, mlx_lm_tiny):
    """The scales measured on the paged cache equal numpy's over mlx-lm's contiguous keys."""
    ref_model, tok = mlx_lm_tiny
    ids = calibration_ids(tok, ref_model.args.vocab_size)
    assert len(ids) > 100
    got = key_scales(tiny_loaded.model, tiny_loaded.cache_spec, ids)
    want = numpy_key_scales(ref_model, ids)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert g.shape == (2, 64) and w.max() / w.min() > 1.5  # the channels really differ
        np.testing.assert_allclose(np.array(g), w, rtol=2e-4)
    with pytest.raises(ValueError, match="calibration tokens"):
        key_scales(tiny_loaded.model, tiny_loaded.cache_spec, ids[:1])


def test_key_scales_are_measured_once_per_loaded_model(tiny_model_path, mlx_lm_tiny, monkeypatch):
    """Two quantized engines on one LoadedModel: one calibration pass; a fresh load measures again."""
    from mlxpaged.loading.loader import load
    from mlxpaged.worker import kv_calibration

    calls = []
    real = kv_calibration.key_scales
    monkeypatch.setattr(kv_calibration, "key_scales", lambda *a, **k: calls.append(1) or real(*a, **k))
    loaded = load(str(tiny_model_path), "float32")
    first = LLMEngine(loaded, EngineConfig.of(num_blocks=8, kv_bits=8)).kv_cache.key_scales
    second = LLMEngine(loaded, EngineConfig.of(num_blocks=8, kv_bits=4)).kv_cache.key_scales
    LLMEngine(loaded, EngineConfig.of(num_blocks=8))  # a float cache needs none
    assert len(calls) == 1 and all(a is b for a, b in zip(first, second))
    ref_model, tok = mlx_lm_tiny
    want = numpy_key_scales(ref_model, calibration_ids(tok, ref_model.args.vocab_size))
    for g, w in zip(second, want):
        np.testing.assert_allclose(np.array(g), w, rtol=2e-4)
    LLMEngine(load(str(tiny_model_path), "float32"), EngineConfig.of(num_blocks=8, kv_bits=8))
    assert len(calls) == 2


def test_key_offsets_match_numpy_rope(tiny_loaded, mlx_lm_tiny):
    got = kv_quant.key_offsets(tiny_loaded.model)
    want = numpy_key_offsets(mlx_lm_tiny[0])
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert g.shape == (2, 64) and np.abs(w).max() > 0.05
        np.testing.assert_allclose(np.array(g), w, atol=1e-5)


def test_attention_cannot_see_a_key_offset():
    """Keys less one constant per KV head give the same attention (softmax ignores the shift)."""
    rng = np.random.default_rng(8)
    for q_lens, prefixes in CASES[:2]:
        q, kc, vc, tables, cu, ctx = make_varlen_case(rng, 64, 7, 16, q_lens, prefixes)
        c = rng.normal(scale=50.0, size=(1, 2, 1, 64)).astype(np.float32)
        outs = [
            paged_attention_varlen(*(mx.array(a) for a in (q, k, vc, tables, cu, ctx)), impl="reference")
            for k in (kc, kc - c)
        ]
        np.testing.assert_allclose(np.array(outs[0]), np.array(outs[1]), atol=2e-4, rtol=1e-4)


def test_write_subtracts_key_offsets_and_divides_by_key_scales():
    shape = CacheShape(1, 2, 64, mx.float32).quantized(8, 32)
    rng = np.random.default_rng(9)
    off = mx.array(rng.normal(scale=30.0, size=(2, 64)).astype(np.float32))
    sc = rng.uniform(0.1, 10.0, size=(2, 64)).astype(np.float32)
    cache = PagedKVCache(shape, 4, 4, key_offsets=[off], key_scales=[mx.array(sc)])
    k = mx.random.normal((3, 2, 64), key=mx.random.key(1))
    cache.write(0, k, k, mx.array([0, 5, 9], dtype=mx.int32))
    want_k, want_v = mx.quantize((k - off) / mx.array(sc), group_size=32, bits=8), mx.quantize(k, group_size=32, bits=8)
    for pool, want in ((cache.keys[0], want_k), (cache.values[0], want_v)):
        for got, w in zip(pool.arrays, want):
            rows = np.stack([np.array(got)[s // 4, :, s % 4] for s in (0, 5, 9)])  # slot -> (block, offset)
            np.testing.assert_array_equal(rows, np.array(w))
    # Queries take the scales of their KV head: 7 query heads per KV head here.
    q = rng.normal(size=(5, 14, 64)).astype(np.float32)
    np.testing.assert_allclose(
        np.array(cache.scale_queries(0, mx.array(q))), q * np.repeat(sc, 7, axis=0)[None], rtol=1e-6
    )
    with pytest.raises(ValueError, match="key_offsets"):
        PagedKVCache(CacheShape(1, 2, 64, mx.float32), 4, 4, key_offsets=[off])
    with pytest.raises(ValueError, match="key_scales"):
        PagedKVCache(shape, 4, 4, key_scales=[mx.array(-sc)])
    with pytest.raises(ValueError, match="key_scales"):
        PagedKVCache(shape, 4, 4, key_scales=[mx.array(sc), mx.array(sc)])
    plain = PagedKVCache(shape, 4, 4)
    np.testing.assert_array_equal(np.array(plain.scale_queries(0, mx.array(q))), q)


@pytest.mark.parametrize("bits,gs", QUANT)
def test_engine_matches_contiguous_quantized_cache(tiny_loaded, mlx_lm_tiny, bits, gs):
    """Batched, block size 4 (tables interleave), chunked prefill: the tokens of mlx-lm's
    contiguous cache rounding K/V the same way, until its first near-tie (top-2 gap < 0.01)."""
    ref_model, tok = mlx_lm_tiny
    engine = LLMEngine(
        tiny_loaded,
        EngineConfig.of(
            num_blocks=128,
            block_size=4,
            max_num_batched_tokens=12,
            kv_bits=bits,
            kv_group_size=gs,
            attention_impl="reference",
        ),
    )
    rids = [engine.add_request(p, greedy(30)) for p in PROMPTS]
    done = run_all(engine)
    compared = 0
    for p, r in zip(PROMPTS, rids):
        want, gaps = quantized_contiguous_generate(ref_model, tok, tok.encode(p), 30, bits, gs)
        # Up to (and including) the first near-tie: past it either token is right and the runs may part.
        first_close = next((i for i, g in enumerate(gaps) if g < 0.01), len(gaps) - 1) + 1
        assert done[r].outputs[0].token_ids[:first_close] == want[:first_close]
        compared += first_close
    assert compared >= 60  # the comparison covers real ground


def test_8bit_greedy_agrees_with_float_cache(tiny_loaded, mlx_lm_tiny):
    """The tiny model's output layer (logit scale 4) leaves large top-2 gaps: 8-bit K/V keeps the float tokens."""
    ref_model, tok = mlx_lm_tiny
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=128, kv_bits=8, attention_impl="reference"))
    rids = [engine.add_request(p, greedy(40)) for p in PROMPTS]
    done = run_all(engine)
    for p, r in zip(PROMPTS, rids):
        assert done[r].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(p), 40)


def test_prefix_cache_on_equals_off_8bit(tiny_loaded):
    system = "You are a careful tutor. Answer with one short code block and one sentence. " * 2
    runs = []
    for caching in (True, False):
        engine = LLMEngine(
            tiny_loaded,
            EngineConfig.of(num_blocks=128, enable_prefix_caching=caching, kv_bits=8, attention_impl="reference"),
        )
        outs = {}
        for i, q in enumerate(["Reverse a list.", "Sum a list.", "Sort a dict by value."]):
            engine.add_request(system + q, greedy(16), request_id=str(i))  # one after another: later ones hit
            outs.update(run_all(engine))
        runs.append(
            ({k: o.outputs[0].token_ids for k, o in outs.items()}, [outs[str(i)].num_cached_tokens for i in range(3)])
        )
    (on, hits_on), (off, hits_off) = runs
    assert on == off
    assert hits_off == [0, 0, 0] and hits_on[0] == 0 and min(hits_on[1:]) >= 16


def test_forked_samples_equal_samples_run_alone_8bit(tiny_loaded):
    """n=4 seeded samples share the prompt's quantized blocks (copy-on-write of all three
    arrays); each gives the tokens of the same sample run as a request of its own."""
    from mlxpaged.engine.sampler import sample_key

    prompt = (tiny_loaded.tokenizer.encode(" ".join(PROMPTS)))[:42]  # the last block is partly filled: copies
    params = SamplingParams(n=4, temperature=0.9, seed=7, max_tokens=24, ignore_eos=True)
    cfg = dict(num_blocks=64, block_size=16, kv_bits=8, kv_group_size=32, attention_impl="reference")
    engine = LLMEngine(tiny_loaded, EngineConfig.of(**cfg))
    engine.add_request(prompt, params, request_id="group")
    group = run_all(engine)["group"].outputs
    assert engine.stats_dict()["cow_copies"] == 3
    assert len({tuple(c.token_ids) for c in group}) == 4  # the samples really differ
    for i in range(4):
        alone = LLMEngine(tiny_loaded, EngineConfig.of(**cfg))
        rid = alone.add_request(prompt, SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True))
        alone._requests[rid].seqs[0].rng_key = sample_key(7, i)  # sample i's stream; i = 0 is the request's own
        assert run_all(alone)[rid].outputs[0].token_ids == group[i].token_ids, i


def test_llm_api_kv_bits(tiny_model_path):
    from mlxpaged import LLM

    llm = LLM(str(tiny_model_path), kv_bits=4, kv_group_size=32, num_blocks=32, attention_impl="reference")
    out = llm.generate(["The KV cache stores"], greedy(5))
    assert len(out[0].outputs[0].token_ids) == 5
    assert all(isinstance(p, QuantizedPool) and p.bits == 4 and p.group_size == 32 for p in llm.engine.kv_cache.keys)


# -- pool sizing --------------------------------------------------------------------------------


@pytest.mark.parametrize("gs,ratio8,ratio4", [(64, (1.85, 1.95), (3.45, 3.6)), (32, (1.75, 1.8), (3.15, 3.25))])
def test_blocks_for_memory_counts_quantized_rows(monkeypatch, gs, ratio8, ratio4):
    """The 0.5B shape (24 layers, 2 KV heads, head_dim 64) in float16, 1 GB of memory."""
    import mlxpaged.worker.kv_cache as kvc

    monkeypatch.setattr(kvc, "available_memory", lambda: 10**9)
    base = CacheShape(24, 2, 64, mx.float16)
    blocks = {b: blocks_for_memory(base.quantized(b, gs), 16, 1.0, 10**12) for b in (None, 8, 4)}
    for bits in (None, 8, 4):
        # one row: head_dim codes of `bits` (16: float16 values), plus a float16 scale and bias per group
        row = 64 * 2 if bits is None else 64 * bits // 8 + (64 // gs) * 2 * 2
        assert blocks[bits] == 10**9 // (2 * 24 * 2 * 16 * row)
        assert base.quantized(bits, gs).bytes_per_block(16) == 2 * 24 * 2 * 16 * row
    assert ratio8[0] < blocks[8] / blocks[None] < ratio8[1]
    assert ratio4[0] < blocks[4] / blocks[None] < ratio4[1]


def test_quantized_pool_bytes_match_its_arrays():
    shape = CacheShape(3, 2, 128, mx.float16).quantized(4, 64)
    cache = PagedKVCache(shape, 5, 8)
    assert cache.nbytes == sum(a.nbytes for a in cache.arrays) == 5 * 2 * 3 * 2 * 8 * (64 + 2 * 2 * 2)


# -- settings and the command line --------------------------------------------------------------


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="kv_bits"):
        EngineConfig.of(kv_bits=3)
    with pytest.raises(ValueError, match="kv_group_size"):
        EngineConfig.of(kv_bits=8, kv_group_size=48)
    with pytest.raises(ValueError, match="kv_group_size"):
        EngineConfig.of(kv_group_size=48)  # a typo even without kv_bits
    with pytest.raises(ValueError, match="head_dim 32"):
        CacheShape(1, 2, 32, mx.float32).quantized(8, 64)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--kv-bits", "3"], "kv_bits must be one of"),
        (["--kv-bits", "8", "--kv-group-size", "48"], "kv_group_size must be one of"),
    ],
)
def test_cli_bad_kv_settings_one_line_error(tiny_model_path, args, message):
    r = CliRunner().invoke(main, ["generate", "--model", str(tiny_model_path), "--prompt", "hi", *args])
    assert r.exit_code == 1 and "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], r.stderr


def test_cli_generate_kv_bits(tiny_model_path, tiny_loaded):
    prompt = "Paged attention borrows an idea from operating systems"
    r = CliRunner().invoke(
        main,
        [
            "generate",
            "--model",
            str(tiny_model_path),
            "--prompt",
            prompt,
            "--no-chat",
            "-t",
            "12",
            "--ignore-eos",
            "--kv-bits",
            "8",
            "--attention",
            "reference",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    st = data["stats"]
    assert (st["kv_bits"], st["kv_group_size"]) == (8, 64)
    # K and V, 2 layers, 2 KV heads, 16 slots, rows of 64 one-byte codes + a float32 scale and bias
    assert st["pool_gb"] * 1e9 == pytest.approx(st["num_blocks"] * 2 * 2 * 2 * 16 * (64 + 8), rel=1e-6)
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=8, kv_bits=8, attention_impl="reference"))
    rid = engine.add_request(tiny_loaded.tokenizer.encode(prompt), greedy(12))
    assert data["outputs"][0]["token_ids"] == run_all(engine)[rid].outputs[0].token_ids
    r = CliRunner().invoke(
        main,
        [
            "generate",
            "--model",
            str(tiny_model_path),
            "--prompt",
            prompt,
            "-t",
            "4",
            "--kv-bits",
            "4",
            "--kv-group-size",
            "32",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "4-bit K/V, group 32" in r.stdout
