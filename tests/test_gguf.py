"""GGUF conversion: dequantizers, the checkpoint writer, the tokenizer, errors, the offline model.

References used (so a passing test means something):
- Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: blocks encoded here, byte by byte from the format
  (ggml's block_q* structs), from chosen integer codes and scales; the expected
  values are computed from those codes, not by any decoder.
- Q2_K .. Q6_K: pure-Python ports of ggml's reference C decoders
  (dequantize_row_q*_K in ggml-quants.c), one scalar at a time, applied to random
  blocks and to blocks of the real 0.5B file.  gguf-py (which mlxpaged calls) is a
  vectorized numpy rewrite of the same C, so the ports are independent code.
- The whole converter: perplexity of the real Qwen2.5-Coder-0.5B on a fixed Python
  snippet, against a value measured once, and against what deliberately broken
  weights give.

Time on 2 cores: about 25 s for the file, first run included (assembling the GGUF
from the installed `model` extra and converting it take ~10 s, cached after), with
the system OpenBLAS that importing mlxpaged loads; about 5 minutes with MLX's
bundled reference BLAS (MLXPAGED_BLAS=bundled), nearly all in test_real_perplexity.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

import gguf  # noqa: E402
import mlx.core as mx  # noqa: E402

from gguf import GGMLQuantizationType as T  # noqa: E402

from mlxpaged.loading.gguf import (  # noqa: E402
    SUPPORTED_TYPES,
    GGUFError,
    GGUFFile,
    convert_gguf,
    dequantize,
    load_gguf_tokenizer,
)

DATA = Path(__file__).parent / "data"
RNG_SEED = 1234


# =====================================================================================
# Legacy block formats, encoded from the spec
# =====================================================================================
def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype="<f2").view(np.uint8).reshape(-1, 2)


def encode_legacy(qtype: T, codes: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> np.ndarray:
    """Pack integer codes (nblocks, 32) per ggml's block_q8_0/q4_0/q4_1/q5_0/q5_1 layouts.

    Value i of a block is stored as code i; the low nibble of qs[j] holds value j
    and the high nibble value j + 16; for Q5 the fifth bit of value i is bit i of
    the little-endian uint32 qh.
    """
    nb = codes.shape[0]
    parts = [_f16_bytes(d)]
    if qtype in (T.Q4_1, T.Q5_1):
        parts.append(_f16_bytes(m))
    if qtype == T.Q8_0:
        parts.append(codes.astype(np.int8).view(np.uint8))
    else:
        c = codes.astype(np.uint32)
        if qtype in (T.Q5_0, T.Q5_1):
            hi = (c >> 4) & 1
            qh = (hi << np.arange(32, dtype=np.uint32)).sum(axis=1).astype("<u4")
            parts.append(qh.view(np.uint8).reshape(nb, 4))
        qs = (c[:, :16] & 0xF) | ((c[:, 16:] & 0xF) << 4)
        parts.append(qs.astype(np.uint8))
    return np.concatenate(parts, axis=1)


LEGACY = {
    # type: (code range, offset subtracted, has min)
    T.Q8_0: ((-128, 128), 0, False),
    T.Q4_0: ((0, 16), 8, False),
    T.Q4_1: ((0, 16), 0, True),
    T.Q5_0: ((0, 32), 16, False),
    T.Q5_1: ((0, 32), 0, True),
}


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


# =====================================================================================
# K-quants: scalar ports of ggml-quants.c's dequantize_row_q*_K
# =====================================================================================
def _h(b: bytes, off: int) -> float:
    return struct.unpack_from("<e", b, off)[0]


def ref_q2_k(b: bytes) -> list[float]:
    # block_q2_K: scales[16], qs[64], d, dmin
    scales, q_all, d, dmin = b[0:16], b[16:80], _h(b, 80), _h(b, 82)
    y, is_ = [], 0
    for n in range(2):
        q = q_all[32 * n:32 * n + 32]
        shift = 0
        for _j in range(4):
            for half in (0, 16):
                sc = scales[is_]
                is_ += 1
                dl, ml = d * (sc & 0xF), dmin * (sc >> 4)
                y += [dl * ((q[l + half] >> shift) & 3) - ml for l in range(16)]
            shift += 2
    return y


def ref_q3_k(b: bytes) -> list[float]:
    # block_q3_K: hmask[32], qs[64], scales[12], d
    hm, q_all, d = b[0:32], b[32:96], _h(b, 108)
    kmask1, kmask2 = 0x03030303, 0x0F0F0F0F
    aux = list(struct.unpack("<3I", b[96:108])) + [0]
    tmp = aux[2]
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4)
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4)
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4)
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4)
    scales = struct.unpack("<16b", struct.pack("<4I", *aux))
    y, is_, m = [], 0, 1
    for n in range(2):
        q = q_all[32 * n:32 * n + 32]
        shift = 0
        for _j in range(4):
            for half in (0, 16):
                dl = d * (scales[is_] - 32)
                is_ += 1
                y += [dl * (((q[l + half] >> shift) & 3) - (0 if hm[l + half] & m else 4)) for l in range(16)]
            shift += 2
            m <<= 1
    return y


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_q4_k(b: bytes) -> list[float]:
    # block_q4_K: d, dmin, scales[12], qs[128]
    d, dmin, sc, qs = _h(b, 0), _h(b, 2), b[4:16], b[16:144]
    y = []
    for n in range(4):
        s1, m1 = _scale_min_k4(2 * n, sc)
        s2, m2 = _scale_min_k4(2 * n + 1, sc)
        q = qs[32 * n:32 * n + 32]
        y += [d * s1 * (q[l] & 0xF) - dmin * m1 for l in range(32)]
        y += [d * s2 * (q[l] >> 4) - dmin * m2 for l in range(32)]
    return y


def ref_q5_k(b: bytes) -> list[float]:
    # block_q5_K: d, dmin, scales[12], qh[32], qs[128]
    d, dmin, sc, qh, qs = _h(b, 0), _h(b, 2), b[4:16], b[16:48], b[48:176]
    y, u1, u2 = [], 1, 2
    for n in range(4):
        s1, m1 = _scale_min_k4(2 * n, sc)
        s2, m2 = _scale_min_k4(2 * n + 1, sc)
        ql = qs[32 * n:32 * n + 32]
        y += [d * s1 * ((ql[l] & 0xF) + (16 if qh[l] & u1 else 0)) - dmin * m1 for l in range(32)]
        y += [d * s2 * ((ql[l] >> 4) + (16 if qh[l] & u2 else 0)) - dmin * m2 for l in range(32)]
        u1 <<= 2
        u2 <<= 2
    return y


def ref_q6_k(b: bytes) -> list[float]:
    # block_q6_K: ql[128], qh[64], scales[16] (int8), d
    d = _h(b, 208)
    sc_all = struct.unpack("<16b", b[192:208])
    y = [0.0] * 256
    for n in range(2):
        ql, qh, sc = b[64 * n:64 * n + 64], b[128 + 32 * n:128 + 32 * n + 32], sc_all[8 * n:8 * n + 8]
        for l in range(32):
            is_ = l // 16
            q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32
            base = 128 * n
            y[base + l] = d * sc[is_ + 0] * q1
            y[base + l + 32] = d * sc[is_ + 2] * q2
            y[base + l + 64] = d * sc[is_ + 4] * q3
            y[base + l + 96] = d * sc[is_ + 6] * q4
    return y


K_REFS = {
    # type: (reference decoder, byte offsets of the fp16 super-block scales)
    T.Q2_K: (ref_q2_k, (80, 82)),
    T.Q3_K: (ref_q3_k, (108,)),
    T.Q4_K: (ref_q4_k, (0, 2)),
    T.Q5_K: (ref_q5_k, (0, 2)),
    T.Q6_K: (ref_q6_k, (208,)),
}


def random_k_blocks(qtype: T, nb: int, rng: np.random.Generator, scale: float = 1e-2) -> np.ndarray:
    """Random bytes everywhere except the fp16 scales, which get finite values."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for off in K_REFS[qtype][1]:
        raw[:, off:off + 2] = _f16_bytes(rng.uniform(-scale, scale, nb).astype(np.float16))
    return raw


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


# =====================================================================================
# A tiny synthetic qwen2 GGUF
# =====================================================================================
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


TINY = dict(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=272)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool_call>", 4)]
# Types given to each layer's tensors, so that one tiny model covers every supported type.
LAYER_TYPES = [
    {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q5_0, "attn_output": T.Q5_1,
     "ffn_gate": T.Q8_0, "ffn_up": T.F16, "ffn_down": T.BF16},
    {"attn_q": T.Q2_K, "attn_k": T.Q3_K, "attn_v": T.Q4_K, "attn_output": T.Q5_K,
     "ffn_gate": T.Q6_K, "ffn_up": T.F32, "ffn_down": T.Q4_K},
]
HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def tiny_vocab():
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens += ["Ġt", "he", "Ġthe"]
    types = [1] * len(tokens)
    for text, typ in SPECIALS:
        tokens.append(text)
        types.append(typ)
    while len(tokens) < TINY["vocab"]:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)  # UNUSED, as llama.cpp pads the vocabulary to the embedding size
    return tokens, types, merges


def _encode(w: np.ndarray, qtype: T, rng) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or array to write, the float32 values a correct reader must recover)."""
    if qtype == T.F32:
        return w.astype(np.float32), w.astype(np.float32)
    if qtype == T.F16:
        h = w.astype(np.float16)
        return h, h.astype(np.float32)
    if qtype == T.BF16:
        top = (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return top.view(np.uint8), (top.astype(np.uint32) << 16).view(np.float32)
    if qtype in K_REFS:
        # gguf-py cannot quantize K types: random blocks stand in for weights.
        rows = w.shape[0]
        raw = random_k_blocks(qtype, rows * w.shape[1] // 256, rng, scale=2e-4).reshape(rows, -1)
        return raw, gguf.quants.dequantize(raw, qtype).reshape(w.shape)
    raw = gguf.quants.quantize(w.astype(np.float32), qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "qwen2",
    output: str = "absent",  # "absent" | "requant" (embedding quantized again, finer) | "separate"
    override_type: T | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write a small random qwen2 GGUF; return the float32 weights (HF names) it encodes."""
    rng = np.random.default_rng(seed)
    h, f, nh, nkv, V = TINY["hidden"], TINY["ffn"], TINY["heads"], TINY["kv_heads"], TINY["vocab"]
    kv = nkv * h // nh
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    tokens, types, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(256 + 3)
    w.add_eos_token_id(256 + 5)
    w.add_pad_token_id(256 + 3)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    ref: dict[str, np.ndarray] = {}

    def add(gname: str, hfname: str | None, arr: np.ndarray, qtype: T) -> np.ndarray:
        data, value = _encode(arr, qtype, rng)
        if qtype in (T.F32, T.F16):
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, data, raw_dtype=qtype)
        if hfname:
            ref[hfname] = value
        return value

    emb = rng.normal(0, 0.05, (V, h)).astype(np.float32)
    emb_value = add("token_embd.weight", "model.embed_tokens.weight", emb, T.Q4_0)
    if output == "requant":
        ref["model.embed_tokens.weight"] = add("output.weight", None, emb, T.Q8_0)
    elif output == "separate":
        add("output.weight", "lm_head.weight", rng.normal(0, 0.05, (V, h)).astype(np.float32), T.Q8_0)
    del emb_value
    add("output_norm.weight", "model.norm.weight", 1 + rng.normal(0, 0.1, h).astype(np.float32), T.F32)
    shapes = {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h),
              "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}
    for i, ltypes in enumerate(LAYER_TYPES):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", 1 + rng.normal(0, 0.1, h).astype(np.float32), T.F32)
        add(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", 1 + rng.normal(0, 0.1, h).astype(np.float32), T.F32)
        for t in ("attn_q", "attn_k", "attn_v"):
            add(f"blk.{i}.{t}.bias", p + HF[t] + ".bias", rng.normal(0, 0.5, shapes[t][0]).astype(np.float32), T.F32)
        for t, qtype in ltypes.items():
            if override_type is not None and i == 0 and t == "attn_q":
                qtype = override_type
            arr = rng.normal(0, 0.05, shapes[t]).astype(np.float32)
            if qtype not in SUPPORTED_TYPES:
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                raw = rng.integers(0, 256, (shapes[t][0], shapes[t][1] // block * size), dtype=np.uint8)
                w.add_tensor(f"blk.{i}.{t}.weight", raw, raw_dtype=qtype)
                continue
            add(f"blk.{i}.{t}.weight", p + HF[t] + ".weight", arr, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


def direct_logits(ref: dict[str, np.ndarray], ids: list[int], tied: bool) -> np.ndarray:
    """Logits of mlx-lm's Qwen2 built from the reference weights, bypassing the converter."""
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(
        model_type="qwen2", hidden_size=TINY["hidden"], num_hidden_layers=TINY["layers"],
        intermediate_size=TINY["ffn"], num_attention_heads=TINY["heads"], rms_norm_eps=1e-6,
        vocab_size=TINY["vocab"], num_key_value_heads=TINY["kv_heads"], rope_theta=1e6,
        tie_word_embeddings=tied,
    )
    model = qwen2.Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in ref.items()])
    return np.array(model(mx.array([ids])).astype(mx.float32))


def loaded_logits(ckpt: Path, ids: list[int]) -> np.ndarray:
    import mlx_lm

    model, _ = mlx_lm.load(str(ckpt))
    model.set_dtype(mx.float32)
    return np.array(model(mx.array([ids])).astype(mx.float32))


IDS = [259, 1, 17, 258, 100, 260, 261, 3, 200, 257, 90, 12]


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
    assert ours.metadata["tokenizer.ggml.tokens"] == [str(bytes(theirs.fields["tokenizer.ggml.tokens"].parts[i]), "utf-8")
                                                      for i in theirs.fields["tokenizer.ggml.tokens"].data]
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
        np.testing.assert_array_equal(np.array(mx.load(str(ckpt / "model.safetensors"))["model.embed_tokens.weight"]),
                                      ref["model.embed_tokens.weight"])
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
    assert time.perf_counter() - t0 < 5
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
    assert auto.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


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
    good = om.OfflineModel("fake", "test", "fake-gguf-part", "1.0", 3, len(payload), hashlib.sha256(payload).hexdigest())
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
# Measured once on 2026-11-30: float16 checkpoint evaluated in float32 on the CPU, 505
# tokens (mlx 0.32.4, OpenBLAS and the bundled BLAS agree to 1e-6).  bfloat16 and float32
# checkpoints give 2.3179 and 2.3180.  Low because the snippet is very regular code.
REAL_PPL = 2.318
PPL_TOLERANCE = 0.03
# Tokens scored for the deliberately broken variants (CPU time).  Measured on this window:
# correct 8.13, Q/K rows permuted as for llama 29.1, Q4_K nibbles swapped 2.7e5.
BROKEN_WINDOW = 64
BROKEN_FACTOR = 2.5


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
            np.testing.assert_allclose(g.dequantize(info.name, slice(0, 1)).reshape(-1), expected.reshape(-1), rtol=1e-6)
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
        tokenize=False, add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>system\nYou write Python.<|im_end|>\n"
        "<|im_start|>user\nSort a list.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_real_checkpoint_layout(real_gguf, real_ckpt):
    from mlxpaged.loading.offline_model import default_model

    config = json.loads((real_ckpt / "config.json").read_text())
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                    "intermediate_size", "vocab_size", "tie_word_embeddings")} == {
        "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
    marker = json.loads((real_ckpt / "mlxpaged_conversion.json").read_text())
    assert marker["embedding_from"] == "output.weight"  # the Q8_0 copy, finer than token_embd's Q5_0
    assert json.loads((real_ckpt / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
    assert default_model() == real_ckpt


def _llama_permute(w, n_head: int):
    """llama.cpp's Q/K row permutation for llama models (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_real_perplexity(real_gguf, real_ckpt):
    import mlx.nn as nn
    import mlx_lm
    from mlx.utils import tree_flatten

    model, tokenizer = mlx_lm.load(str(real_ckpt))
    model.set_dtype(mx.float32)
    ids = mx.array(tokenizer.encode((DATA / "perplexity_snippet.py").read_text()))[None]
    assert 400 < ids.shape[1] < 600

    def nll(n_tokens: int | None = None) -> mx.array:
        x = ids if n_tokens is None else ids[:, :n_tokens]
        return nn.losses.cross_entropy(model(x[:, :-1]).astype(mx.float32), x[:, 1:], reduction="none")[0]

    losses = nll()
    ppl = math.exp(losses.mean().item())
    assert abs(ppl / REAL_PPL - 1) < PPL_TOLERANCE, ppl
    window_ppl = math.exp(losses[: BROKEN_WINDOW - 1].mean().item())  # causal: same as scoring the prefix alone

    # What wrong weights would give, on the first BROKEN_WINDOW tokens.
    good = dict(tree_flatten(model.parameters()))
    g = GGUFFile(real_gguf)
    heads = {"q_proj": 14, "k_proj": 2}
    permuted = [(f"model.layers.{i}.self_attn.{p}.{a}", _llama_permute(good[f"model.layers.{i}.self_attn.{p}.{a}"], n))
                for i in range(24) for p, n in heads.items() for a in ("weight", "bias")]
    # A Q4_K decoder that reads the two nibbles of each byte in the wrong order.
    swapped = []
    for name, info in g.tensors.items():
        if info.type == T.Q4_K:
            raw = g.raw(name).reshape(-1, 144).copy()
            raw[:, 16:] = (raw[:, 16:] << 4) | (raw[:, 16:] >> 4)
            layer = name.split(".")[1]
            assert name.endswith("ffn_down.weight")
            swapped.append((f"model.layers.{layer}.mlp.down_proj.weight",
                            mx.array(dequantize(raw.reshape(1, -1), T.Q4_K).reshape(info.shape))))
    g.close()
    for broken in (permuted, swapped):
        model.load_weights(broken, strict=False)
        bad_ppl = math.exp(nll(BROKEN_WINDOW).mean().item())
        model.load_weights(list(good.items()))
        assert bad_ppl > BROKEN_FACTOR * window_ppl, (bad_ppl, window_ppl)
