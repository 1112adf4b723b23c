"""Qwen2 / Qwen2.5 in MLX, for the packed new tokens of many sequences on a paged KV cache.

A step's T new tokens (decodes and prefill chunks of any number of sequences) enter as one
`[T]` array and stay `[T, hidden]` rows throughout; RoPE rotates each row by its own position
(`Rotary`, built once per pass).

Parameter names follow the Hugging Face checkpoints, so mlx-lm's loader (quantized
mlx-community checkpoints included) fills these modules unchanged. The model knows nothing of
the cache's layout: it passes the cache and the step's `AttentionMetadata` to `PagedAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.rope_utils import initialize_rope

from ..attention.metadata import AttentionMetadata
from ..attention.paged_layer import PagedAttention
from .rotary import Rotary


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    num_key_value_heads: int
    max_position_embeddings: int = 32768
    rope_theta: float = 1000000
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = hd = args.head_dim
        self.scale = hd**-0.5
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=True)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=True)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=True)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.rope = initialize_rope(
            hd,
            base=args.rope_theta,
            traditional=args.rope_traditional,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

        self.attn = PagedAttention(layer_idx, self.n_heads, self.n_kv_heads, hd, self.scale)

    def __call__(self, x: mx.array, cache, meta: AttentionMetadata, rotary: Rotary) -> mx.array:
        T = x.shape[0]  # x [T, hidden]: the step's packed new tokens
        q = rotary(self.q_proj(x).reshape(T, self.n_heads, -1))
        k = rotary(self.k_proj(x).reshape(T, self.n_kv_heads, -1))
        v = self.v_proj(x).reshape(T, self.n_kv_heads, -1)
        return self.o_proj(self.attn(q, k, v, cache, meta))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache, meta: AttentionMetadata, rotary: Rotary) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache, meta, rotary)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache, meta: AttentionMetadata) -> mx.array:
        h = self.embed_tokens(inputs)
        rotary = Rotary(self.layers[0].self_attn.rope, meta.positions)  # every layer's rope is the same
        for layer in self.layers:
            h = layer(h, cache, meta, rotary)
        return self.norm(h)


class Model(nn.Module):
    """`Model(args)(input_ids [T], cache, meta)` -> logits `[S, V]` at `meta.logits_indices`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Qwen2Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache, meta: AttentionMetadata) -> mx.array:
        h = self.model(inputs, cache, meta)  # [T, hidden]
        h = h[meta.logits_indices]  # only the sampled positions reach the output layer
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return {k: v for k, v in weights.items() if "self_attn.rotary_emb.inv_freq" not in k}

    @property
    def layers(self):
        return self.model.layers
