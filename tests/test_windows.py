"""Sliding windows and attention sinks: the reference ops against numpy, and the windowed
families (gemma3_text, gpt_oss, olmo3) against mlx-lm's own model on its own `make_prompt_cache`
(a RotatingKVCache on each windowed layer) at windows smaller than, equal to and larger than a
block, on prompts several times longer than the window. tests/test_families.py runs the same
families through the ragged / copy-on-write / 8-bit machinery.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxpaged import LLM, EngineConfig, LLMEngine, SamplingParams
from mlxpaged.attention import paged_attention, paged_attention_varlen
from mlxpaged.attention.kv_quant import QuantizedPool
from mlxpaged.loading.loader import load
from mlxpaged.testing.tiny_model import write_tiny_family

from attention_cases import make_varlen_case
from drive import run_all
from reference import contiguous_generate

SYSTEM = "Paged attention borrows an idea from operating systems: virtual memory and paging. "
LONG = SYSTEM + "Copy-on-write lets many samples share the blocks of one prompt until they diverge."


def numpy_attention(q, kc, vc, tables, cu, ctx, scale, window, sinks, chunk=None, softcap=None):
    """Per token, float64: softmax over the keys at positions (p - window, p] (or, with a chunk,
    [p - p % chunk, p]) plus a sink logit per query head that has no value; grouped-query heads
    read KV head h // group; with `softcap`, each logit s is `softcap * tanh(s / softcap)`."""
    bs, kvh = kc.shape[2], kc.shape[1]
    group = q.shape[1] // kvh
    out = np.zeros(q.shape, dtype=np.float64)
    for s in range(len(ctx)):
        n, c = cu[s + 1] - cu[s], ctx[s]
        k = np.stack([kc[tables[s][p // bs], :, p % bs] for p in range(c)], axis=1).astype(np.float64)  # [kvh, c, d]
        v = np.stack([vc[tables[s][p // bs], :, p % bs] for p in range(c)], axis=1).astype(np.float64)
        for j in range(n):
            p = c - n + j
            lo = 0 if window is None else max(0, p - window + 1)
            lo = lo if chunk is None else p - p % chunk
            for h in range(q.shape[1]):
                logits = k[h // group, lo : p + 1] @ q[cu[s] + j, h].astype(np.float64) * scale
                if softcap is not None:
                    logits = softcap * np.tanh(logits / softcap)
                m = logits.max() if sinks is None else max(logits.max(), sinks[h])
                w = np.exp(logits - m)
                denom = w.sum() + (0.0 if sinks is None else np.exp(sinks[h] - m))
                out[cu[s] + j, h] = w @ v[h // group, lo : p + 1] / denom
    return out


# Decodes and chunks mixed, with cached prefixes; windows below, at and above the block size (4).
Q_LENS, PREFIXES = [1, 7, 1, 12], [20, 9, 3, 0]


@pytest.mark.parametrize("window", [None, 1, 3, 4, 9, 64])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("bits", [None, 8])
def test_reference_window_and_sinks_match_numpy(window, with_sinks, bits):
    rng = np.random.default_rng(7)
    q, kc, vc, tables, cu, ctx = make_varlen_case(rng, 64, 2, 4, Q_LENS, PREFIXES)
    sinks = rng.normal(1.0, 1.5, size=q.shape[1]).astype(np.float32) if with_sinks else None
    k, v = mx.array(kc), mx.array(vc)
    if bits:  # the quantized pool's rows are compared against numpy on the same dequantized rows
        k, v = QuantizedPool.quantize(k, bits, 32), QuantizedPool.quantize(v, bits, 32)
        kc, vc = np.array(k.dequantize()), np.array(v.dequantize())
    got = paged_attention_varlen(
        mx.array(q),
        k,
        v,
        mx.array(tables),
        mx.array(cu),
        mx.array(ctx),
        scale=0.125,
        impl="reference",
        window=window,
        sinks=None if sinks is None else mx.array(sinks),
    )
    want = numpy_attention(q, kc, vc, tables, cu, ctx, 0.125, window, sinks)
    np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1, 3, 4, 8])
@pytest.mark.parametrize("bits", [None, 8])
def test_reference_chunks_match_numpy(chunk, bits):
    """Chunked local attention (Llama 4): each token sees only its own chunk's positions up to its
    own, at chunks below, at and above the block size (4), decodes and prefill chunks mixed."""
    rng = np.random.default_rng(11)
    q, kc, vc, tables, cu, ctx = make_varlen_case(rng, 64, 2, 4, Q_LENS, PREFIXES)
    k, v = mx.array(kc), mx.array(vc)
    if bits:
        k, v = QuantizedPool.quantize(k, bits, 32), QuantizedPool.quantize(v, bits, 32)
        kc, vc = np.array(k.dequantize()), np.array(v.dequantize())
    args = (mx.array(q), k, v, mx.array(tables), mx.array(cu), mx.array(ctx))
    for impl in ("reference", "metal"):  # no kernel takes a chunk: "metal" takes the reference
        got = paged_attention_varlen(*args, scale=0.125, impl=impl, chunk=chunk)
        want = numpy_attention(q, kc, vc, tables, cu, ctx, 0.125, None, None, chunk)
        np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="chunk must be a positive int without a window"):
        paged_attention_varlen(*args, impl="reference", chunk=chunk, window=3)


@pytest.mark.parametrize("window", [None, 3])
def test_reference_softcap_matches_numpy(window):
    """Logit soft-capping (Gemma 2) at a cap below the scores' spread, decodes and prefill chunks
    mixed; "metal" takes the reference (no kernel caps); a cap with sinks is refused."""
    rng = np.random.default_rng(13)
    q, kc, vc, tables, cu, ctx = make_varlen_case(rng, 64, 2, 4, Q_LENS, PREFIXES)
    args = (mx.array(q), mx.array(kc), mx.array(vc), mx.array(tables), mx.array(cu), mx.array(ctx))
    want = numpy_attention(q, kc, vc, tables, cu, ctx, 0.5, window, None, softcap=1.0)
    assert np.abs(want - numpy_attention(q, kc, vc, tables, cu, ctx, 0.5, window, None)).max() > 0.01
    for impl in ("reference", "metal"):
        got = paged_attention_varlen(*args, scale=0.5, impl=impl, window=window, softcap=1.0)
        np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="softcap must be positive and without sinks"):
        paged_attention_varlen(*args, impl="reference", softcap=1.0, sinks=mx.zeros((q.shape[1],)))


def test_window_and_sinks_reach_the_kernels(monkeypatch):
    """With impl="metal" a decode call with a window or sinks (the decode op, or a varlen call
    whose sequences all have one new token) goes to the decode kernel wrapper with them; a varlen
    call with multi-token chunks to the varlen kernel wrapper with them."""
    import mlxpaged.attention.metal as metal
    import mlxpaged.attention.metal_varlen as metal_varlen

    seen, seen_varlen = [], []

    def spy(q, k, v, bt, cl, *, scale, window=None, sinks=None, **kw):
        seen.append((window, sinks is not None))
        return paged_attention(q, k, v, bt, cl, scale=scale, impl="reference", window=window, sinks=sinks)

    def spy_varlen(q, k, v, bt, cu, cl, *, scale, window=None, sinks=None):
        seen_varlen.append((window, sinks is not None))
        return paged_attention_varlen(q, k, v, bt, cu, cl, scale=scale, impl="reference", window=window, sinks=sinks)

    monkeypatch.setattr(metal, "paged_attention_metal", spy)
    monkeypatch.setattr(metal_varlen, "paged_attention_varlen_metal", spy_varlen)
    monkeypatch.setattr(metal_varlen, "varlen_usable", lambda *a: True)  # (its check: test_metal_varlen_window)
    rng = np.random.default_rng(1)
    q, kc, vc, tables, cu, ctx = (mx.array(a) for a in make_varlen_case(rng, 64, 2, 4, Q_LENS, PREFIXES))
    for kw in ({"window": 3}, {"sinks": mx.ones((q.shape[1],))}):
        seen.clear()
        seen_varlen.clear()
        want = paged_attention_varlen(q, kc, vc, tables, cu, ctx, impl="reference", **kw)
        assert mx.array_equal(paged_attention_varlen(q, kc, vc, tables, cu, ctx, impl="metal", **kw), want)
        assert seen == [] and seen_varlen == [(kw.get("window"), "sinks" in kw)]  # chunks: the varlen kernel
        dq = q[cu[1:] - 1]  # one query per sequence: the decode op
        want = paged_attention(dq, kc, vc, tables, ctx, impl="reference", **kw)
        assert mx.array_equal(paged_attention(dq, kc, vc, tables, ctx, impl="metal", **kw), want)
        ones = mx.arange(len(Q_LENS) + 1, dtype=mx.int32)
        assert mx.array_equal(paged_attention_varlen(dq, kc, vc, tables, ones, ctx, impl="metal", **kw), want)
        assert seen == [(kw.get("window"), "sinks" in kw)] * 2 and len(seen_varlen) == 1


def test_bad_window_or_sinks_are_refused():
    rng = np.random.default_rng(2)
    q, kc, vc, tables, cu, ctx = (mx.array(a) for a in make_varlen_case(rng, 64, 2, 4, [1], [5]))
    with pytest.raises(ValueError, match="window must be a positive int"):
        paged_attention_varlen(q, kc, vc, tables, cu, ctx, impl="reference", window=0)
    with pytest.raises(ValueError, match="one logit per query head"):
        paged_attention(q, kc, vc, tables, ctx, impl="reference", sinks=mx.zeros((3,)))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """gpt-oss (windowed and full layers, per-head sinks, MoE) at windows 3, 4 and 9."""
    import mlx_lm

    out = {}
    for window in (3, 4, 9):
        path = write_tiny_family(tmp_path_factory.mktemp(f"gpt_oss_{window}"), "gpt_oss", sliding_window=window)
        out[window] = (path, load(str(path), "float32"), *mlx_lm.load(str(path)))
    return out


@pytest.mark.parametrize("window", [3, 4, 9])
def test_windowed_chunked_prefill_and_prefix_hits_match_mlx_lm(gpt_oss, window):
    """Block size 4, prefill chunks of 8 (a window straddles chunk and block boundaries), a
    prompt and generation many windows long; the second request starts from a prefix hit."""
    _, loaded, ref_model, tok = gpt_oss[window]
    engine = LLMEngine(
        loaded, EngineConfig.of(block_size=4, num_blocks=96, max_num_batched_tokens=8, attention_impl="reference")
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first = engine.add_request(SYSTEM, params)
    done = run_all(engine)
    second = engine.add_request(LONG, params)
    done |= run_all(engine)
    assert len(tok.encode(LONG)) + 24 >= 5 * window
    assert done[second].num_cached_tokens >= 8
    for rid, prompt in ((first, SYSTEM), (second, LONG)):
        assert done[rid].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(prompt), 24), window


def test_llm_api_gives_mlx_lm_tokens_for_a_windowed_family(gpt_oss):
    path, _, ref_model, tok = gpt_oss[4]
    llm = LLM(str(path), block_size=4, num_blocks=64, dtype="float32")
    outs = llm.generate([SYSTEM, LONG], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, o in zip([SYSTEM, LONG], outs):
        assert o.outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(prompt), 12)


def test_no_key_offsets_on_layers_with_sinks(gpt_oss):
    """A quantized cache stores keys less a per-head constant c (kv_quant.key_offsets), which
    shifts a query's scores by q.c: invisible to softmax, but not to a sink logit, which does not
    shift. So gpt-oss's layers (k_proj biases, which would get offsets, and sinks) get none."""
    from mlxpaged.attention.kv_quant import key_offsets

    model = gpt_oss[4][1].model
    assert all(layer.self_attn.k_proj.get("bias") is not None for layer in model.layers)
    assert key_offsets(model) == [None] * len(model.layers)
    # The shift itself: scores less q.c with a sink is not the same attention (numpy).
    rng = np.random.default_rng(3)
    q, k, c, v = rng.normal(size=8), rng.normal(size=(5, 8)), rng.normal(size=8), rng.normal(size=(5, 3))

    def attend(scores, sink):
        w = np.exp(np.append(scores, sink))
        return (w[:-1] / w.sum()) @ v

    assert not np.allclose(attend(k @ q, 1.0), attend((k - c) @ q, 1.0))


def test_ngram_speculation_on_a_windowed_family_gives_plain_decoding(gpt_oss):
    """Verification rows are varlen rows: the window masks them, and a rejected slot rolls back,
    for the windowed layers too (greedy: the tokens equal mlx-lm's)."""
    _, loaded, ref_model, tok = gpt_oss[3]
    engine = LLMEngine(
        loaded,
        EngineConfig.of(
            block_size=4, num_blocks=96, speculative="ngram", num_speculative_tokens=3, attention_impl="reference"
        ),
    )
    ids = tok.encode(LONG)
    # The lookup proposes what followed the last tokens before: the model's own continuation
    # (accepted) in one prompt; in the other its first 2 tokens, then the prompt reversed
    # (rejected, so slots roll back).
    cont = contiguous_generate(ref_model, ids, 16)
    prompts = [ids + cont + ids, ids + cont[:2] + ids[::-1][:14] + ids]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    done, rids = {}, []
    for p in prompts:  # one at a time (speculation pauses in larger batches)
        rids.append(engine.add_request(p, params))
        done |= run_all(engine)
    st = engine.stats_dict()
    assert st["spec_accepted_tokens"] > 0 and st["spec_proposed_tokens"] > st["spec_accepted_tokens"], st
    for p, r in zip(prompts, rids):
        assert done[r].outputs[0].token_ids == contiguous_generate(ref_model, p, 24)


@pytest.mark.parametrize("chunk", [3, 4, 9])
def test_llama4_chunks_match_mlx_lm(tmp_path, chunk):
    """Llama 4 (chunked layers 0-2, a global NoPE layer with position-scaled queries, MoE, under
    `language_model`) at chunks below, at and above the block size, on a prompt several chunks
    long, prefilled in chunks of 5 that end mid-block and mid-chunk, with a prefix hit: mlx-lm's
    greedy tokens on its own `make_prompt_cache` (a ChunkedKVCache on each chunked layer)."""
    import mlx_lm

    path = write_tiny_family(tmp_path / "l4", "llama4", attention_chunk_size=chunk)
    loaded, (ref_model, tok) = load(str(path), "float32"), mlx_lm.load(str(path))
    ids = tok.encode(LONG)
    assert len(ids) > 4 * chunk
    engine = LLMEngine(
        loaded, EngineConfig.of(block_size=4, num_blocks=96, max_num_batched_tokens=5, attention_impl="reference")
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = contiguous_generate(ref_model, ids, 12)
    for _ in range(2):  # the second run starts from the first one's cached blocks
        rid = engine.add_request(ids, greedy)
        out = run_all(engine)[rid]
        assert list(out.outputs[0].token_ids) == want
    assert out.num_cached_tokens >= len(ids) - 4
