"""Writes a tiny random-weight Qwen2 checkpoint with a real (trained) byte-level BPE tokenizer.

Used by the tests, the notebook and `mlxpaged bench --tiny`, so it lives in the package.

The output layer is scaled up so the top logits are far apart: greedy choices are never near
ties, and tiny float differences between two correct implementations cannot flip a token.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

# ChatML, with tools and tool calls the way Qwen2.5's template writes them (tools in the system
# turn, calls as <tool_call> spans, results as <tool_response> in a user turn), so the tiny-model
# server exercises tool calling. Without tools it renders exactly as plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\n' }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}{{ 'You are a helpful assistant.' }}{% endif %}{{ '\n\n# Tools\n\nYou may call one or more "
    "functions to assist with the user query.\n\nYou are provided with function signatures within "
    "<tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n</tools>\n\nFor each function call, "
    "return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n\' }}{% endif %}'
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for tc in message.tool_calls %}{% set f = tc.function if tc.function is defined else tc %}"
    '{{ \'\n<tool_call>\n{"name": "\' + f.name + \'", "arguments": \' }}{{ f.arguments | tojson }}'
    "{{ '}\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The KV cache stores the keys and values of every token a sequence has seen.",
    "Paged attention borrows an idea from operating systems: virtual memory and paging.",
    "Write a Python function that reverses a string. def reverse(s): return s[::-1]",
    "Blocks of sixteen tokens are found through a block table, one per sequence.",
    "Copy-on-write lets many samples share the blocks of one prompt until they diverge.",
    "The quick brown fox jumps over the lazy dog. 0123456789 !?.,;:'\"()[]{}<>+-*/=_",
] * 4


def write_tokenizer(
    path: Path, vocab_size: int = 384, extra_special: tuple[str, ...] = (), template: str | None = None
) -> int:
    """A byte-level BPE tokenizer trained on `CORPUS`; `extra_special` tokens (a vision model's
    image markers) follow the three ChatML ones, `template` replaces `CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": template or CHAT_TEMPLATE,
                "model_max_length": 4096,
            }
        )
    )
    return tok.get_vocab_size()


def write_tiny_qwen2(
    path: Path,
    *,
    seed: int = 0,
    hidden: int = 256,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
    logit_scale: float = 4.0,
) -> Path:
    """A Qwen2 checkpoint directory at `path` (head_dim = hidden / heads)."""
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    eos = json.loads((path / "tokenizer.json").read_text())["added_tokens"][2]["id"]
    hd = hidden // heads
    config = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eos_token_id": eos,
    }
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)

    def w(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return mx.array(rng.normal(0, scale, size=shape).astype(np.float32))

    weights = {
        "model.embed_tokens.weight": w(vocab, hidden, scale=1.0),
        "model.norm.weight": mx.ones((hidden,)),
        "lm_head.weight": w(vocab, hidden, scale=logit_scale * hidden**-0.5),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "self_attn.q_proj.weight": w(heads * hd, hidden),
                p + "self_attn.q_proj.bias": w(heads * hd, scale=0.1),
                p + "self_attn.k_proj.weight": w(kv_heads * hd, hidden),
                p + "self_attn.k_proj.bias": w(kv_heads * hd, scale=0.1),
                p + "self_attn.v_proj.weight": w(kv_heads * hd, hidden),
                p + "self_attn.v_proj.bias": w(kv_heads * hd, scale=0.1),
                p + "self_attn.o_proj.weight": w(hidden, heads * hd),
                p + "mlp.gate_proj.weight": w(intermediate, hidden),
                p + "mlp.up_proj.weight": w(intermediate, hidden),
                p + "mlp.down_proj.weight": w(hidden, intermediate),
                p + "input_layernorm.weight": mx.ones((hidden,)),
                p + "post_attention_layernorm.weight": mx.ones((hidden,)),
            }
        )
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


# Qwen3-Next's and Qwen3.5's gated DeltaNet layers (every other layer full attention).
_GATED_DELTA = {
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
}

# DeepSeek-V3's and GLM-4.7-Flash's MLA attention and MoE (a dense first layer, one shared expert).
_MLA = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 64,
    "q_lora_rank": 96,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
}

# Per family: a small config in its checkpoint's own terms (head_dim = 256 / 4 = 64 unless set).
FAMILY_CONFIGS = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "sliding_window": None,
    },  # head_dim 32
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 2, "tie_word_embeddings": False},
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "num_key_value_heads": 2,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    "phi3": {
        "architectures": ["Phi3ForCausalLM"],
        "hidden_size": 384,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },  # head_dim 96, as Phi-3-mini's
    "gemma": {"architectures": ["GemmaForCausalLM"], "num_key_value_heads": 1, "head_dim": 64},
    "granite": {
        "architectures": ["GraniteForCausalLM"],
        "num_key_value_heads": 2,
        "logits_scaling": 0.5,
        "attention_multiplier": 0.1,
        "embedding_multiplier": 4.0,
        "residual_multiplier": 0.5,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    },
    "starcoder2": {
        "architectures": ["Starcoder2ForCausalLM"],
        "num_key_value_heads": 2,
        "norm_epsilon": 1e-5,
        "tie_word_embeddings": False,
    },
    "olmo2": {"architectures": ["Olmo2ForCausalLM"], "num_key_value_heads": 2, "tie_word_embeddings": False},
    # MoE: 4 experts, 2 a token, so routing is exercised (and a routing flip would change tokens).
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 128,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    },
    "glm4_moe": {
        "architectures": ["Glm4MoeForCausalLM"],
        "num_key_value_heads": 2,
        "head_dim": 64,
        "moe_intermediate_size": 128,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,  # layer 0 dense, layer 1 MoE (as GLM-4.5's first layers)
        "rope_scaling": None,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
        "tie_word_embeddings": False,
    },
    "phimoe": {
        "architectures": ["PhiMoEForCausalLM"],
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rope_scaling": None,
    },
    "ministral3": {
        "architectures": ["Ministral3ForCausalLM"],
        "num_key_value_heads": 2,
        "head_dim": 64,
        # Llama 4's position-dependent query scaling: with 16 original positions it varies within the prompts.
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 16,
        },
        "tie_word_embeddings": False,
    },
    # Sliding windows (overridden per test: smaller than, equal to and larger than a block).
    "gemma3_text": {
        "architectures": ["Gemma3ForCausalLM"],
        "num_key_value_heads": 1,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "sliding_window": 3,
        "sliding_window_pattern": 2,  # layer 0 local, layer 1 global
        "rope_scaling": None,
    },
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_scaling": None,
    },
    "gemma3": {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": "gemma3_text"},  # multimodal wrapper
    # Per-layer KV shapes: sliding layers (0, 2) 2 KV heads of 32, full ones (1, 3) one KV head of
    # 128 (K = V projection, partial "proportional" RoPE); layers 2 and 3 reuse the K/V of 0 and 1.
    "gemma4_text": {
        "architectures": ["Gemma4ForCausalLM"],
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "head_dim": 32,
        "global_head_dim": 128,
        "num_kv_shared_layers": 2,
        "sliding_window": 5,
        "sliding_window_pattern": 2,
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": None,  # set to the vocabulary by write_tiny_family
        "tie_word_embeddings": False,  # a tied output layer at this size repeats one token
        "rope_scaling": None,
    },
    "gemma4": {"architectures": ["Gemma4ForConditionalGeneration"], "text_config": "gemma4_text"},
    # Gemma 3n (text part): AltUp over 4 streams, LAuReL, activation sparsity on layer 0, per-layer
    # inputs; sliding layers 0 and 2, full 1 and 3; layers 2 and 3 read the caches of 0 and 1.
    "gemma3n": {"architectures": ["Gemma3nForConditionalGeneration"], "text_config": "gemma3n_text"},
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_kv_shared_layers": 2,
        "sliding_window": 5,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_local_base_freq": 10000.0,
        "final_logit_softcapping": 30.0,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": None,  # set to the vocabulary by write_tiny_family
        "altup_num_inputs": 4,
        "altup_coef_clip": 120.0,
        "altup_correct_scale": True,
        "altup_active_idx": 0,
        "laurel_rank": 8,
    },
    "olmo3": {
        "architectures": ["Olmo3ForCausalLM"],
        "num_key_value_heads": 2,
        "sliding_window": 9,
        "layer_types": ["sliding_attention", "full_attention"],
        "tie_word_embeddings": False,
    },
    # mlx-lm's llama4_text (MobileLLM-R1): full attention, NoPE layers, q/k RMS norm without weights.
    "llama4_text": {
        "architectures": ["Llama4ForCausalLM"],
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size_mlp": 512,
        "no_rope_layers": [1, 0],
        "use_qk_norm": True,
        "tie_word_embeddings": False,
    },
    # Llama 4 (chunked local attention, under `language_model`): layers 0-2 attend within chunks of
    # 6 positions (crossing blocks of 4 mid-block), layer 3 is global without RoPE; a floor_scale of
    # 4 makes its position-scaled queries differ from 1 at these lengths; MoE (1 expert a token and
    # a shared one) on layers 1 and 3.
    "llama4": {
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": "llama4_text",
        "num_hidden_layers": 4,
        "attention_bias": False,
        "attention_chunk_size": 6,
        "interleave_moe_layer_step": 2,
        "num_experts_per_tok": 1,
        "num_local_experts": 4,
        "rope_scaling": {"rope_type": "default"},
        "floor_scale": 4,
        "attn_scale": 0.1,
        "attn_temperature_tuning": True,
        "layer_types": ["chunked_attention"] * 3 + ["full_attention"],  # HF's config checks them
        "no_rope_layers": None,  # llama4_text's; mlx-lm's llama4 drops RoPE on every 4th layer itself
    },
    # Wrappers: the text model sits inside another module (mistral3) or reuses another family's (smollm3).
    "mistral3": {"architectures": ["Mistral3ForConditionalGeneration"], "text_config": "mistral"},
    "smollm3": {
        "architectures": ["SmolLM3ForCausalLM"],
        "num_key_value_heads": 2,
        "no_rope_layer_interval": 2,  # layer 1 of 2 has no RoPE (NoPE)
        "tie_word_embeddings": True,
    },
    # Multi-head latent attention (paged_adapter.LatentLayerCache): latent 64, rope dim 32 (rows of 96).
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], **_MLA},
    "kimi_k2": {"architectures": ["DeepseekV3ForCausalLM"], **_MLA},  # deepseek_v3's module
    "glm4_moe_lite": {"architectures": ["Glm4MoeLiteForCausalLM"], **_MLA, "q_lora_rank": None},
    # Hybrid recurrent families (models/recurrent.py): layer 0 is recurrent, layer 1 full attention.
    "qwen3_next": {
        "architectures": ["Qwen3NextForCausalLM"],
        **_GATED_DELTA,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 128,
        "moe_intermediate_size": 128,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "partial_rotary_factor": 0.25,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
    "qwen3_5": {"architectures": ["Qwen3_5ForCausalLM"], **_GATED_DELTA, "tie_word_embeddings": False},
    "qwen3_5_moe": {  # the multimodal wrapper, text model under `language_model`
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": "qwen3_5_moe",
        **_GATED_DELTA,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 128,
        "moe_intermediate_size": 128,
        "tie_word_embeddings": False,
    },
    "lfm2": {
        "architectures": ["Lfm2ForCausalLM"],
        "num_key_value_heads": 2,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 256,
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "block_ff_dim": 512,
        "layer_types": ["conv", "full_attention"],
    },
    "granitemoehybrid": {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "num_key_value_heads": 2,
        "attention_bias": False,
        "embedding_multiplier": 2.0,
        "attention_multiplier": 0.125,
        "logits_scaling": 1.0,
        "residual_multiplier": 0.5,
        "layer_types": ["mamba", "attention"],
        "mamba_n_heads": 8,
        "mamba_d_head": 64,
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 256,
        "tie_word_embeddings": False,
    },
}

# Families whose RMSNorm scales by 1 + weight: their norm weights are written as zeros.
ONE_PLUS_NORMS = ("gemma", "gemma2", "gemma3_text", "gemma3")
# An MoE router's weights are drawn this much larger than other matrices, so the experts a token
# picks are far apart (as `logit_scale` does for the output layer): tiny float differences
# between two correct implementations, or an 8-bit KV cache, cannot flip a routing choice.
ROUTER_SCALE = 16.0
# Keys a config may hold as null (GLM-4.5's rope_scaling is; its ModelArgs requires the key).
KEEP_NULL = ("rope_scaling",)
# Per wrapper family: the keys that stay at the top level; the rest go to `text_config`.
WRAPPER_KEYS = ("model_type", "architectures", "torch_dtype", "eos_token_id", "vocab_size")


def write_tiny_thinker(path: Path) -> Path:
    """A tiny Qwen2 checkpoint whose tokenizer has `<think>`/`</think>` (mlx-lm then finds the
    markers) and whose template opens the think block in the generation prompt, as Qwen3's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    write_tiny_qwen2(path, hidden=64, layers=1, intermediate=128)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    gen = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE.replace(gen, gen.replace("assistant\n", "assistant\n<think>\n"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


# Gemma 4 scales its embeddings by sqrt(hidden): drawn at 1 they would drown every layer's output
# (RMS 1 after its post-norms), so the tokens would barely depend on attention.
EMBED_STD = {"gemma4_text": 256**-0.5, "gemma4": 256**-0.5, "gemma3n": 256**-0.5}
# Gemma 3n ties its output layer to the embedding, which then dominates the residual stream, and
# repeats one token; its layers' post-norms drawn larger let attention decide the tokens.
NORM_WEIGHTS = {"gemma3n": 8.0}
# lfm2 ties its output layer to the embedding, and at 4.0 its random checkpoint repeats one token;
# llama4 at 4.0 has near-ties within its first 8 tokens (too close for the 8-bit test to compare).
LOGIT_SCALES = {"lfm2": 1.0, "llama4": 8.0}


def write_tiny_family(
    path: Path, model_type: str, *, seed: int = 0, layers: int = 2, logit_scale: float | None = None, **overrides
) -> Path:
    """A tiny random checkpoint of an mlx-lm family, built by mlx-lm's own `ModelArgs` and `Model`.

    The weights are the model's own parameter tree (so its names are the checkpoint's), redrawn
    from a seeded normal: matrices at 1/sqrt(fan-in), norms at one, the output layer (or a tied
    embedding) scaled so greedy choices are far from ties.
    """
    from mlx.utils import tree_flatten

    from ..models.paged_adapter import family_module

    logit_scale = LOGIT_SCALES.get(model_type, 4.0) if logit_scale is None else logit_scale
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    eos = json.loads((path / "tokenizer.json").read_text())["added_tokens"][2]["id"]
    config = {
        "model_type": model_type,
        "hidden_size": 256,
        "num_hidden_layers": layers,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "eos_token_id": eos,
        **FAMILY_CONFIGS.get(model_type, {}),
        **overrides,
    }
    if "vocab_size_per_layer_input" in config:
        config["vocab_size_per_layer_input"] = vocab
    config = {k: v for k, v in config.items() if v is not None or k in KEEP_NULL}
    if isinstance(config.get("text_config"), str):  # a wrapper: the text model is that family's config
        inner = {
            **config,
            **FAMILY_CONFIGS.get(config["text_config"], {}),
            **overrides,
            "model_type": config["text_config"],
        }
        inner.pop("architectures", None)
        inner.pop("text_config")
        if "vocab_size_per_layer_input" in inner:
            inner["vocab_size_per_layer_input"] = vocab
        inner = {k: v for k, v in inner.items() if v is not None}
        config = {k: v for k, v in config.items() if k in WRAPPER_KEYS} | {"text_config": inner}
    module = family_module(model_type)
    model = module.Model(module.ModelArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    text = config.get("text_config") or config
    weights = {}
    vocab_rows = [(n, q) for n, q in tree_flatten(model.parameters()) if q.ndim and q.shape[0] == vocab]
    for name, p in tree_flatten(model.parameters()):
        if p.ndim == 0:  # a learned scalar (apertus's activation): as the module initialises it
            a = np.array(p)
        elif name.endswith("layer_scalar"):  # Gemma 4 multiplies each layer's output by it
            a = np.ones(p.shape)
        elif "norm" in name and p.ndim == 1:  # norm weights one (gemma's RMSNorm adds its own one), biases zero
            a = np.zeros(p.shape) if (name.endswith("bias") or model_type in ONE_PLUS_NORMS) else np.ones(p.shape)
            if model_type in NORM_WEIGHTS and ".post_" in name and not name.endswith("bias"):
                a = a * NORM_WEIGHTS[model_type]
        elif name.endswith("sinks"):  # gpt-oss's per-head sink logits: large enough to change the tokens
            a = rng.normal(1.0, 1.0, size=p.shape)
        elif p.ndim == 1:
            a = rng.normal(0, 0.1, size=p.shape)
        elif name.endswith("embed_tokens.weight"):
            tied = text.get("tie_word_embeddings", True)
            std = logit_scale * p.shape[-1] ** -0.5 if tied else EMBED_STD.get(model_type, 1.0)
            a = rng.normal(0, std, size=p.shape)
        elif name.endswith((".gate.weight", ".router.weight")):  # an MoE router: expert choices far from ties
            a = rng.normal(0, ROUTER_SCALE * p.shape[-1] ** -0.5, size=p.shape)
        elif name.endswith("lm_head.weight") or name == "output.weight":  # llama4_text names it output
            a = rng.normal(0, logit_scale * p.shape[-1] ** -0.5, size=p.shape)
        elif model_type not in FAMILY_CONFIGS and p.ndim == 2 and p.shape[0] == vocab:
            # other names for the embedding (wte, embed_in) and output layer (embed_out): an output
            # layer, or an embedding the output layer is tied to, gets the logit scale
            embedding = any(k in name for k in ("embed", "wte", "tok_")) and not name.endswith("embed_out.weight")
            tied = sum(1 for _, q in vocab_rows if q.ndim == 2) == 1
            std = logit_scale * p.shape[-1] ** -0.5 if (tied or not embedding) else 1.0
            a = rng.normal(0, std, size=p.shape)
        else:
            a = rng.normal(0, p.shape[-1] ** -0.5, size=p.shape)
        weights[name] = mx.array(a.astype(np.float32))
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path
