"""Every model type mlx-lm runs, as a tiny random checkpoint written by mlx-lm's own classes.

`model_types()` lists each module of `mlx_lm.models` that defines a `Model` and `ModelArgs`,
plus the model types mlx-lm remaps onto one of them (`mlx_lm.utils.MODEL_REMAPPING`: a
checkpoint says `mistral`, mlx-lm runs `llama`). `write_zoo(path, model_type)` writes one
checkpoint of that type: its config is the module's `ModelArgs` fields at small sizes (a field
named as the common configs name it gets the zoo's size; a few modules need more, `ZOO_CONFIGS`),
its weights are drawn by `write_tiny_family` from the module's own parameter tree.

The families with a hand-written config (`tiny_model.FAMILY_CONFIGS`) keep it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import pkgutil
from pathlib import Path

from .tiny_model import FAMILY_CONFIGS, write_tiny_family

H, HEADS, KV_HEADS, HEAD_DIM, FF, LAYERS = 64, 4, 2, 16, 128, 2
EXPERTS, TOP_K, EXPERT_FF = 4, 2, 64
SLIDING = ["sliding_attention", "full_attention"]

# A field of this name is set to the zoo's size whatever its default (mlx-lm's defaults are
# full-size models: deepseek's hidden_size defaults to 4096).
SIZES = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "model_dim", "hidden_dim", "dim"), H),
    **dict.fromkeys(
        ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_transformer_layers", "num_layer"), LAYERS
    ),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "num_query_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), KV_HEADS),
    "head_dim": HEAD_DIM,
    **dict.fromkeys(
        ("intermediate_size", "ffn_hidden_size", "n_inner", "ff_intermediate_size", "intermediate_size_mlp"), FF
    ),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "model_max_length"), 4096),
    **dict.fromkeys(
        (
            "moe_intermediate_size",
            "expert_ffn_hidden_size",
            "shared_expert_intermediate_size",
            "shared_intermediate_size",
            "expert_intermediate_size",
        ),
        EXPERT_FF,
    ),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "top_k"), TOP_K),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "num_shared_expert", "moe_num_shared_experts"), 1),
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}
# A required field (no default) of this name gets this value.
REQUIRED = {
    "rope_theta": 10000.0,
    "rotary_emb_base": 10000.0,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
    "rope_scaling": None,
    "partial_rotary_factor": 0.5,
    "rotary_pct": 0.5,
    "hidden_act": "silu",
}

# Kimi Delta Attention on layer 0, latent attention (MLA) on layer 1; latent rows of 48 + 16, so
# an 8-bit cache's groups of 32 fit
KIMI_LINEAR = {
    "linear_attn_config": {"kda_layers": [1], "num_heads": HEADS, "head_dim": HEAD_DIM, "short_conv_kernel_size": 4},
    "num_experts_per_token": TOP_K,
    "kv_lora_rank": 48,
}

# What the generic fill cannot guess, per model type (in the checkpoint's own terms).
ZOO_CONFIGS: dict[str, dict] = {
    "dbrx": {
        "ffn_config": {"ffn_hidden_size": FF, "moe_num_experts": EXPERTS, "moe_top_k": TOP_K},
        "attn_config": {"kv_n_heads": KV_HEADS, "clip_qkv": 8.0, "rope_theta": 10000.0},
    },
    "openelm": {
        "num_query_heads": [HEADS] * LAYERS,
        "num_kv_heads": [KV_HEADS] * LAYERS,
        "ffn_multipliers": [2.0] * LAYERS,
        "ffn_dim_divisor": 16,
    },
    "afm7": {"num_kv_reuse_layers": 1},
    "minicpm": {"dim_model_base": H, "scale_depth": 1.4, "scale_emb": 2.0},
    "phi3small": {
        "dense_attention_every_n_layers": 2,
        "blocksparse_block_size": 32,
        "gegelu_limit": 20.0,
        "blocksparse_num_local_blocks": 4,
        "blocksparse_vert_stride": 2,
    },
    "nemotron": {"hidden_act": "relu2", "partial_rotary_factor": 0.5},
    "olmoe": {"num_experts": EXPERTS},
    "granitemoe": {
        "logits_scaling": 1.0,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
    },
    "lille-130m": {"block_size": 4096},
    # sliding windows of 5 (over blocks of 4 and 16), every other layer
    "afmoe": {"layer_types": SLIDING, "sliding_window": 5},
    "gear": {"layer_types": SLIDING, "sliding_window": 5},
    "exaone4": {"sliding_window": 5, "sliding_window_pattern": "LG", "layer_types": SLIDING},
    "exaone_moe": {"sliding_window": 5, "layer_types": SLIDING, "is_moe_layer": [False, True]},
    "mellum": {
        "sliding_window": 5,
        "layer_types": SLIDING,
        "rope_parameters": {t: {"rope_type": "default", "rope_theta": 10000.0} for t in SLIDING},
    },
    "cohere2": {"sliding_window": 5, "sliding_window_pattern": 2},
    "spark2_5": {
        "sliding_window": 5,
        "layer_types": SLIDING,
        "rope_parameters": {t: {"rope_type": "default", "rope_theta": 10000.0} for t in SLIDING},
    },
    "step3p5": {
        "num_attention_groups": KV_HEADS,
        "moe_num_experts": EXPERTS,
        "moe_top_k": TOP_K,
        "moe_intermediate_size": EXPERT_FF,
        "share_expert_dim": EXPERT_FF,
        "sliding_window": 5,
    },
    # partial rotary: these modules default to a rotary width wider than the zoo's heads
    **dict.fromkeys(("minimax", "minimax_m2", "gptj", "phixtral", "phi-msft"), {"rotary_dim": 8}),
    # a soft cap near the tiny model's scores, so capping changes the tokens; its tied embedding
    # drawn small (logit_scale), else it dominates the residual stream and the model repeats a token
    "gemma2": {"attn_logit_softcapping": 2.0, "query_pre_attn_scalar": HEAD_DIM, "logit_scale": 0.25},
    "qwen": {"kv_channels": HEAD_DIM, "intermediate_size": 2 * FF},
    "plamo": {"n_shared_head": 2},
    # layer 0 sliding (window 5) with RoPE, layer 1 full without RoPE; MoE at a compressed width
    "muse_spark": {
        "rope_parameters": {"rope_theta": 10000.0},
        "layer_rope_theta": [10000.0, 0.0],
        "layer_types": SLIDING,
        "sliding_window": 5,
        "final_logit_softcapping": 30.0,
        "output_multiplier": 1.0,
        "moe_hidden_size": 32,
        "num_shared_experts": 0,
    },
    # its second pass attends within a window of 5 (over blocks of 4 and 16)
    "iquestloopcoder": {"loop_window_size": 5},
    "hunyuan": {
        "use_mixed_mlp_moe": True,
        "use_qk_norm": True,
        "use_cla": False,
        "cla_share_factor": 2,
        "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
    },
    "qwen3_vl": {"rope_theta": 10000.0},
    # recurrent and hybrid modules recurrent.py does not run: checkpoints for their refusals
    "jamba": {
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "mamba_d_conv": 4,
        "mamba_d_state": 8,
        "mamba_expand": 2,
    },
    "nemotron_h": {
        "hybrid_override_pattern": ["M", "*"],
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 8,
        "conv_kernel": 4,
        "n_groups": 1,
    },
    "recurrent_gemma": {
        "conv1d_width": 4,
        "logits_soft_cap": 30.0,
        "attention_window_size": 5,
        "block_types": ["recurrent", "attention"],
        "num_key_value_heads": 1,  # its local attention has one KV head, whatever a config says
        "num_attention_heads": 2,  # rows of 32, so an 8-bit cache's groups of 32 fit
    },
    "rwkv7": {"a_low_rank_dim": 8, "v_low_rank_dim": 8, "gate_low_rank_dim": 8, "decay_low_rank_dim": 8},
    # Llama-3.1-Nemotron (NAS): layer 0 without attention, layer 1 plain attention (2 heads a KV
    # head), so mlx-lm's one cache belongs to layer 1
    "nemotron-nas": {
        "block_configs": [
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 2.0}},
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
        ],
    },
    "mimo_v2_flash": {
        "hybrid_layer_pattern": [1, 0],  # layer 0 sliding (with attention sinks), layer 1 full
        "moe_layer_freq": [0, 1],
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "sliding_window_size": 5,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "rope_theta": 10000.0,
        "swa_rope_theta": 10000.0,
        "swa_num_attention_heads": HEADS,
        "swa_num_key_value_heads": KV_HEADS,
        "swa_head_dim": HEAD_DIM,
        "swa_v_head_dim": HEAD_DIM,
        "v_head_dim": HEAD_DIM,
        "layernorm_epsilon": 1e-5,
        "partial_rotary_factor": 0.5,
    },
    "deepseek_v2": {
        "rope_scaling": {
            "type": "yarn",
            "factor": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    },
    "minicpm3": {
        "dim_model_base": H,
        "scale_depth": 1.4,
        "scale_emb": 2.0,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [1.0] * 8,
            "original_max_position_embeddings": 4096,
        },
    },
    "mistral4": {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 16,
        },
    },
    "lfm2_moe": {"num_dense_layers": 1, "conv_L_cache": 3, "layer_types": ["conv", "full_attention"]},
    "lfm2-vl": {
        **{k: v for k, v in FAMILY_CONFIGS["lfm2"].items() if k != "architectures"},
        "block_dim": H,
        "block_ff_dim": FF,
        "block_multiple_of": 16,
    },
    "mamba": {"state_size": 8, "conv_kernel": 4, "time_step_rank": 4, "use_conv_bias": True},
    "falcon_mamba": {"state_size": 8, "conv_kernel": 4, "time_step_rank": 4, "use_conv_bias": True},
    "mamba2": {
        "num_heads": 8,
        "head_dim": 16,
        "state_size": 8,
        "conv_kernel": 4,
        "n_groups": 1,
        "time_step_rank": 4,
        "time_step_limit": [0.0, 1000.0],
        "use_conv_bias": True,
    },
    # Mamba-2 and attention in every layer; rows of 32 so an 8-bit cache's groups of 32 fit; logits
    # at full scale (its muP head multiplier leaves a tiny model's tokens a few thousandths apart)
    "falcon_h1": {
        "head_dim": 32,
        "mamba_d_ssm": 128,
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_state": 8,
        "lm_head_multiplier": 1.0,
    },
    # Kimi Delta Attention on layer 0, latent attention (MLA) on layer 1
    "kimi_linear": KIMI_LINEAR,
    # gated DeltaNet on layer 0, full attention on layer 1
    "olmo_hybrid": {
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": HEAD_DIM,
        "linear_value_head_dim": HEAD_DIM,
        "linear_conv_kernel_dim": 4,
        "linear_allow_neg_eigval": True,
        "layer_types": ["linear_attention", "full_attention"],
    },
    # linear attention on layer 0, full attention on layer 1 (every second layer)
    "bailing_moe_linear": {"layer_group_size": 2, "group_norm_size": 1, "first_k_dense_replace": 1, "head_dim": 32},
    # linear attention on layer 0, latent attention (MLA) on layer 1
    "bailing_hybrid": {"layer_group_size": 2, "group_norm_size": 1, "first_k_dense_replace": 1},
    # Kimi K3's text model: as Kimi Linear's
    "kimi_k3": {**KIMI_LINEAR, "hidden_act": "situ"},
    # two latent attentions (MLA) in every layer, each with its own cache (mlx-lm's CacheList)
    **dict.fromkeys(
        ("longcat_flash", "longcat_flash_ngram"),
        {
            "attention_method": "MLA",
            "zero_expert_type": "identity",
            "zero_expert_num": 1,
            "kv_lora_rank": 48,
            "mla_scale_q_lora": True,  # (mlx-lm reads both scales whatever these say)
            "mla_scale_kv_lora": True,
        },
    ),
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): an indexer's keys beside the latent rows,
    # picking 8 earlier tokens per query (fewer than the prompt's); latent rows of 48 + 16
    "deepseek_v32": {"index_head_dim": 32, "index_n_heads": 2, "index_topk": 8, "kv_lora_rank": 48},
    "glm_moe_dsa": {
        "index_head_dim": 32,
        "index_n_heads": 2,
        "index_topk": 8,
        "kv_lora_rank": 48,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "moe_layer_freq": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # a sliding layer (a window of 5) and a full one, each attention convolving its keys and values
    # with the previous token's (mlx-lm's CacheList of an ArraysCache and a KV cache)
    "baichuan_m1": {"sliding_window": 5, "sliding_window_layers": [0], "conv_window": 2},
    # its attention has as many KV heads as heads, whatever a config says (GPT-NeoX configs name none)
    "gpt_neox": {"num_key_value_heads": None},
    "gpt2": {"num_key_value_heads": None},
}

# A wrapper's own fields beside its text_config (muse_spark: transformers' config check, run when
# the tokenizer loads, wants the audio encoder's output as wide as the text model).
WRAPPER_CONFIGS: dict[str, dict] = {"muse_spark": {"audio_config": {"out_hidden_size": H}}}


def _quiet_import(name: str):
    with contextlib.redirect_stdout(io.StringIO()):  # some modules print when a package is missing
        return importlib.import_module(f"mlx_lm.models.{name}")


def model_modules() -> list[str]:
    """Every module of mlx_lm.models, but the helper modules (those without `Model` and `ModelArgs`).
    A module that fails to import (olmo: it needs the ai2-olmo package) is listed."""
    import mlx_lm.models

    out = []
    for m in pkgutil.iter_modules(mlx_lm.models.__path__):
        try:
            module = _quiet_import(m.name)
        except (Exception, SystemExit):
            out.append(m.name)
            continue
        if hasattr(module, "Model") and hasattr(module, "ModelArgs"):
            out.append(m.name)
    return sorted(out)


def remapped_types() -> dict[str, str]:
    """mlx-lm's model types that run another type's module (mistral -> llama)."""
    from mlx_lm import utils

    return dict(getattr(utils, "MODEL_REMAPPING", {}))


def model_types() -> list[str]:
    """Every model type the zoo covers: the modules and the remapped types."""
    return sorted(set(model_modules()) | set(remapped_types()))


def _fill(args_class, vocab: int, extra: dict) -> dict:
    """A config for `args_class` (a dataclass): SIZES by name, REQUIRED where there is no default."""
    config = {}
    for f in dataclasses.fields(args_class):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name in SIZES:
            config[f.name] = SIZES[f.name]
        elif f.name == "vocab_size":
            config[f.name] = vocab
        elif "eps" in f.name and required:
            config[f.name] = 1e-5
        elif f.name in REQUIRED and required:
            config[f.name] = REQUIRED[f.name]
        elif required and f.type in (bool, "bool"):
            config[f.name] = False
    return {**config, **extra}


def _text_args_class(module):
    """The args class of a wrapper's text model (its `text_config`), or None for a plain module."""
    names = {f.name for f in dataclasses.fields(module.ModelArgs)}
    if "text_config" not in names:
        return None
    for attr in ("TextConfig", "TextArgs", "TextModelArgs"):
        if dataclasses.is_dataclass(getattr(module, attr, None)):
            return getattr(module, attr)
    for value in vars(module).values():  # qwen2_vl: `from . import qwen2`
        if getattr(value, "__name__", "").startswith("mlx_lm.models.") and hasattr(value, "ModelArgs"):
            return value.ModelArgs
    return None


def zoo_config(model_type: str, vocab: int) -> dict:
    """The overrides `write_tiny_family` gets for `model_type` (empty for a FAMILY_CONFIGS family)."""
    if model_type in FAMILY_CONFIGS:
        return {}
    target = remapped_types().get(model_type)
    if isinstance(FAMILY_CONFIGS.get(target, {}).get("text_config"), str):  # gemma4_unified: gemma4's
        return {k: v for k, v in FAMILY_CONFIGS[target].items() if k != "architectures"}
    from ..models.paged_adapter import family_module

    module = family_module(model_type)
    extra = dict(ZOO_CONFIGS.get(model_type, {}))
    text_class = _text_args_class(module)
    if text_class is None:
        return _fill(module.ModelArgs, vocab, extra)
    text = _fill(text_class, vocab, extra)
    text.setdefault("model_type", model_type)
    return {"text_config": text, "vocab_size": vocab, **WRAPPER_CONFIGS.get(model_type, {})}


def write_zoo(path: Path, model_type: str, seed: int = 0) -> Path:
    """A tiny random checkpoint of `model_type` at `path`, built by mlx-lm's ModelArgs and Model."""
    from .tiny_model import write_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    overrides = zoo_config(model_type, vocab)
    if not overrides:
        return write_tiny_family(path, model_type, seed=seed)
    layers = overrides.pop("num_hidden_layers", LAYERS)
    return write_tiny_family(path, model_type, seed=seed, layers=layers, **overrides)


# The prompt the zoo compares on: about 20 tokens, so blocks of 4 and chunks of 7 cross mid-prompt.
PROMPT = "Paged attention borrows an idea from operating systems: virtual memory and paging."
