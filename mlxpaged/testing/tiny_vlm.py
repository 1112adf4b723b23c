"""Tiny random vision-language checkpoints, written by mlx-vlm's own config and model classes.

`write_tiny_vlm(path, model_type)` builds the family's `ModelConfig` and `Model` from
`mlx_vlm.models.<family>` at small sizes, draws its weights from a seeded normal (as
tiny_model.py does for mlx-lm families), and writes them with mlx-vlm's own `save_weights`, next
to a trained byte-level BPE tokenizer with the family's image markers as special tokens, a chat
template that writes them where the messages hold an image, and the image processor's config
(everything offline: mlx-vlm's processor reads these files and asks the hub for nothing).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from .tiny_model import write_tokenizer

# Qwen2-VL's chat template, as its checkpoints write it: an image content part becomes
# <|vision_start|><|image_pad|><|vision_end|>, which the processor widens to one pad per image token.
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' or 'image' in c %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN_VL_SPECIAL = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

HIDDEN, HEADS, KV_HEADS, LAYERS, FF = 64, 4, 2, 2, 128  # head_dim 16: mrope sections sum to 8
VISION_FF = 48  # not HIDDEN: the projector's output layers are the vision matrices HIDDEN rows tall
PATCH, MERGE = 14, 2


def _text(model_type: str, vocab: int, **extra) -> dict:
    """A small text config in Qwen's terms."""
    return {
        "model_type": model_type,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FF,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        **extra,
    }


def _vision(model_type: str, **extra) -> dict:
    """A small Qwen vision tower: 14-pixel patches merged 2x2 into the text model's width."""
    return {
        "model_type": model_type,
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": VISION_FF,
        "out_hidden_size": HIDDEN,
        "num_heads": 2,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        **extra,
    }


def _qwen_ids(ids: dict) -> dict:
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def _qwen_vl(model_type: str, ids: dict, vocab: int) -> dict:
    text = _text(model_type, vocab, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    vision = _vision(model_type, spatial_patch_size=PATCH, window_size=56, fullatt_block_indexes=[1])
    # Qwen2.5-VL's config is flat: its text fields at the top level (mlx-vlm reads them there)
    return {**text, "text_config": dict(text), "vision_config": vision, **_qwen_ids(ids), "vocab_size": vocab}


def _qwen2_vl(model_type: str, ids: dict, vocab: int) -> dict:
    """Qwen2-VL: Qwen2.5-VL's flat config, a vision tower without windows (width `embed_dim`)."""
    text = _text(model_type, vocab, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    vision = {
        "model_type": model_type,
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": HIDDEN,
        "num_heads": 2,
        "mlp_ratio": 3,  # an int (transformers checks it); 96 wide, not HIDDEN (see VISION_FF)
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
    }
    return {**text, "text_config": dict(text), "vision_config": vision, **_qwen_ids(ids), "vocab_size": vocab}


def _qwen3_vl(model_type: str, ids: dict, vocab: int) -> dict:
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    text = _text(model_type, vocab, head_dim=HIDDEN // HEADS, rope_scaling=rope)
    if model_type.endswith("_moe"):
        text |= {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
        }
    return _qwen3_config(model_type, text, ids, vocab, deepstack=[0])


def _qwen3_config(model_type: str, text: dict, ids: dict, vocab: int, deepstack: list[int]) -> dict:
    """Qwen3-VL's and Qwen3.5's config around `text`: a vision tower adding its `deepstack` layers' features."""
    vision = _vision(model_type, num_position_embeddings=256, deepstack_visual_indexes=deepstack)
    return {
        "model_type": model_type,
        "text_config": text,
        "vision_config": vision,
        **_qwen_ids(ids),
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }


def _siglip(image_size: int) -> dict:
    """A small SigLIP tower (Gemma 3's, Idefics3's): 14-pixel patches of `image_size` squares."""
    return {
        "model_type": "siglip_vision_model",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": VISION_FF,
        "num_attention_heads": 2,
        "patch_size": PATCH,
        "image_size": image_size,
    }


# Gemma 3's image marker: <start_of_image>, which its processor widens to
# "\n\n<start_of_image>" + <image_soft_token> * image_seq_length + "<end_of_image>\n\n".
GEMMA3_SPECIAL = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
GEMMA3_TEMPLATE = QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<start_of_image>")
GEMMA3_IMAGE, GEMMA3_TOKENS = 56, 4  # 4x4 patches of 14 pixels, pooled 2x2: 4 image tokens


def _gemma3(model_type: str, ids: dict, vocab: int) -> dict:
    # two layers: a sliding window of 8 (shorter than every prompt here), then a global one
    text = _text("gemma3_text", vocab, head_dim=HIDDEN // HEADS, query_pre_attn_scalar=1)
    text |= {"sliding_window": 8, "sliding_window_pattern": 2, "mm_tokens_per_image": GEMMA3_TOKENS}
    return {
        "model_type": model_type,
        "text_config": text,
        "vision_config": _siglip(GEMMA3_IMAGE),
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "pad_token_id": ids["<|endoftext|>"],
        "hidden_size": HIDDEN,
        "vocab_size": vocab,
    }


# Gemma 3's pan-and-scan with crops as small as 28 pixels: a 200x150 image (wider than 1.2:1) is
# seen whole and as 2 crops, each a 56-pixel square of GEMMA3_TOKENS image tokens
GEMMA3_PAN_AND_SCAN = {
    "do_pan_and_scan": True,
    "pan_and_scan_min_crop_size": PATCH * 2,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}


def _gemma3_files(path: Path, tiles: bool = False) -> None:
    """Gemma 3's image processor (56-pixel squares; pan-and-scan with `tiles`) and its
    tokenizer's names for the image markers (its processor reads them off the tokenizer)."""
    image = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "size": {"height": GEMMA3_IMAGE, "width": GEMMA3_IMAGE},
        **(GEMMA3_PAN_AND_SCAN if tiles else {"do_pan_and_scan": False}),
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 2,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(image))
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": GEMMA3_TOKENS}
    (path / "processor_config.json").write_text(json.dumps(processor))
    _name_special_tokens(
        path, boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>"
    )


def _name_special_tokens(path: Path, **names: str) -> None:
    """Name the image markers in the tokenizer's config (`extra_special_tokens`), as the real
    checkpoints do: the processor finds its tokens by these names."""
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["extra_special_tokens"] = names
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


# Gemma 4: its image token as the marker, which the processor widens to <|image> + <|image|> * n +
# <image|> (n: the image's patches pooled 2x2, at most GEMMA4_TOKENS); <|video|> named so the
# processor adds no token to the vocabulary.
GEMMA4_SPECIAL = ("<|image>", "<|image|>", "<image|>", "<|video|>")
GEMMA4_TEMPLATE = QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<|image|>")
GEMMA4_TOKENS = 6


def _gemma4(model_type: str, ids: dict, vocab: int) -> dict:
    """Gemma 4's per-layer KV shapes (the full layers wider, one KV head, K = V), its last two
    layers reading the first two's K/V, per-layer inputs, sliding windows of 8; a tower pooling
    2x2 patches."""
    text = _text("gemma4_text", vocab, head_dim=16, final_logit_softcapping=30.0)
    text |= {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "global_head_dim": 32,
        "num_kv_shared_layers": 2,
        "sliding_window": 8,
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": vocab,
        "use_bidirectional_attention": None,  # causal over image tokens (see models/vision.py)
    }
    vision = {
        "model_type": "gemma4_vision",
        "hidden_size": 32,
        "intermediate_size": VISION_FF,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 16,
        "patch_size": PATCH,
        "pooling_kernel_size": 2,
        "position_embedding_size": 64,
        "default_output_length": GEMMA4_TOKENS,
    }
    return {
        "model_type": model_type,
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image|>"],
        "boi_token_id": ids["<|image>"],
        "eoi_token_id": ids["<image|>"],
        "video_token_id": ids["<|video|>"],
        "audio_token_id": vocab + 1,  # no audio tower: an id no token has
        "pad_token_id": ids["<|endoftext|>"],
        "hidden_size": HIDDEN,
        "vocab_size": vocab,
        "vision_soft_tokens_per_image": GEMMA4_TOKENS,
        "tie_word_embeddings": False,
    }


def _gemma4_files(path: Path) -> None:
    """Gemma 4's processor: patches of 14 pixels pooled 2x2, at most GEMMA4_TOKENS per image; its
    tokenizer's names for the image markers."""
    image = {"patch_size": PATCH, "max_soft_tokens": GEMMA4_TOKENS, "pooling_kernel_size": 2}
    (path / "processor_config.json").write_text(
        json.dumps({"processor_class": "Gemma4Processor", "image_processor": image})
    )
    _name_special_tokens(
        path, boi_token="<|image>", image_token="<|image|>", eoi_token="<image|>", video_token="<|video|>"
    )


# SmolVLM / Idefics3: an <image> part, which the processor widens to
# <fake_token_around_image><global-img> + <image> * image_seq_len + <fake_token_around_image>.
IDEFICS3_SPECIAL = ("<fake_token_around_image>", "<global-img>", "<image>", "<end_of_utterance>")
IDEFICS3_TEMPLATE = QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
IDEFICS3_IMAGE = 56  # 4x4 patches of 14 pixels, pixel-shuffled 2x2: 4 image tokens


def _idefics3(model_type: str, ids: dict, vocab: int) -> dict:
    text = _text(model_type, vocab)
    return {
        "model_type": model_type,
        "text_config": text,
        "vision_config": _siglip(IDEFICS3_IMAGE),
        "image_token_id": ids["<image>"],
        "scale_factor": 2,
        "vocab_size": vocab,
    }


IDEFICS3_SPLIT_EDGE = 3 * IDEFICS3_IMAGE  # with splitting: the longest edge to 3 tiles (real: 4 x 364 or 384)


def _idefics3_files(path: Path, processor_class: str, tiles: bool = False) -> None:
    """SmolVLM's image processor: each image resized to one 56-pixel square; with `tiles`, as the
    real checkpoints do it, resized to a 168-pixel longest edge and split into 56-pixel tiles (a
    200x150 image: 3x3 tiles and the whole image, each tile's tokens after its <row_r_col_c>)."""
    image = {
        "image_processor_type": "SmolVLMImageProcessor"
        if processor_class == "SmolVLMProcessor"
        else "Idefics3ImageProcessor",
        "processor_class": processor_class,
        "do_image_splitting": tiles,
        "size": {"longest_edge": IDEFICS3_SPLIT_EDGE if tiles else IDEFICS3_IMAGE},
        "max_image_size": {"longest_edge": IDEFICS3_IMAGE},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 1,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(image))
    tokens = (IDEFICS3_IMAGE // PATCH) ** 2 // 4
    (path / "processor_config.json").write_text(
        json.dumps({"processor_class": processor_class, "image_seq_len": tokens})
    )


# Mistral 3 (Pixtral's vision): an [IMG] part, which the processor widens to rows of [IMG]
# separated by [IMG_BREAK], ended by [IMG_END] (one [IMG] per 2x2 merged 14-pixel patches).
MISTRAL3_SPECIAL = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
MISTRAL3_TEMPLATE = QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "[IMG]")
PIXTRAL_IMAGE = 56  # Pixtral's 14-pixel patches unmerged: at most 4x4 image tokens


def _mistral3(model_type: str, ids: dict, vocab: int) -> dict:
    text = _text("mistral", vocab, head_dim=HIDDEN // HEADS)
    vision = {
        "model_type": "pixtral",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "head_dim": 16,
        "intermediate_size": VISION_FF,
        "num_attention_heads": 2,
        "image_size": PATCH * MERGE * 4,
        "patch_size": PATCH,
    }
    return {
        "model_type": model_type,
        "text_config": text,
        "vision_config": vision,
        "image_token_index": ids["[IMG]"],
        "spatial_merge_size": MERGE,
        "vocab_size": vocab,
    }


def _pixtral(model_type: str, ids: dict, vocab: int) -> dict:
    """Pixtral: Mistral 3's tower without the patch merger, one [IMG] per 14-pixel patch,
    projected by a LLaVA-style two-layer projector into a Mistral language model."""
    config = _mistral3(model_type, ids, vocab)
    config["vision_config"] |= {"image_size": PIXTRAL_IMAGE}
    del config["spatial_merge_size"]
    return config


def _pixtral_files(path: Path, processor_class: str = "PixtralProcessor", edge: int = PIXTRAL_IMAGE, merge: int = 1):
    """Pixtral's image processor: the longest edge to `edge` pixels, sides multiples of 14 * `merge`
    (Mistral 3's: 112 pixels, its patches merged 2x2; Pixtral's own: 56, unmerged)."""
    image = {
        "image_processor_type": "PixtralImageProcessor",
        "processor_class": processor_class,
        "size": {"longest_edge": edge},
        "patch_size": {"height": PATCH, "width": PATCH},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    (path / "preprocessor_config.json").write_text(json.dumps(image))
    proc = {"processor_class": processor_class, "patch_size": PATCH, "spatial_merge_size": merge}
    (path / "processor_config.json").write_text(json.dumps(proc))


# LLaVA 1.5: an <image> part, which the processor widens to one <image> per CLIP patch (its CLS
# row dropped: vision_feature_select_strategy "default").
LLAVA_SPECIAL = ("<image>",)
LLAVA_TEMPLATE = QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
LLAVA_IMAGE = 56  # 4x4 patches of 14 pixels: 16 image tokens


def _llava(model_type: str, ids: dict, vocab: int) -> dict:
    text = _text("llama", vocab, head_dim=HIDDEN // HEADS)
    vision = _siglip(LLAVA_IMAGE) | {"model_type": "clip_vision_model", "projection_dim": 32}
    return {
        "model_type": model_type,
        "text_config": text,
        "vision_config": vision,
        "image_token_index": ids["<image>"],
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "vocab_size": vocab,
    }


def _llava_files(path: Path) -> None:
    """LLaVA 1.5's CLIP image processor: shortest edge to 56 pixels, center-cropped square."""
    image = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "size": {"shortest_edge": LLAVA_IMAGE},
        "crop_size": {"height": LLAVA_IMAGE, "width": LLAVA_IMAGE},
        "do_resize": True,
        "do_center_crop": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 3,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(image))
    proc = {
        "processor_class": "LlavaProcessor",
        "patch_size": PATCH,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,
    }
    (path / "processor_config.json").write_text(json.dumps(proc))


def _qwen3_5(model_type: str, ids: dict, vocab: int) -> dict:
    """Qwen3.5: gated DeltaNet layers, then a full-attention one (multimodal RoPE on half its dims)."""
    rope = {"type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    text = _text(model_type, vocab, head_dim=32, rope_parameters=rope, full_attention_interval=2)
    text |= {
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    }
    text.pop("rope_theta")
    return _qwen3_config(model_type, text, ids, vocab, deepstack=[])


# LFM2-VL: an <image> part, which the processor widens to <|image_start|> + <image> * n + <|image_end|>.
LFM2_VL_SPECIAL = ("<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>")
LFM2_VL_TEMPLATE = QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
LFM2_VL_IMAGE = {  # 14-pixel patches, 2x2 unshuffled: 12 to 24 image tokens, no tiles for small images
    "encoder_patch_size": PATCH,
    "downsample_factor": 2,
    "min_image_tokens": 12,
    "max_image_tokens": 24,
    "max_num_patches": 96,
    "tile_size": 112,
}


def _lfm2_vl(model_type: str, ids: dict, vocab: int) -> dict:
    """LFM2's short convolutions, then a full-attention layer; a SigLIP2 tower of native sizes."""
    text = _text("lfm2", vocab, norm_eps=1e-5)
    text |= {
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": HIDDEN,
        "block_ff_dim": FF,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention"],
        "num_heads": HEADS,
    }
    vision = {
        "model_type": "lfm2_vl",
        "hidden_size": 32,
        "intermediate_size": VISION_FF,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "patch_size": PATCH,
        "num_patches": 64,
    }
    return {
        "model_type": model_type,
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<image>"],
        "projector_hidden_size": HIDDEN,
        "do_image_splitting": False,
        "eos_token_id": ids["<|im_end|>"],
        **LFM2_VL_IMAGE,
        "vocab_size": vocab,
    }


# LFM2-VL's tiling, as its transformers configs write it (mlx-vlm's processor applies these
# values whatever the files say): an image past max_image_tokens' pixels x the tolerance is split
# into 2..10 tiles of tile_size and a thumbnail. Tolerance 1 (real: 2) splits a 200x150 image
# into 3x2 tiles here; the untiled checkpoint's images are too small to split.
LFM2_VL_TILES = {"do_image_splitting": True, "min_tiles": 2, "max_tiles": 10, "use_thumbnail": True}


def _lfm2_vl_files(path: Path, tiles: bool = False) -> None:
    image = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], **LFM2_VL_IMAGE, "patch_size": PATCH}
    if tiles:
        image |= {**LFM2_VL_TILES, "max_pixels_tolerance": 1.0}
    (path / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "Lfm2VlImageProcessor", "processor_class": "Lfm2VlProcessor", **image})
    )
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Lfm2VlProcessor"}))


# Per family: (its special tokens, its chat template, its config from the token ids and
# vocabulary, its processor class). LLaVA's is written for the test that shows mlx-vlm cannot run it.
FAMILIES = {
    "qwen2_5_vl": (QWEN_VL_SPECIAL, QWEN_VL_TEMPLATE, _qwen_vl, "Qwen2_5_VLProcessor"),
    "qwen3_vl": (QWEN_VL_SPECIAL, QWEN_VL_TEMPLATE, _qwen3_vl, "Qwen3VLProcessor"),
    "qwen3_vl_moe": (QWEN_VL_SPECIAL, QWEN_VL_TEMPLATE, _qwen3_vl, "Qwen3VLProcessor"),
    "gemma3": (GEMMA3_SPECIAL, GEMMA3_TEMPLATE, _gemma3, "Gemma3Processor"),
    "smolvlm": (IDEFICS3_SPECIAL, IDEFICS3_TEMPLATE, _idefics3, "SmolVLMProcessor"),
    "idefics3": (IDEFICS3_SPECIAL, IDEFICS3_TEMPLATE, _idefics3, "Idefics3Processor"),
    "qwen3_5": (QWEN_VL_SPECIAL, QWEN_VL_TEMPLATE, _qwen3_5, "Qwen3VLProcessor"),
    "lfm2_vl": (LFM2_VL_SPECIAL, LFM2_VL_TEMPLATE, _lfm2_vl, "Lfm2VlProcessor"),
    "mistral3": (MISTRAL3_SPECIAL, MISTRAL3_TEMPLATE, _mistral3, "Mistral3Processor"),
    "qwen2_vl": (QWEN_VL_SPECIAL, QWEN_VL_TEMPLATE, _qwen2_vl, "Qwen2VLProcessor"),
    "pixtral": (MISTRAL3_SPECIAL, MISTRAL3_TEMPLATE, _pixtral, "PixtralProcessor"),
    "llava": (LLAVA_SPECIAL, LLAVA_TEMPLATE, _llava, "LlavaProcessor"),
    "gemma4": (GEMMA4_SPECIAL, GEMMA4_TEMPLATE, _gemma4, "Gemma4Processor"),
}


# The families whose processors split an image into sub-images (`write_tiny_vlm(..., tiles=True)`)
TILED = ("smolvlm", "idefics3", "lfm2_vl", "gemma3")

# Where seed 0 draws a language model that repeats one token whatever the image shows (a blind test)
SEEDS = {"pixtral": 1}


def _processor_files(path: Path, processor_class: str) -> None:
    """Qwen-VL's image processor: 14-pixel patches merged 2x2, images resized to 28..(28*8)^2 pixels."""
    image = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor_class,
        "patch_size": PATCH,
        "temporal_patch_size": 2,
        "merge_size": MERGE,
        "min_pixels": (PATCH * MERGE) ** 2,
        "max_pixels": (PATCH * MERGE * 8) ** 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (path / "preprocessor_config.json").write_text(json.dumps(image))
    (path / "video_preprocessor_config.json").write_text(json.dumps(image))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}))


def _source(module) -> str:
    import inspect

    return inspect.getsource(type(module).__call__)


def write_tiny_vlm(
    path: Path,
    model_type: str = "qwen2_5_vl",
    *,
    seed: int | None = None,
    logit_scale: float = 4.0,
    feature_scale: float = 8.0,
    tiles: bool = False,
) -> Path:
    """A tiny random `model_type` checkpoint directory at `path`, loadable by `mlx_vlm.load`
    (weights drawn with `seed`, by default the family's in SEEDS, else 0). `tiles`: a processor
    config that splits a modest image (200x150) into several sub-images, as the real checkpoints'
    do for large ones (TILED: SmolVLM's and Idefics3's splitting, LFM2-VL's tiles, Gemma 3's
    pan-and-scan)."""
    if tiles and model_type not in TILED:
        raise ValueError(f"{model_type}: its processor splits no image (tiles for {', '.join(TILED)})")
    import importlib

    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_vlm.utils import save_config, save_weights, update_module_configs

    special, template, make_config, processor_class = FAMILIES[model_type]
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path, extra_special=special, template=template)
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in added}
    config = make_config(model_type, ids, vocab)
    config["eos_token_id"] = ids["<|im_end|>"]
    module = importlib.import_module(f"mlx_vlm.models.{model_type}")
    # built as mlx-vlm's load_model builds it: the top config, then each module's own config class
    model_config = module.ModelConfig.from_dict(json.loads(json.dumps(config)))
    model_config = update_module_configs(model_config, module, json.loads(json.dumps(config)), ["text", "vision"])
    model = module.Model(model_config)
    rng = np.random.default_rng(SEEDS.get(model_type, 0) if seed is None else seed)
    weights = {}
    params = tree_flatten(model.parameters())
    # the projector's output layers (vision matrices as tall as the text model is wide) drawn
    # larger, so image features are as large as token embeddings and the tokens depend on the image
    projector = {n for n, p in params if p.ndim == 2 and p.shape[0] == HIDDEN and not n.startswith("language_model")}
    projector |= {n for n, _ in params if n.endswith("mm_input_projection_weight")}  # Gemma 3's, [vision, text]
    # Gemma's RMSNorm scales by 1 + weight: its identity weight is zero
    one_plus = {
        n for n, m in model.named_modules() if type(m).__name__ == "RMSNorm" and "1.0 + self.weight" in _source(m)
    }
    # drawn small where the text embedding would drown what the layers add: Gemma 3 ties its output
    # head to it and scales it by sqrt(hidden) (a token's logits its own embedding's echo); Qwen3.5's
    # one attention layer averages the image in too weakly to change a token
    embed_std = 0.1 if model_type in ("gemma3", "qwen3_5", "lfm2_vl") else 1.0
    for name, p in params:
        if "norm" in name and p.ndim == 1:  # norm weights one (or zero for 1 + weight), biases zero
            identity = name.endswith("bias") or name.rsplit(".", 1)[0] in one_plus
            a = np.zeros(p.shape) if identity else np.ones(p.shape)
        elif p.ndim == 1:
            a = rng.normal(0, 0.1, size=p.shape)
        elif name.endswith("lm_head.weight"):  # greedy choices far from ties
            a = rng.normal(0, logit_scale * p.shape[-1] ** -0.5, size=p.shape)
        elif name.endswith("embed_tokens.weight"):
            a = rng.normal(0, embed_std, size=p.shape)
        else:
            scale = feature_scale if name in projector else 1.0
            a = rng.normal(0, scale * int(np.prod(p.shape[1:])) ** -0.5, size=p.shape)
        weights[name] = mx.array(a.astype(np.float32))
    model.update(tree_unflatten(list(weights.items())))
    save_weights(path, model)
    save_config(config, path / "config.json")
    if model_type == "gemma3":
        _gemma3_files(path, tiles)
    elif model_type in ("smolvlm", "idefics3"):
        _idefics3_files(path, processor_class, tiles)
    elif model_type == "mistral3":
        _pixtral_files(path, "Mistral3Processor", PATCH * MERGE * 4, MERGE)
    elif model_type == "lfm2_vl":
        _lfm2_vl_files(path, tiles)
    elif model_type == "pixtral":
        _pixtral_files(path)
    elif model_type == "llava":
        _llava_files(path)
    elif model_type == "gemma4":
        _gemma4_files(path)
    else:
        _processor_files(path, processor_class)
    return path
