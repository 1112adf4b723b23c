"""GGUF weights kept quantized as MLX affine layers (mlxpaged/gguf/mlx_quant.py).

References: the GGUF's own float32 decoding (gguf-py's `gguf.quants.dequantize`, which
tests/test_gguf.py checks against scalar ports of ggml's C decoders and against blocks
encoded from the spec); MLX's own `mx.quantize` packing; mlx-lm's model and contiguous cache.
The real-model tier compares the quantized path with the float path on the offline 0.5B.
"""

from __future__ import annotations

import json
import math
import time

import gguf  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T  # noqa: E402

from mlxpaged.errors import MlxPagedError  # noqa: E402
from mlxpaged.loading.gguf import convert_gguf, dequantize  # noqa: E402
from mlxpaged.loading.gguf.mlx_quant import EXACT_BITS, GROUP_SIZE, REQUANT_TYPES, pack_codes, to_mlx  # noqa: E402
from mlxpaged.loading.loader import load  # noqa: E402
from mlxpaged.testing.slowness import wall

from gguf_cases import DATA, IDS, LEGACY, direct_logits, encode_legacy, random_k_blocks, write_tiny_gguf  # noqa: E402
from reference import contiguous_generate  # noqa: E402

ROWS, COLS = 6, 512  # two K super-blocks and sixteen legacy blocks per row


def _mx_dequant(q) -> np.ndarray:
    """mx.dequantize in float32, as the CPU path loads it (scales cast to float32)."""
    return np.array(
        mx.dequantize(
            mx.array(q.weight),
            mx.array(q.scales.astype(np.float32)),
            mx.array(q.biases.astype(np.float32)),
            group_size=GROUP_SIZE,
            bits=q.bits,
        )
    )


def _legacy_tensor(qtype: T, rng) -> np.ndarray:
    """ROWS x COLS of blocks: half from gguf-py's quantizer on normal weights, half encoded
    from the spec with every code value and negative scales."""
    quantized = gguf.quants.quantize(rng.normal(0, 0.05, (ROWS // 2, COLS)).astype(np.float32), qtype)
    (lo, hi), _, has_min = LEGACY[qtype]
    nb = ROWS // 2 * COLS // 32
    codes = rng.integers(lo, hi, size=(nb, 32))
    codes[0] = np.arange(32) % (hi - lo) + lo
    d = rng.uniform(-0.1, 0.1, nb).astype(np.float16)
    m = rng.uniform(-0.1, 0.1, nb).astype(np.float16) if has_min else None
    spec = encode_legacy(qtype, codes, d, m).reshape(ROWS // 2, -1)
    return np.concatenate([quantized, spec])


def _tensor(qtype: T, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in LEGACY:
        return _legacy_tensor(qtype, rng)
    return random_k_blocks(qtype, ROWS * COLS // 256, rng).reshape(ROWS, -1)


@pytest.mark.parametrize("qtype", list(EXACT_BITS), ids=lambda t: t.name)
def test_exact_mapping_equals_gguf_dequantization(qtype):
    raw = _tensor(qtype, int(qtype))
    ref = dequantize(raw, qtype).reshape(ROWS, COLS)
    q = to_mlx(raw, qtype, (ROWS, COLS))
    assert q.exact and q.bits == EXACT_BITS[qtype] and q.weight.dtype == np.uint32
    assert q.weight.shape == (ROWS, COLS * q.bits // 32) and q.scales.shape == (ROWS, COLS // GROUP_SIZE)
    got = _mx_dequant(q)
    np.testing.assert_array_equal(got, ref)
    # Bit for bit, except that 0 * negative d is -0.0 in GGUF and +0.0 as d*q + (-d*q).
    differ = got.view(np.uint32) != ref.view(np.uint32)
    assert np.all(ref[differ] == 0)
    # The stored scale dtype loses nothing: float16 only where every value survives it.
    assert q.scales.dtype == (np.float16 if qtype in LEGACY else np.float32)


@pytest.mark.parametrize("qtype", sorted(REQUANT_TYPES), ids=lambda t: t.name)
def test_sixteen_wide_types_requantize_to_8_bit(qtype):
    raw = _tensor(qtype, int(qtype))
    ref = dequantize(raw, qtype).reshape(ROWS, COLS)
    q = to_mlx(raw, qtype, (ROWS, COLS))
    assert (q.bits, q.exact) == (8, False)
    err = _mx_dequant(q).astype(np.float64) - ref
    assert q.max_error == pytest.approx(np.abs(err).max(), rel=1e-6)
    assert q.rms_error == pytest.approx(np.sqrt(np.mean(err**2)), rel=1e-6)
    # Round to nearest on an 8-bit grid spanning each group: at most half a step off.
    step = np.abs(np.repeat(q.scales.astype(np.float64), GROUP_SIZE, axis=1))
    slack = 1e-6 * np.abs(ref).max()  # float32 rounding of scale * q + bias
    assert np.all(np.abs(err) <= 0.5 * step + slack)
    # The grid spans each group: its ends are the group's min and max.
    groups = ref.reshape(ROWS, -1, GROUP_SIZE)
    np.testing.assert_array_equal(q.biases, groups.min(-1))
    np.testing.assert_allclose(q.scales * 255, groups.max(-1) - groups.min(-1), rtol=1e-6)
    assert 0 < q.rms_error < 0.01 * np.sqrt(np.mean(ref**2))


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_packing_matches_mx_quantize(bits):
    """Integer values whose groups hold 0 and 2^bits - 1 quantize with scale +-1 and no
    rounding, so MLX's own packed words must equal pack_codes of the codes it chose."""
    rng = np.random.default_rng(bits)
    values = rng.integers(0, 1 << bits, size=(3, 256)).astype(np.uint8)
    values[:, ::GROUP_SIZE] = 0
    values[:, 1::GROUP_SIZE] = (1 << bits) - 1
    wq, scales, biases = mx.quantize(mx.array(values.astype(np.float32)), group_size=GROUP_SIZE, bits=bits)
    s, b = (np.repeat(np.array(a), GROUP_SIZE, axis=1) for a in (scales, biases))
    assert np.all(np.abs(s) == 1)
    codes = (values - b) / s
    np.testing.assert_array_equal(pack_codes(codes.astype(np.uint8), bits), np.array(wq))


def test_unsupported_shapes_and_types_say_so():
    with pytest.raises(ValueError, match="groups of 32"):
        to_mlx(np.zeros((2, 18), np.uint8), T.Q4_0, (2, 16))
    with pytest.raises(ValueError, match="IQ4_NL has no MLX quantized form"):
        to_mlx(np.zeros((2, 18), np.uint8), T.IQ4_NL, (2, 32))


# =====================================================================================
# The tiny synthetic qwen2 GGUF (every supported type), through the converter and loader
# =====================================================================================
@pytest.fixture(scope="module")
def tiny_q(tmp_path_factory):
    d = tmp_path_factory.mktemp("tinyq")
    path = d / "tiny.gguf"
    ref = write_tiny_gguf(path, output="requant")
    return path, ref, d / "cache"


def _stored_dequant(tensors: dict, layer: str, bits: int) -> np.ndarray:
    return np.array(
        mx.dequantize(
            tensors[f"{layer}.weight"],
            tensors[f"{layer}.scales"].astype(mx.float32),
            tensors[f"{layer}.biases"].astype(mx.float32),
            group_size=GROUP_SIZE,
            bits=bits,
        )
    )


def test_tiny_quantized_checkpoint(tiny_q):
    path, ref, cache = tiny_q
    ckpt = convert_gguf(path, cache_dir=cache, weights="quantized")
    assert ckpt.name.endswith("-quantized") and ckpt != convert_gguf(path, cache_dir=cache)
    marker = json.loads((ckpt / "mlxpaged_conversion.json").read_text())
    assert marker["weights"] == "quantized" and marker["embedding_from"] == "output.weight"  # Q8_0, not Q4_0
    tensors = mx.load(str(ckpt / "model.safetensors"))
    g = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type for t in g.tensors}
    mixed = dict(ref)  # the reference weights, with requantized layers as stored
    loaded = load(str(ckpt), "float32")
    assert loaded.weights == "quantized"
    for hf in ref:
        if not hf.endswith(".weight") or "norm" in hf:
            continue
        layer = hf[: -len(".weight")]
        gname = "output.weight" if hf == "model.embed_tokens.weight" else _gguf_name(hf)
        qtype = types[gname]
        module = _module(loaded.model, layer)
        if qtype in (T.F32, T.F16, T.BF16):
            assert isinstance(module, (nn.Linear, nn.Embedding)) and f"{layer}.scales" not in tensors
            continue
        bits = EXACT_BITS.get(qtype, 8)
        assert isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and module.bits == bits
        stored = _stored_dequant(tensors, layer, bits)
        if qtype in EXACT_BITS:
            np.testing.assert_array_equal(stored, ref[hf])
            assert marker["quantized"][hf] == {"gguf_type": qtype.name, "bits": bits, "exact": True}
        else:
            entry = marker["quantized"][hf]
            assert entry["exact"] is False and entry["max_error"] == pytest.approx(
                np.abs(stored - ref[hf]).max(), rel=1e-6
            )
            mixed[hf] = stored
    # The quantized model's logits equal a float model's on the weights it encodes.
    expected = direct_logits(mixed, IDS, tied=True)
    import mlx_lm

    model, _ = mlx_lm.load(str(ckpt))
    model.set_dtype(mx.float32)
    np.testing.assert_allclose(np.array(model(mx.array([IDS]))), expected, rtol=1e-4, atol=1e-4)
    # The paged engine on the quantized layers gives mlx-lm's contiguous-cache tokens.
    from mlxpaged import LLM, SamplingParams

    llm = LLM(loaded, num_blocks=16)
    (out,) = llm.generate([IDS], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out.outputs[0].token_ids == contiguous_generate(model, IDS, 12)


def _gguf_name(hf: str) -> str:
    from mlxpaged.loading.gguf.convert import _LAYER_TENSORS

    parts = hf.split(".")
    inverse = {v: k for k, v in _LAYER_TENSORS.items()}
    return f"blk.{parts[2]}.{inverse['.'.join(parts[3:])]}"


def _module(model, layer: str):
    m = model
    for p in layer.split("."):
        m = m[int(p)] if p.isdigit() else getattr(m, p)
    return m


def test_quantized_conversion_is_cached(tiny_q):
    path, _, cache = tiny_q
    first = convert_gguf(path, cache_dir=cache, weights="quantized")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert convert_gguf(path, cache_dir=cache, weights="quantized") == first
    assert time.perf_counter() - t0 < wall(5) and (first / "model.safetensors").stat().st_mtime_ns == stamp
    # An entry from an older quantized format is rebuilt, in the same place.
    marker = json.loads((first / "mlxpaged_conversion.json").read_text())
    (first / "mlxpaged_conversion.json").write_text(json.dumps({**marker, "quantized_version": 0}))
    assert convert_gguf(path, cache_dir=cache, weights="quantized") == first
    assert (
        json.loads((first / "mlxpaged_conversion.json").read_text())["quantized_version"] == marker["quantized_version"]
    )
    assert (first / "model.safetensors").stat().st_mtime_ns != stamp
    with pytest.raises(ValueError, match="weights must be one of"):
        convert_gguf(path, cache_dir=cache, weights="int4")


def test_loader_weights_modes(tiny_q, tiny_model_path, monkeypatch):
    path, _, cache = tiny_q
    monkeypatch.setenv("MLXPAGED_CACHE", str(cache))
    q = load(str(path), "float32", weights="quantized")
    f = load(str(path), "float32", weights="float")
    assert q.weights == "quantized" and f.weights == "float" and q.identity != f.identity
    assert isinstance(f.model.model.layers[0].self_attn.q_proj, nn.Linear)
    # "float" on a quantized checkpoint directory dequantizes its layers exactly.
    d = load(str(q.path), "float32", weights="float")
    assert d.weights == "float" and isinstance(d.model.model.embed_tokens, nn.Embedding)
    qp = q.model.model.layers[0].self_attn.q_proj
    want = mx.dequantize(qp.weight, qp.scales, qp.biases, group_size=qp.group_size, bits=qp.bits)
    np.testing.assert_array_equal(np.array(d.model.model.layers[0].self_attn.q_proj.weight), np.array(want))
    with pytest.raises(MlxPagedError, match="--weights quantized needs a GGUF file or a quantized MLX checkpoint"):
        load(str(tiny_model_path), weights="quantized")
    with pytest.raises(MlxPagedError, match="unknown weights 'int4'"):
        load(str(path), weights="int4")


# =====================================================================================
# The real Qwen2.5-Coder-0.5B-Instruct GGUF: quantized path against the float path
# =====================================================================================
GAP = 0.05  # top-2 logit gap of the float path above which the quantized path must agree
PPL_RATIO = 0.005
FREE_RUN = 8
CHECK_TOKENS = 4  # the dequantized copy against the quantized layers (MLX's CPU quantized matmul is slow)


@pytest.fixture(scope="module")
def real_pair(real_ref):
    """The float checkpoint (the tier's shared mlx-lm model) and the quantized one, in float32."""
    import mlx_lm

    from mlxpaged.loading.offline_model import ensure_offline_model

    float_model, tok = real_ref
    quantized, _ = mlx_lm.load(str(convert_gguf(ensure_offline_model(), weights="quantized")))
    quantized.set_dtype(mx.float32)
    return {"float": float_model, "quantized": quantized}, tok


@pytest.fixture(scope="module")
def real_dequantized():
    """The quantized checkpoint with its layers dequantized exactly (mx.dequantize, float32).
    MLX's CPU quantized matmul takes about 90 s for 150 tokens here, so long sequences are
    scored on this copy; the test below checks it against the quantized layers."""
    import mlx_lm

    from mlxpaged.loading.loader import dequantize_layers
    from mlxpaged.loading.offline_model import ensure_offline_model

    deq, _ = mlx_lm.load(str(convert_gguf(ensure_offline_model(), weights="quantized")))
    deq.set_dtype(mx.float32)
    dequantize_layers(deq)
    return deq


@pytest.fixture(scope="module")
def snippet_scores(real_pair, real_dequantized):
    """At each of the snippet's 505 scored positions, for the float weights and the quantized ones
    (dequantized exactly): the next token's negative log-likelihood, the argmax and the top-2 logit
    gap. One forward pass per weight set, shared by the perplexity and the agreement tests."""
    (models, tok) = real_pair
    ids = mx.array(tok.encode((DATA / "perplexity_snippet.py").read_text()))[None]
    scores = {}
    for w, model in (("float", models["float"]), ("quantized", real_dequantized)):
        logits = model(ids[:, :-1])[0].astype(mx.float32)
        top2 = mx.topk(logits, 2, axis=-1)
        nll = nn.losses.cross_entropy(logits, ids[0, 1:], reduction="none")
        gap = top2.max(-1) - top2.min(-1)
        scores[w] = {"nll": np.array(nll), "argmax": np.array(logits.argmax(-1)), "gap": np.array(gap)}
    return scores


def test_real_dequantized_copy_equals_quantized_layers(real_pair, real_dequantized):
    (models, tok) = real_pair
    prefix = mx.array(tok.encode((DATA / "perplexity_snippet.py").read_text()))[None, :CHECK_TOKENS]
    np.testing.assert_allclose(
        np.array(real_dequantized(prefix)), np.array(models["quantized"](prefix)), rtol=1e-3, atol=1e-3
    )


def test_real_quantized_layers_are_exact_where_promised():
    from mlxpaged.loading.offline_model import ensure_offline_model

    ckpt = convert_gguf(ensure_offline_model(), weights="quantized")
    marker = json.loads((ckpt / "mlxpaged_conversion.json").read_text())["quantized"]
    kinds = {(e["gguf_type"], e["bits"], e["exact"]) for e in marker.values()}
    assert kinds == {("Q5_0", 5, True), ("Q8_0", 8, True), ("Q4_K", 4, True), ("Q6_K", 8, False)}
    worst = max(e["rms_error"] / e["rms_weight"] for e in marker.values() if not e["exact"])
    print(f"\nQ6_K -> 8-bit: worst relative RMS error {worst:.4f}")
    assert worst < 0.01


def test_real_greedy_tokens_agree_with_float(real_pair, snippet_scores):
    """Where the float path is confident (top-2 gap > GAP), the quantized weights pick its token: at
    every position of the snippet (each position's argmax is greedy decoding's choice after that
    prefix), and free-running on the paged engine until the float path's first close call."""
    from mlxpaged import EngineConfig, LLMEngine, SamplingParams

    (models, tok) = real_pair
    f, q = snippet_scores["float"], snippet_scores["quantized"]
    confident = f["gap"] > GAP
    disagree = np.flatnonzero(confident & (q["argmax"] != f["argmax"]))
    print(
        f"\n{confident.sum()} of {confident.size} positions with a float top-2 gap > {GAP}; "
        f"quantized disagrees at {disagree.tolist()}"
    )
    assert confident.sum() >= 100 and disagree.size == 0
    # Free-running (FREE_RUN tokens, for CPU time: the engine runs the quantized layers themselves).
    prompt = tok.encode("def is_palindrome(s: str) -> bool:\n", add_special_tokens=False)
    float_tokens = contiguous_generate(models["float"], prompt, FREE_RUN)
    lf = np.array(models["float"](mx.array([prompt + float_tokens[:-1]]))[0, len(prompt) - 1 :])
    top2 = np.sort(lf, axis=-1)[:, -2:]
    close = top2[:, 1] - top2[:, 0] <= GAP
    # The whole-sequence pass agrees with the cached one where it is confident (the reference itself).
    assert np.array_equal(lf.argmax(-1)[~close], np.array(float_tokens)[~close])
    first_close = int(np.argmax(close)) if close.any() else FREE_RUN
    assert first_close >= 4, first_close  # enough tokens to compare (a property of this prompt)
    loaded = load(None, "float32", weights="quantized")
    engine = LLMEngine(loaded, EngineConfig.of(num_blocks=16))
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=first_close, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert done[0].outputs[0].token_ids[:first_close] == float_tokens[:first_close]


def test_real_perplexity_within_half_a_percent(snippet_scores):
    """Scored on the quantized weights dequantized exactly (see `real_dequantized`)."""
    ppl = {w: math.exp(s["nll"].mean()) for w, s in snippet_scores.items()}
    print(
        f"\nperplexity over {snippet_scores['float']['nll'].size + 1} tokens: float {ppl['float']:.4f}, "
        f"quantized {ppl['quantized']:.4f} (ratio {ppl['quantized'] / ppl['float']:.5f})"
    )
    assert abs(ppl["quantized"] / ppl["float"] - 1) < PPL_RATIO
