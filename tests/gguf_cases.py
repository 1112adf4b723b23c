"""Tiny GGUF files written with the `gguf` package, quantized blocks encoded in numpy, and logits computed directly
from the file (the references of the GGUF tests)."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

from mlxpaged.loading.gguf import (  # noqa: E402
    SUPPORTED_TYPES,
)

DATA = Path(__file__).parent / "data"


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


def random_k_blocks(qtype: T, nb: int, rng: np.random.Generator, scale: float = 1e-2) -> np.ndarray:
    """Random bytes everywhere except the fp16 scales, which get finite values."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for off in K_REFS[qtype][1]:
        raw[:, off : off + 2] = _f16_bytes(rng.uniform(-scale, scale, nb).astype(np.float16))
    return raw


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
    shapes = {
        "attn_q": (h, h),
        "attn_k": (kv, h),
        "attn_v": (kv, h),
        "attn_output": (h, h),
        "ffn_gate": (f, h),
        "ffn_up": (f, h),
        "ffn_down": (h, f),
    }
    for i, ltypes in enumerate(LAYER_TYPES):
        p = f"model.layers.{i}."
        add(
            f"blk.{i}.attn_norm.weight",
            p + "input_layernorm.weight",
            1 + rng.normal(0, 0.1, h).astype(np.float32),
            T.F32,
        )
        add(
            f"blk.{i}.ffn_norm.weight",
            p + "post_attention_layernorm.weight",
            1 + rng.normal(0, 0.1, h).astype(np.float32),
            T.F32,
        )
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
        model_type="qwen2",
        hidden_size=TINY["hidden"],
        num_hidden_layers=TINY["layers"],
        intermediate_size=TINY["ffn"],
        num_attention_heads=TINY["heads"],
        rms_norm_eps=1e-6,
        vocab_size=TINY["vocab"],
        num_key_value_heads=TINY["kv_heads"],
        rope_theta=1e6,
        tie_word_embeddings=tied,
    )
    model = qwen2.Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in ref.items()])
    return np.array(model(mx.array([ids])).astype(mx.float32))


IDS = [259, 1, 17, 258, 100, 260, 261, 3, 200, 257, 90, 12]


# =====================================================================================
# Legacy block formats, encoded from the spec
# =====================================================================================
def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype="<f2").view(np.uint8).reshape(-1, 2)


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
    {
        "attn_q": T.Q4_0,
        "attn_k": T.Q4_1,
        "attn_v": T.Q5_0,
        "attn_output": T.Q5_1,
        "ffn_gate": T.Q8_0,
        "ffn_up": T.F16,
        "ffn_down": T.BF16,
    },
    {
        "attn_q": T.Q2_K,
        "attn_k": T.Q3_K,
        "attn_v": T.Q4_K,
        "attn_output": T.Q5_K,
        "ffn_gate": T.Q6_K,
        "ffn_up": T.F32,
        "ffn_down": T.Q4_K,
    },
]


HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


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


def ref_q2_k(b: bytes) -> list[float]:
    # block_q2_K: scales[16], qs[64], d, dmin
    scales, q_all, d, dmin = b[0:16], b[16:80], _h(b, 80), _h(b, 82)
    y, is_ = [], 0
    for n in range(2):
        q = q_all[32 * n : 32 * n + 32]
        shift = 0
        for _j in range(4):
            for half in (0, 16):
                sc = scales[is_]
                is_ += 1
                dl, ml = d * (sc & 0xF), dmin * (sc >> 4)
                y += [dl * ((q[idx + half] >> shift) & 3) - ml for idx in range(16)]
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
        q = q_all[32 * n : 32 * n + 32]
        shift = 0
        for _j in range(4):
            for half in (0, 16):
                dl = d * (scales[is_] - 32)
                is_ += 1
                y += [dl * (((q[idx + half] >> shift) & 3) - (0 if hm[idx + half] & m else 4)) for idx in range(16)]
            shift += 2
            m <<= 1
    return y


def ref_q4_k(b: bytes) -> list[float]:
    # block_q4_K: d, dmin, scales[12], qs[128]
    d, dmin, sc, qs = _h(b, 0), _h(b, 2), b[4:16], b[16:144]
    y = []
    for n in range(4):
        s1, m1 = _scale_min_k4(2 * n, sc)
        s2, m2 = _scale_min_k4(2 * n + 1, sc)
        q = qs[32 * n : 32 * n + 32]
        y += [d * s1 * (q[idx] & 0xF) - dmin * m1 for idx in range(32)]
        y += [d * s2 * (q[idx] >> 4) - dmin * m2 for idx in range(32)]
    return y


def ref_q5_k(b: bytes) -> list[float]:
    # block_q5_K: d, dmin, scales[12], qh[32], qs[128]
    d, dmin, sc, qh, qs = _h(b, 0), _h(b, 2), b[4:16], b[16:48], b[48:176]
    y, u1, u2 = [], 1, 2
    for n in range(4):
        s1, m1 = _scale_min_k4(2 * n, sc)
        s2, m2 = _scale_min_k4(2 * n + 1, sc)
        ql = qs[32 * n : 32 * n + 32]
        y += [d * s1 * ((ql[idx] & 0xF) + (16 if qh[idx] & u1 else 0)) - dmin * m1 for idx in range(32)]
        y += [d * s2 * ((ql[idx] >> 4) + (16 if qh[idx] & u2 else 0)) - dmin * m2 for idx in range(32)]
        u1 <<= 2
        u2 <<= 2
    return y


def ref_q6_k(b: bytes) -> list[float]:
    # block_q6_K: ql[128], qh[64], scales[16] (int8), d
    d = _h(b, 208)
    sc_all = struct.unpack("<16b", b[192:208])
    y = [0.0] * 256
    for n in range(2):
        ql, qh, sc = b[64 * n : 64 * n + 64], b[128 + 32 * n : 128 + 32 * n + 32], sc_all[8 * n : 8 * n + 8]
        for idx in range(32):
            is_ = idx // 16
            q1 = ((ql[idx] & 0xF) | (((qh[idx] >> 0) & 3) << 4)) - 32
            q2 = ((ql[idx + 32] & 0xF) | (((qh[idx] >> 2) & 3) << 4)) - 32
            q3 = ((ql[idx] >> 4) | (((qh[idx] >> 4) & 3) << 4)) - 32
            q4 = ((ql[idx + 32] >> 4) | (((qh[idx] >> 6) & 3) << 4)) - 32
            base = 128 * n
            y[base + idx] = d * sc[is_ + 0] * q1
            y[base + idx + 32] = d * sc[is_ + 2] * q2
            y[base + idx + 64] = d * sc[is_ + 4] * q3
            y[base + idx + 96] = d * sc[is_ + 6] * q4
    return y


# =====================================================================================
# K-quants: scalar ports of ggml-quants.c's dequantize_row_q*_K
# =====================================================================================
def _h(b: bytes, off: int) -> float:
    return struct.unpack_from("<e", b, off)[0]


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


K_REFS = {
    # type: (reference decoder, byte offsets of the fp16 super-block scales)
    T.Q2_K: (ref_q2_k, (80, 82)),
    T.Q3_K: (ref_q3_k, (108,)),
    T.Q4_K: (ref_q4_k, (0, 2)),
    T.Q5_K: (ref_q5_k, (0, 2)),
    T.Q6_K: (ref_q6_k, (208,)),
}
