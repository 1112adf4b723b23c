"""llama and qwen3 GGUFs (tiny, written by the `gguf` package) through the converter and the engine.

The reference is mlx-lm's own llama / qwen3 `Model` built directly from the float weights the
file encodes, in Hugging Face row order. For llama the file holds Q and K with llama.cpp's row
permutation applied (`permute` below, as convert_hf_to_gguf.py's `LlamaModel.permute` does it);
a row permutation commutes with quantization (blocks run along a row), so the reference is the
exact dequantization of the unpermuted rows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
mx = pytest.importorskip("mlx.core")

from gguf import GGMLQuantizationType as T  # noqa: E402

from mlxpaged import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from mlxpaged.loading.gguf import GGUFError, convert_gguf  # noqa: E402
from mlxpaged.loading.loader import load  # noqa: E402

from gguf_cases import random_k_blocks, tiny_vocab  # noqa: E402
from reference import contiguous_generate  # noqa: E402

H, FFN, HEADS, KV, LAYERS, V = 256, 512, 4, 2, 2, 272
HEAD_DIM = {"llama": 64, "qwen3": 128}  # qwen3: heads x head_dim != hidden, as in Qwen3-0.6B
PROMPTS = [[259, 1, 17, 258, 100, 260, 261, 3, 200, 257, 90, 12], [40, 41, 42], list(range(60, 95))]
# Each layer's types: Q8_0 (gguf-py quantizes it) and Q4_K (random blocks), on Q and K alike.
TYPES = [
    {
        "attn_q": T.Q8_0,
        "attn_k": T.Q4_K,
        "attn_v": T.Q8_0,
        "attn_output": T.Q4_K,
        "ffn_gate": T.Q4_K,
        "ffn_up": T.Q8_0,
        "ffn_down": T.Q4_K,
    },
    {
        "attn_q": T.Q4_K,
        "attn_k": T.Q8_0,
        "attn_v": T.Q4_K,
        "attn_output": T.Q8_0,
        "ffn_gate": T.Q8_0,
        "ffn_up": T.Q4_K,
        "ffn_down": T.Q8_0,
    },
]


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order, from Hugging Face's (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf(path, arch: str, seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny llama / qwen3 GGUF; returns the float32 weights it encodes, in HF names and row order."""
    rng = np.random.default_rng(seed)
    hd = HEAD_DIM[arch]
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    tokens, types, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(256 + 3)
    w.add_eos_token_id(256 + 5)
    ref: dict[str, np.ndarray] = {}

    def add(gname, hfname, shape, qtype, heads=None, scale=None):
        """Tensor `gname` of `shape`, stored as `qtype`; Q/K rows (heads given, llama) permuted in the file."""
        scale = shape[-1] ** -0.5 if scale is None else scale
        if qtype == T.F32:
            raw = value = (1 + rng.normal(0, 0.1, shape)).astype(np.float32)
        elif qtype == T.Q4_K:  # gguf-py cannot quantize K types: random blocks (HF row order) stand in
            raw = random_k_blocks(qtype, shape[0] * shape[1] // 256, rng, scale=scale / 20).reshape(shape[0], -1)
            value = gguf.quants.dequantize(raw, qtype).reshape(shape)
        else:
            raw = gguf.quants.quantize(rng.normal(0, scale, shape).astype(np.float32), qtype)
            value = gguf.quants.dequantize(raw, qtype).reshape(shape)
        if heads is not None and arch == "llama":
            raw = permute(raw, heads)  # whole rows of blocks move
        w.add_tensor(gname, raw, raw_dtype=None if qtype == T.F32 else qtype)
        ref[hfname] = value

    add("token_embd.weight", "model.embed_tokens.weight", (V, H), T.Q8_0, scale=1.0)
    add("output.weight", "lm_head.weight", (V, H), T.Q8_0, scale=4 * H**-0.5)
    add("output_norm.weight", "model.norm.weight", (H,), T.F32)
    shapes = {
        "attn_q": (HEADS * hd, H),
        "attn_k": (KV * hd, H),
        "attn_v": (KV * hd, H),
        "attn_output": (H, HEADS * hd),
        "ffn_gate": (FFN, H),
        "ffn_up": (FFN, H),
        "ffn_down": (H, FFN),
    }
    hf = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i, ltypes in enumerate(TYPES):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", (H,), T.F32)
        add(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", (H,), T.F32)
        if arch == "qwen3":
            add(f"blk.{i}.attn_q_norm.weight", p + "self_attn.q_norm.weight", (hd,), T.F32)
            add(f"blk.{i}.attn_k_norm.weight", p + "self_attn.k_norm.weight", (hd,), T.F32)
        for t, qtype in ltypes.items():
            heads = {"attn_q": HEADS, "attn_k": KV}.get(t)
            add(f"blk.{i}.{t}.weight", p + hf[t] + ".weight", shapes[t], qtype, heads=heads)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


def reference_model(arch: str, ref: dict[str, np.ndarray]):
    """mlx-lm's own model of `arch` holding exactly the weights the file encodes."""
    from mlx_lm.models import llama, qwen3

    module = {"llama": llama, "qwen3": qwen3}[arch]
    args = module.ModelArgs.from_dict(
        dict(
            model_type=arch,
            hidden_size=H,
            num_hidden_layers=LAYERS,
            intermediate_size=FFN,
            num_attention_heads=HEADS,
            num_key_value_heads=KV,
            head_dim=HEAD_DIM[arch],
            rms_norm_eps=1e-5,
            vocab_size=V,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
    )
    model = module.Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in ref.items()], strict=True)
    return model


@pytest.mark.parametrize("weights", ["float", "quantized"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_gives_mlx_lm_tokens(tmp_path, monkeypatch, arch, weights):
    """Greedy tokens through the converter and the paged engine equal mlx-lm's on the same
    weights; "quantized" keeps Q8_0 / Q4_K as MLX quantized layers (exact mappings)."""
    monkeypatch.setenv("MLXPAGED_CACHE", str(tmp_path / "cache"))
    ref = write_gguf(tmp_path / f"{arch}.gguf", arch)
    loaded = load(str(tmp_path / f"{arch}.gguf"), "float32", weights)
    assert loaded.config["model_type"] == arch and loaded.weights == weights
    engine = LLMEngine(
        loaded, EngineConfig.of(block_size=4, num_blocks=128, max_num_batched_tokens=16, attention_impl="reference")
    )
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in PROMPTS]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    model = reference_model(arch, ref)
    for p, r in zip(PROMPTS, rids):
        assert done[r].outputs[0].token_ids == contiguous_generate(model, p, 20), (arch, weights)


def test_llama_rows_must_be_unpermuted(tmp_path):
    """The mutant: a converter that kept llama.cpp's Q/K row order gives other logits."""
    from mlxpaged.loading.gguf import convert

    ref = write_gguf(tmp_path / "l.gguf", "llama")
    ckpt = convert_gguf(tmp_path / "l.gguf", cache_dir=tmp_path / "c", dtype="float32")
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "llama"
    model = reference_model("llama", ref)
    ids = mx.array([PROMPTS[0]])
    want = model(ids)
    got = load(str(ckpt), "float32").model(ids)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    kept = reference_model(
        "llama",
        {
            k: permute(v, HEADS if "q_proj" in k else KV) if k.endswith(("q_proj.weight", "k_proj.weight")) else v
            for k, v in ref.items()
        },
    )
    assert np.abs(np.array(kept(ids)) - np.array(want)).max() > 1e-2
    assert convert._llama_rows(8, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "f.gguf"), arch="falcon")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        GGUFError, match=r"^unsupported architecture 'falcon' in .*: mlxpaged supports qwen2, qwen3, llama$"
    ):
        convert_gguf(tmp_path / "f.gguf", cache_dir=tmp_path / "c")
