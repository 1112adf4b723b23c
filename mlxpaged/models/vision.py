"""Vision-language models through mlx-vlm, their language model on the paged cache.

mlx-vlm's own `Model` (vision tower, projector, language model), image processor and chat
template load a checkpoint whose config has a `vision_config`. A request's images run through
mlx-vlm's `get_input_embeddings` once, on the whole prompt, as its `generate` runs them: the
vision tower's features merged into the text embeddings at the image tokens, and (Qwen's
multimodal RoPE) each prompt token's 3-D t/h/w position and the position delta its decode
continues from (engine/multimodal.py keeps them per request). The language model then runs as
any text model on the paged cache: the packed step's T tokens as T rows of one token, each
layer's `cache` a `PagedLayerCache` (paged_adapter.py), the rows holding image tokens fed their
features in place of the token embedding, and every row its own 3-D position.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..attention.metadata import AttentionMetadata
from .paged_adapter import (
    _check_attended,
    _final_norm,
    _install_sdpa,
    _NormRows,
    _segmented,
    _swapped,
    attention_modules,
    attention_of,
    cache_spec,
    pass_caches,
    text_body,
)

# The families whose language model runs here, each checked against mlx-vlm's own `generate`
# (tests/test_vision.py); "mrope": positions are Qwen's three t/h/w rows, "rope": one row.
FAMILIES = {
    "qwen2_vl": "mrope",
    "qwen2_5_vl": "mrope",
    "qwen3_vl": "mrope",  # with deepstack: vision features added again after its first layers
    "qwen3_vl_moe": "mrope",
    "gemma3": "rope",  # sliding-window layers; image features scaled as its text embeddings are
    "smolvlm": "rope",  # Idefics3's model: a SigLIP tower, pixel-shuffled into the text model
    "idefics3": "rope",
    "qwen3_5": "mrope",  # gated DeltaNet layers (recurrent state) between full-attention ones
    "lfm2_vl": "rope",  # LFM2's short-convolution layers (recurrent state) and a SigLIP2 tower
    "mistral3": "rope",  # Pixtral's vision: an image's rows of tokens between [IMG_BREAK]s
    "pixtral": "rope",  # the same tower unmerged, a LLaVA-style projector, a Mistral language model
    "gemma4": "rope",  # per-layer KV shapes, KV-shared layers, per-layer inputs (zero at image rows)
}
# Families mlx-vlm has a module for that are refused with their reason: none of them has mlx-vlm
# tokens to be checked against.
REFUSED = {
    "llava": "mlx-vlm's LLaVA processor hands the tokenizer's arguments (padding) to transformers' image "
    "processor, which refuses them: mlx-vlm itself runs no LLaVA image prompt to check mlxpaged against",
}
# The processor attribute naming the marker a chat template writes for an image, where it is not
# the image token itself (Gemma 3's <start_of_image>, widened to its image tokens between text).
MARKERS = {"gemma3": "boi_token"}


@dataclass
class PassRows:
    """A vision model's inputs for one pass beyond the token ids: `dst` the pass rows that hold
    image tokens, ascending (None: none), `features` their rows of image features `[len(dst),
    hidden]`, `deepstack` their rows of the features some layers add again (Qwen3-VL's
    deepstack, `[layers, len(dst), hidden]`, or None), `positions` each row's 3-D position
    `[3, T]` int32 (None for a family without them)."""

    dst: mx.array | None = None
    features: mx.array | None = None
    deepstack: mx.array | None = None
    positions: mx.array | None = None


class _TowerOutput:
    """The vision tower for one `get_input_embeddings` call: its output for this prompt's
    images, already known (per image, from the encoder cache), handed back when the model calls
    it; everything else read from the tower itself."""

    __slots__ = ("tower", "output")

    def __init__(self, tower: nn.Module, output):
        self.tower = tower
        self.output = output

    def __getattr__(self, name):
        return getattr(self.tower, name)

    def __call__(self, *args, **kwargs):
        return self.output


def _concat_outputs(outs: list):
    """Per-image tower outputs as one output for the images in order: an array's rows, or a
    (features, per-layer deepstack features) pair's (Qwen3-VL)."""
    if len(outs) == 1:
        return outs[0]
    if isinstance(outs[0], tuple):
        feats = mx.concatenate([o[0] for o in outs])
        layers = [mx.concatenate([o[1][k] for o in outs]) for k in range(len(outs[0][1]))]
        return feats, layers
    return mx.concatenate(outs)


_ARRAYS = []


def _arrays_cache() -> type:
    """A recurrent layer's cache that is both mlx-vlm's ArraysCache (its layers call
    `update_window`, `advance`) and, for `cache_spec`, mlx-lm's."""
    if not _ARRAYS:
        from mlx_lm.models.cache import ArraysCache as LmArrays
        from mlx_vlm.models.cache import ArraysCache as VlmArrays

        _ARRAYS.append(type("ArraysCache", (VlmArrays, LmArrays), {}))
    return _ARRAYS[0]


def vision_refusal(config: dict) -> str | None:
    """One line naming why a checkpoint with a vision tower cannot run, or None."""
    model_type = config.get("model_type")
    try:
        importlib.import_module(f"mlx_vlm.models.{model_type}")
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("mlx_vlm"):
            if e.name == "mlx_vlm":
                return f"{model_type} is a vision model: it needs mlx-vlm (pip install 'mlxpaged[vision]')"
            return f"{model_type}: mlx-vlm has no model module for it"
        return f"{model_type}: its mlx-vlm module needs the missing package {e.name!r}"
    if model_type in REFUSED:
        return f"{model_type}: {REFUSED[model_type]}"
    text = config.get("text_config") or {}
    if model_type == "gemma4" and text.get("use_bidirectional_attention"):
        # its image tokens attend to each other both ways: the paged attention here is causal
        return (
            f"gemma4: use_bidirectional_attention={text['use_bidirectional_attention']!r} "
            "(image tokens attending both ways) is not run by mlxpaged's causal paged attention"
        )
    if model_type not in FAMILIES:
        return (
            f"{model_type}: a vision model whose language model mlxpaged does not yet run on the paged cache "
            f"(it runs {', '.join(FAMILIES)})"
        )
    return None


class PagedVisionModel(nn.Module):
    """mlx-vlm's `Model` (the child `model`), callable as the engine calls a text model:
    `model(ids [T], paged_kv_cache, meta, rows)` -> logits `[S, V]`, `rows` the pass's image
    features and positions (`PassRows`). `args` holds what the engine reads of the text config."""

    multimodal = True

    def __init__(self, vlm: nn.Module, model_type: str):
        super().__init__()
        self.model = vlm
        self.model_type = model_type
        self.positions_kind = FAMILIES[model_type]
        text = vlm.config.text_config
        attn = next(a for a in map(attention_of, self.layers) if a is not None)
        self.args = SimpleNamespace(
            model_type=model_type,
            num_hidden_layers=text.num_hidden_layers,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=text.num_key_value_heads or text.num_attention_heads,
            head_dim=getattr(text, "head_dim", None)
            or getattr(attn, "head_dim", text.hidden_size // text.num_attention_heads),
            hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            max_position_embeddings=getattr(text, "max_position_embeddings", None),
        )

    @property
    def layers(self):
        return text_body(self).layers

    @property
    def image_token_id(self) -> int:
        cfg = self.model.config
        return getattr(cfg, "image_token_id", None) or cfg.image_token_index

    def marker(self, processor) -> str:
        """The text a chat template writes for one image, which the processor widens."""
        return getattr(processor, MARKERS.get(self.model_type, "image_token"))

    def make_cache(self) -> list:
        """The language model's caches as mlx-lm's classes (what `cache_spec` reads): mlx-vlm's
        own classes of the same names, with their windows."""
        from mlx_lm.models import cache as lm_cache

        lm = self.model.language_model
        if not hasattr(lm, "make_cache"):
            return [lm_cache.KVCache() for _ in self.layers]
        out = []
        for c in lm.make_cache():
            name = type(c).__name__
            if name == "ArraysCache":  # read by mlx-vlm's layers (state_spec runs them) and by cache_spec
                out.append(_arrays_cache()(len(c.cache)))
            elif name == "RotatingKVCache":
                out.append(lm_cache.RotatingKVCache(max_size=c.max_size, keep=c.keep))
            elif name == "KVCache":
                out.append(lm_cache.KVCache())
            else:
                raise ValueError(f"{self.model_type}: mlx-vlm's {name} has no paged counterpart here")
        return out

    def prompt_features(self, inputs, rows: np.ndarray, cache=None) -> tuple:
        """(the features of the prompt's image rows `rows` `[K, hidden]`, their deepstack features
        `[layers, K, hidden]` or None, the prompt's 3-D positions `[3, P]` or None, the position
        delta decode continues from) of `inputs` (engine/multimodal.py `ImageInputs`), as mlx-vlm's
        `get_input_embeddings` merges them. Qwen's (multimodal RoPE) on the whole prompt, its vision
        tower's output for each image from `cache` (engine/multimodal.py `EncoderCache`, by the
        image's digest) or computed on that image alone and put there; any other family's on each
        image's own rows alone (its features depend on nothing else), those kept in `cache`."""
        if self.positions_kind != "mrope":
            outs = []
            for (s, e), one, digest in zip(inputs.spans, inputs.processed, inputs.digests):
                out = cache.get(digest) if cache is not None else None
                if out is None:
                    out = self._image_rows(inputs.ids[s:e], one)
                    if cache is not None:
                        cache.put(digest, out)
                outs.append(out)
            return mx.concatenate(outs) if outs else None, None, None, 0
        vlm = self.model
        tower = vlm.vision_tower
        processed = {k: mx.concatenate([p[k] for p in inputs.processed]) for k in inputs.processed[0]}
        outs = []
        for i, digest in enumerate(inputs.digests):
            out = cache.get(digest) if cache is not None else None
            if out is None:
                out = self._tower_output(processed, i)
                if cache is not None:
                    cache.put(digest, out)
            outs.append(out)
        kwargs = {k: v for k, v in processed.items() if k != "pixel_values"}
        with _swapped([(vlm, "vision_tower", _TowerOutput(tower, _concat_outputs(outs)))]):
            out = vlm.get_input_embeddings(
                mx.array(inputs.ids, dtype=mx.int32)[None], processed["pixel_values"], **kwargs
            )
        deepstack = getattr(out, "deepstack_visual_embeds", None)
        if deepstack is not None and not isinstance(deepstack, mx.array):
            deepstack = mx.stack(list(deepstack))
        positions = out.position_ids[:, 0, :].astype(mx.int32)
        delta = int(out.rope_deltas.reshape(-1)[0].item())
        return out.inputs_embeds[0][mx.array(rows)], deepstack, positions, delta

    def _image_rows(self, ids: list[int], processed: dict) -> mx.array:
        """The rows mlx-vlm's `get_input_embeddings` merges at one image's tokens, from that
        image's widened marker `ids` and its processor inputs alone (evaluated)."""
        ids_ = mx.array(ids, dtype=mx.int32)[None]
        kwargs = {k: v for k, v in processed.items() if k != "pixel_values"}
        # the whole prompt attended, as mlx-vlm's generate masks it (Gemma 3 asks for the mask)
        out = self.model.get_input_embeddings(
            ids_, processed["pixel_values"], mask=mx.ones(ids_.shape, mx.int32), **kwargs
        )
        rows = out.inputs_embeds[0][mx.array(np.flatnonzero(np.asarray(ids) == self.image_token_id))]
        mx.eval(rows)
        return rows

    def _tower_output(self, processed: dict, i: int):
        """The vision tower's output for image i of `processed` alone (evaluated): Qwen's
        patches of image i are rows of `pixel_values`, as many as its grid's t * h * w."""
        tower = self.model.vision_tower
        grid = processed["image_grid_thw"]
        sizes = [int(t * h * w) for t, h, w in grid.tolist()]
        start = sum(sizes[:i])
        pixels = processed["pixel_values"][start : start + sizes[i]]
        out = tower(pixels.astype(tower.patch_embed.proj.weight.dtype), grid[i : i + 1])
        mx.eval(out)
        return out

    def pass_rows(self, batch: list, meta: AttentionMetadata) -> PassRows:
        """One pass's image rows and positions, from its (sequence, new tokens) entries: a
        prefill chunk gets the features of the image rows it holds (an image may straddle chunks
        and blocks; engine/multimodal.py `PromptImages`), every row its position."""
        mrope = self.positions_kind == "mrope"
        cu = meta.cu_seqlens_q.tolist()  # host-built (metadata.py): reading it forces nothing
        dst, feats, deep, pos = [], [], [], []
        for (s, n), base in zip(batch, cu):
            im = s.images
            start = s.num_computed_tokens
            # image rows still to prefill, or features still held past them (a prefix hit): `take` drops them
            if im is not None and (start <= im.last_row or im.held is not None):
                offs, f, d = im.take(start, n)
                if len(offs):
                    dst.append(offs + base)
                    feats.append(f)
                    if d is not None:
                        deep.append(d)
            if mrope:
                pos.append(
                    im.positions_of(start, n) if im is not None else np.tile(np.arange(start, start + n), (3, 1))
                )
        rows = PassRows()
        if dst:
            rows.dst = mx.array(np.concatenate(dst).astype(np.int32))
            rows.features = feats[0] if len(feats) == 1 else mx.concatenate(feats)
            if deep:
                rows.deepstack = deep[0] if len(deep) == 1 else mx.concatenate(deep, axis=1)
        if mrope:
            rows.positions = mx.array(np.concatenate(pos, axis=1).astype(np.int32))
        return rows

    def __call__(self, inputs, cache=None, meta: AttentionMetadata | None = None, rows: PassRows | None = None):
        if meta is None:  # the text model on mlx-vlm's caches (state_spec reads the recurrent layers' shapes)
            return self.model.language_model(inputs, cache=cache)
        spec = cache.spec if cache.spec is not None else cache_spec(self)
        caches = pass_caches(spec, cache, meta)
        lm = self.model.language_model
        body = text_body(self)
        h = body.embed_tokens(inputs)
        if self.model_type == "gemma4":  # its text model takes the embeddings scaled, image features not
            h = h * body.embed_scale
        if rows is not None and rows.dst is not None:
            h[rows.dst] = rows.features.astype(h.dtype)
        positions = rows.positions if rows is not None else None
        if self.positions_kind == "mrope" and positions is None:  # text rows: one position, thrice
            positions = mx.broadcast_to(meta.positions[None], (3, meta.positions.shape[0]))
        kwargs = {"position_ids": positions[:, :, None]} if self.positions_kind == "mrope" else {}
        if getattr(body, "hidden_size_per_layer_input", None):  # Gemma 4: token 0's per-layer input at image rows
            ids = inputs
            if rows is not None and rows.dst is not None:
                ids = mx.array(inputs)
                ids[rows.dst] = 0
            kwargs["per_layer_inputs"] = body.get_per_layer_inputs(ids[:, None])
        if rows is not None and rows.deepstack is not None:  # Qwen3-VL: added again after its first layers
            mask = mx.zeros((inputs.shape[0], 1), dtype=mx.bool_)
            mask[rows.dst] = True
            kwargs |= {"visual_pos_masks": mask, "deepstack_visual_embeds": rows.deepstack}
        norm = _final_norm(body)
        swaps = [(body, norm, _NormRows(body[norm], meta))]
        if spec.num_recurrent:  # each recurrent layer on the pass's states (recurrent.py)
            swaps += _segmented(self, body, spec, meta)
        lora = meta.lora.swaps() if meta.lora is not None else []  # each row's adapter (lora.py)
        with _swapped(lora), _swapped(swaps):
            out = lm(inputs[:, None], inputs_embeds=h[:, None], cache=caches, **kwargs)
        _check_attended(self.layers, caches)
        logits = out.logits
        return logits.reshape(logits.shape[0], -1)


def prepare_vision(model: PagedVisionModel) -> None:
    """Route the language model's attention to the paged cache (paged_adapter.py)."""
    spec = cache_spec(model)
    for module in attention_modules(model, spec):
        _install_sdpa(module)


def load_vision(path, config: dict, dtype: mx.Dtype):
    """(`PagedVisionModel`, mlx-vlm's processor) of the checkpoint at `path`, whose family
    runs here (`vision_refusal`)."""
    from mlx_vlm.utils import load as vlm_load

    vlm, processor = vlm_load(str(path))
    model = PagedVisionModel(vlm, config["model_type"])
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    prepare_vision(model)
    return model, processor


__all__ = ["FAMILIES", "PagedVisionModel", "PassRows", "load_vision", "vision_refusal"]
