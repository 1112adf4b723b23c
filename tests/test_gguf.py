"""GGUF conversion: dequantizers, the checkpoint writer, the tokenizer, errors, the offline model.

References used (so a passing test means something):
- Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: blocks encoded here, byte by byte from the format
  (ggml's block_q* structs), from chosen integer codes and scales; the expected
  values are computed from those codes, not by any decoder.
- Q2_K .. Q6_K: pure-Python ports of ggml's reference C decoders
  (dequantize_row_q*_K in ggml-quants.c), one scalar at a time, applied to random
  blocks and to blocks of the real 0.5B file.  gguf-py (which mlxpaged calls) is a
  vectorized numpy rewrite of the same C, so the ports are independent code.
- The whole converter on the real Qwen2.5-Coder-0.5B: every tensor against the `gguf` package's own
  reader and dequantizer, rounded once to float16; the perplexity of a fixed Python snippet's first
  64 tokens against the same model on those reference weights, and against what deliberately broken
  weights give.

Time on 2 cores: about 25 s for the file, first run included (assembling the GGUF from the
installed `model` extra and converting it take ~10 s, cached after), with the system OpenBLAS
that importing mlxpaged loads; test_real_perplexity is mostly the `gguf` package decoding the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path

import gguf  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T  # noqa: E402

from mlxpaged.loading.gguf import (  # noqa: E402
    SUPPORTED_TYPES,
    GGUFError,
    GGUFFile,
    convert_gguf,
    dequantize,
    load_gguf_tokenizer,
)
from mlxpaged.testing.slowness import wall

from gguf_cases import (  # noqa: E402  # noqa: E402  # noqa: E402  # noqa: E402
    DATA,
    IDS,
    K_REFS,
    LEGACY,
    TINY,
    direct_logits,
    encode_legacy,
    random_k_blocks,
    write_tiny_gguf,
)

RNG_SEED = 1234


@pytest.mark.parametrize("qtype", list(LEGACY), ids=lambda t: t.name)
def test_legacy_dequant_matches_spec_encoding(qtype):
    rng = np.random.default_rng(RNG_SEED)
    (lo, hi), offset, has_min = LEGACY[qtype]
    nb = 64
    codes = rng.integers(lo, hi, size=(nb, 32))
    codes[0] = np.arange(32) % (hi - lo) + lo  # every code value appears
    d = rng.uniform(-0.1, 0.1, nb).astype(np.float16)
    m = rng.uniform(-0.1, 0.1, nb).astype(np.float16) if has_min else None
    raw = encode_legacy(qtype, codes, d, m)
    assert raw.shape[1] == gguf.GGML_QUANT_SIZES[qtype][1]
    expected = d.astype(np.float64)[:, None] * (codes - offset)
    if has_min:
        expected = expected + m.astype(np.float64)[:, None]
    got = dequantize(raw.reshape(1, -1), qtype).reshape(nb, 32)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_float_types():
    rng = np.random.default_rng(RNG_SEED)
    x = rng.normal(size=(3, 64)).astype(np.float32)
    np.testing.assert_array_equal(dequantize(x.view(np.uint8), T.F32), x)
    h = x.astype(np.float16)
    np.testing.assert_array_equal(dequantize(h.view(np.uint8), T.F16), h.astype(np.float32))
    # bfloat16 = the top 16 bits of a float32: truncate, then expect exactly those values.
    top = (x.view(np.uint32) >> 16).astype(np.uint16)
    expected = (top.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(dequantize(top.view(np.uint8), T.BF16), expected)


def _check_k_blocks(qtype: T, raw: np.ndarray) -> None:
    ref = K_REFS[qtype][0]
    expected = np.array([ref(bytes(block)) for block in raw], dtype=np.float64)
    got = dequantize(raw.reshape(1, -1), qtype).reshape(raw.shape[0], 256)
    atol = 1e-6 * max(np.abs(expected).max(), 1e-12)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("qtype", list(K_REFS), ids=lambda t: t.name)
def test_k_quant_dequant_matches_ggml_reference(qtype):
    _check_k_blocks(qtype, random_k_blocks(qtype, 24, np.random.default_rng(RNG_SEED + int(qtype))))


def test_supported_types_are_the_tested_ones():
    tested = set(LEGACY) | set(K_REFS) | {T.F32, T.F16, T.BF16}
    assert set(SUPPORTED_TYPES) == tested


def loaded_logits(ckpt: Path, ids: list[int]) -> np.ndarray:
    import mlx_lm

    model, _ = mlx_lm.load(str(ckpt))
    model.set_dtype(mx.float32)
    return np.array(model(mx.array([ids])).astype(mx.float32))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    path = d / "tiny.gguf"
    ref = write_tiny_gguf(path)
    return path, ref, d / "cache"


def test_reader_agrees_with_gguf_py(tiny):
    path, _, _ = tiny
    ours = GGUFFile(path)
    theirs = gguf.GGUFReader(str(path))
    assert ours.metadata["general.architecture"] == "qwen2"
    assert ours.metadata["tokenizer.ggml.tokens"] == [
        str(bytes(theirs.fields["tokenizer.ggml.tokens"].parts[i]), "utf-8")
        for i in theirs.fields["tokenizer.ggml.tokens"].data
    ]
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert info.type == t.tensor_type
        assert info.offset == t.data_offset
        assert info.shape == tuple(int(x) for x in reversed(t.shape))
        np.testing.assert_array_equal(ours.raw(t.name).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
    ours.close()


def test_tiny_gguf_converts_and_logits_match(tiny):
    path, ref, cache = tiny
    ckpt = convert_gguf(path, cache_dir=cache, dtype="float32")
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (256, 2, 4)
    assert config["num_key_value_heads"] == 2 and config["vocab_size"] == TINY["vocab"]
    expected = direct_logits(ref, IDS, tied=True)
    got = loaded_logits(ckpt, IDS)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    # The default float16 checkpoint stays close too.
    ckpt16 = convert_gguf(path, cache_dir=cache)
    assert ckpt16 != ckpt and json.loads((ckpt16 / "config.json").read_text())["torch_dtype"] == "float16"
    np.testing.assert_allclose(loaded_logits(ckpt16, IDS), expected, atol=2e-2 * np.abs(expected).max())


@pytest.mark.parametrize("output,tied", [("requant", True), ("separate", False)])
def test_output_weight_tying(tmp_path, output, tied):
    ref = write_tiny_gguf(tmp_path / "m.gguf", output=output, seed=1)
    ckpt = convert_gguf(tmp_path / "m.gguf", cache_dir=tmp_path / "cache", dtype="float32")
    assert json.loads((ckpt / "config.json").read_text())["tie_word_embeddings"] is tied
    names = set(mx.load(str(ckpt / "model.safetensors")))
    assert ("lm_head.weight" in names) is not tied
    if tied:
        # The finer (Q8_0) copy supplies the embedding.
        np.testing.assert_array_equal(
            np.array(mx.load(str(ckpt / "model.safetensors"))["model.embed_tokens.weight"]),
            ref["model.embed_tokens.weight"],
        )
    np.testing.assert_allclose(loaded_logits(ckpt, IDS), direct_logits(ref, IDS, tied=tied), rtol=1e-4, atol=1e-4)


def test_conversion_is_cached(tiny, monkeypatch):
    path, _, _ = tiny
    root = path.parent / "envcache"
    monkeypatch.setenv("MLXPAGED_CACHE", str(root))
    first = convert_gguf(path)
    sha = json.loads((first / "mlxpaged_conversion.json").read_text())["sha256"]
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    assert first == root / "converted" / sha[:16]
    index = json.loads((root / "sha256-index.json").read_text())
    assert index[str(path.resolve())]["sha256"] == sha  # (path, size, mtime) -> sha256, for the next call
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert convert_gguf(path) == first
    assert time.perf_counter() - t0 < wall(5)
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in (root / "converted").iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_tiny_tokenizer(tiny):
    path, _, cache = tiny
    from transformers import AutoTokenizer

    tok = load_gguf_tokenizer(path)
    ckpt = convert_gguf(path, cache_dir=cache, dtype="float32")
    auto = AutoTokenizer.from_pretrained(str(ckpt))
    assert tok.encode("the the").ids == [116, 257, 258]  # t, he, Ġthe
    assert tok.get_vocab_size() == 263  # the [PAD] fillers are not vocabulary
    for s in ["the the", "<|im_start|>user\nthe<|im_end|>", "héllo <tool_call> wörld\n\n  x"]:
        assert auto.encode(s) == tok.encode(s).ids
        assert auto.decode(auto.encode(s)) == s
    assert auto.eos_token == "<|im_end|>"
    assert auto.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    ) == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# =====================================================================================
# Errors
# =====================================================================================
def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg and msg
    return msg


def test_error_wrong_architecture(tmp_path):
    p = tmp_path / "gemma2.gguf"
    write_tiny_gguf(p, arch="gemma2")
    with pytest.raises(GGUFError) as e:
        convert_gguf(p, cache_dir=tmp_path / "c")
    assert _one_line(e.value) == f"unsupported architecture 'gemma2' in {p}: mlxpaged supports qwen2, qwen3, llama"


@pytest.mark.parametrize("fraction", [0.002, 0.3, 0.9])
def test_error_truncated(tiny, tmp_path, fraction):
    data = tiny[0].read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(GGUFError) as e:
        convert_gguf(p, cache_dir=tmp_path / "c")
    assert "truncated" in _one_line(e.value)
    assert not (tmp_path / "c" / "converted").exists() or not any((tmp_path / "c" / "converted").iterdir())


@pytest.mark.parametrize("content", [b"", b"not a model\n" * 10, b"PK\x03\x04" + bytes(100)])
def test_error_not_gguf(tmp_path, content):
    p = tmp_path / "x.gguf"
    p.write_bytes(content)
    with pytest.raises(GGUFError) as e:
        convert_gguf(p, cache_dir=tmp_path / "c")
    assert "not a GGUF file" in _one_line(e.value)
    with pytest.raises(GGUFError):
        load_gguf_tokenizer(p)


def test_error_unsupported_tensor_type(tmp_path):
    p = tmp_path / "iq.gguf"
    write_tiny_gguf(p, override_type=T.IQ4_NL)
    with pytest.raises(GGUFError) as e:
        convert_gguf(p, cache_dir=tmp_path / "c")
    assert "unsupported tensor type IQ4_NL for 'blk.0.attn_q.weight'" in _one_line(e.value)


# =====================================================================================
# The offline model's assembly (fake parts)
# =====================================================================================
def test_offline_model_assembly_from_installed_parts(tmp_path, monkeypatch):
    from mlxpaged.loading import offline_model as om

    payload = os.urandom(3000)
    chunks = [payload[:1000], payload[1000:2500], payload[2500:]]
    site = tmp_path / "site"
    for i, c in enumerate(chunks, start=1):
        d = site / f"fake_gguf_part{i}" / "data"
        d.mkdir(parents=True)
        (d.parent / "__init__.py").write_text("raise ImportError('data-only: must not be imported')\n")
        (d / f"part{i:02d}.bin").write_bytes(c)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("MLXPAGED_CACHE", str(tmp_path / "cache"))
    good = om.OfflineModel(
        "fake", "test", "fake-gguf-part", "1.0", 3, len(payload), hashlib.sha256(payload).hexdigest()
    )
    monkeypatch.setitem(om.OFFLINE_MODELS, "fake", good)
    path = om.ensure_offline_model("fake", download=False)
    assert path == tmp_path / "cache" / "gguf" / "fake.gguf" and path.read_bytes() == payload
    assert om.ensure_offline_model("fake", download=False) == path  # verified copy reused
    bad = om.OfflineModel("bad", "test", "fake-gguf-part", "1.0", 3, len(payload), "0" * 64)
    monkeypatch.setitem(om.OFFLINE_MODELS, "bad", bad)
    with pytest.raises(om.OfflineModelError, match="sha256"):
        om.ensure_offline_model("bad", download=False)
    missing = om.OfflineModel("missing", "test", "fake-gguf-part", "1.0", 4, len(payload), None)
    monkeypatch.setitem(om.OFFLINE_MODELS, "missing", missing)
    with pytest.raises(om.OfflineModelError, match="not installed"):
        om.ensure_offline_model("missing", download=False)


# =====================================================================================
# The real Qwen2.5-Coder-0.5B-Instruct GGUF
# =====================================================================================
# The converted checkpoint must hold, tensor by tensor, the weights of the `gguf` package's own reader and
# dequantizer (independent of loading/gguf/), rounded once to its float16 storage; and the model built from
# either must score the same perplexity on the first WINDOW tokens of a fixed Python snippet.
PPL_TOLERANCE = 0.01
GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tokens scored (CPU time: one forward pass per weight set).  Measured on this window: correct 8.13,
# Q/K rows permuted as for llama 29.1, Q4_K nibbles swapped 2.7e5.
WINDOW = 64
BROKEN_FACTOR = 2.5
# float16 storage: round to nearest is within half an ulp, 2^-11 of the value (2^-25 below the normal range);
# the margin covers a float32 rounding in the dequantizer's own arithmetic before the cast.
F16_REL, F16_ABS = 2.0**-11 * 1.001, 2.0**-24


@pytest.fixture(scope="module")
def real_gguf():
    from mlxpaged.loading.offline_model import ensure_offline_model

    return ensure_offline_model()


@pytest.fixture(scope="module")
def real_ckpt(real_gguf):
    return convert_gguf(real_gguf)


def test_real_blocks_match_reference(real_gguf):
    g = GGUFFile(real_gguf)
    seen = set()
    for info in g.tensors.values():
        if info.type in seen or info.type not in K_REFS and info.type not in LEGACY:
            continue
        seen.add(info.type)
        if info.type in K_REFS:
            raw = g.raw(info.name)[0][: 4 * gguf.GGML_QUANT_SIZES[info.type][1]].reshape(4, -1)
            _check_k_blocks(info.type, raw)
        else:
            # Legacy blocks: decode the first row by the spec, with numpy.
            row = g.raw(info.name)[0].reshape(-1, gguf.GGML_QUANT_SIZES[info.type][1])
            d = row[:, :2].copy().view("<f2").astype(np.float64)
            if info.type == T.Q8_0:
                expected = d * row[:, 2:].copy().view(np.int8)
            else:  # Q5_0, the other legacy type in this file
                assert info.type == T.Q5_0
                qh = row[:, 2:6].copy().view("<u4")
                qs = row[:, 6:].astype(np.int64)
                lo = np.concatenate([qs & 0xF, qs >> 4], axis=1)
                hi = (qh >> np.arange(32, dtype=np.uint32)) & 1
                expected = d * (lo + 16 * hi - 16)
            np.testing.assert_allclose(
                g.dequantize(info.name, slice(0, 1)).reshape(-1), expected.reshape(-1), rtol=1e-6
            )
    assert seen == {T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K}
    g.close()


def test_real_tokenizer_matches_autotokenizer(real_gguf, real_ckpt):
    from transformers import AutoTokenizer

    tok = load_gguf_tokenizer(real_gguf)
    auto = AutoTokenizer.from_pretrained(str(real_ckpt))
    # Ids published for Qwen2's tokenizer: "Hello" 9707, "," 11, " world" 1879.
    assert tok.encode("Hello, world").ids == [9707, 11, 1879]
    samples = [
        "def add(a, b):\n    return a + b  # sum\n",
        "It's 2024; they'll pay 3.50€ — ok?",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n你好 🙂<|im_end|>\n",
        "\t\tindented\r\n\n   trailing   ",
        (DATA / "perplexity_snippet.py").read_text(),
    ]
    for s in samples:
        ids = tok.encode(s).ids
        assert auto.encode(s) == ids
        assert auto.decode(ids) == s
    assert len(auto) == 151665 and auto.eos_token == "<|im_end|>" and auto.pad_token == "<|endoftext|>"
    text = auto.apply_chat_template(
        [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>system\nYou write Python.<|im_end|>\n"
        "<|im_start|>user\nSort a list.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_real_checkpoint_layout(real_gguf, real_ckpt):
    from mlxpaged.loading.offline_model import default_model

    config = json.loads((real_ckpt / "config.json").read_text())
    assert {
        k: config[k]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
            "tie_word_embeddings",
        )
    } == {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    }
    marker = json.loads((real_ckpt / "mlxpaged_conversion.json").read_text())
    assert marker["embedding_from"] == "output.weight"  # the Q8_0 copy, finer than token_embd's Q5_0
    assert json.loads((real_ckpt / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
    assert default_model() == real_ckpt


def _llama_permute(w, n_head: int):
    """llama.cpp's Q/K row permutation for llama models (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_package_weights(path) -> list[tuple[str, mx.array]]:
    """The Qwen2 weights as the `gguf` package reads and dequantizes them, under Hugging Face names.
    As the data notes say, output.weight (Q8_0) is the tied embedding; token_embd (Q5_0) is its coarser
    copy, which the model never reads (not decoded here)."""
    from gguf.quants import dequantize as gguf_dequantize

    out = []
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name == "token_embd.weight":
            continue
        w = mx.array(gguf_dequantize(t.data, t.tensor_type).astype(np.float32))
        if t.name == "output.weight":
            out.append(("model.embed_tokens.weight", w))
        elif t.name == "output_norm.weight":
            out.append(("model.norm.weight", w))
        else:
            _, layer, kind, param = t.name.split(".")
            out.append((f"model.layers.{layer}.{GGUF_TO_HF[kind]}.{param}", w))
    return out


def test_real_perplexity(real_gguf, real_ref):
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    model, tokenizer = real_ref  # the converted checkpoint (real_ckpt), shared by the tier: weights put back below
    ids = mx.array(tokenizer.encode((DATA / "perplexity_snippet.py").read_text()))[None]
    assert 400 < ids.shape[1] < 600
    x = ids[:, :WINDOW]

    def ppl() -> float:
        return math.exp(nn.losses.cross_entropy(model(x[:, :-1]).astype(mx.float32), x[:, 1:]).mean().item())

    good = dict(tree_flatten(model.parameters()))
    reference = _gguf_package_weights(real_gguf)
    assert {n for n, _ in reference} == set(good)
    for name, want in reference:
        bound = F16_REL * mx.abs(want) + F16_ABS
        assert mx.all(mx.abs(good[name] - want) <= bound).item(), name

    # What wrong weights would give.
    g = GGUFFile(real_gguf)
    heads = {"q_proj": 14, "k_proj": 2}
    permuted = [
        (f"model.layers.{i}.self_attn.{p}.{a}", _llama_permute(good[f"model.layers.{i}.self_attn.{p}.{a}"], n))
        for i in range(24)
        for p, n in heads.items()
        for a in ("weight", "bias")
    ]
    # A Q4_K decoder that reads the two nibbles of each byte in the wrong order.
    swapped = []
    for name, info in g.tensors.items():
        if info.type == T.Q4_K:
            raw = g.raw(name).reshape(-1, 144).copy()
            raw[:, 16:] = (raw[:, 16:] << 4) | (raw[:, 16:] >> 4)
            layer = name.split(".")[1]
            assert name.endswith("ffn_down.weight")
            swapped.append(
                (
                    f"model.layers.{layer}.mlp.down_proj.weight",
                    mx.array(dequantize(raw.reshape(1, -1), T.Q4_K).reshape(info.shape)),
                )
            )
    g.close()
    converted_ppl = ppl()
    try:
        model.load_weights(reference)  # the reference: gguf's own dequantizer
        ref_ppl = ppl()
        assert abs(converted_ppl / ref_ppl - 1) < PPL_TOLERANCE, (converted_ppl, ref_ppl)
        for broken in (permuted, swapped):
            model.load_weights(list(good.items()))
            model.load_weights(broken, strict=False)
            bad_ppl = ppl()
            assert bad_ppl > BROKEN_FACTOR * converted_ppl, (bad_ppl, converted_ppl)
    finally:
        model.load_weights(list(good.items()))
