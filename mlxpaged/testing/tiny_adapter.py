"""Writes LoRA adapters for a tiny checkpoint the way `mlx_lm.lora` saves them (or as PEFT does).

mlx-lm's own `linear_to_lora_layers` turns the targeted linears into `LoRALinear`s; `lora_b`
(zeros after that call, as training starts) gets random values so the adapter changes the
tokens; `adapters.safetensors` holds every `lora_a`/`lora_b` under its path in the model, and
`adapter_config.json` the fields `mlx_lm.load(..., adapter_path=...)` reads. Used by the tests and
scripts/bench_lora.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

ATTENTION_KEYS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
MLP_KEYS = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def write_tiny_adapter(
    base: Path,
    out: Path,
    *,
    seed: int = 1,
    rank: int = 4,
    scale: float = 2.0,
    num_layers: int = -1,
    keys: list[str] | None = None,
    b_scale: float = 0.5,
    peft: bool = False,
) -> Path:
    """An adapter of `base` at `out` (mlx-lm's format; `peft=True`: PEFT's `adapter_model.safetensors`
    with `lora_alpha = scale * rank`, the same weights). `num_layers=-1`: every layer."""
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = mlx_lm.load(str(base))
    layers = len(model.layers) if num_layers < 0 else num_layers
    params = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": keys or ATTENTION_KEYS + MLP_KEYS}
    mx.random.seed(seed)
    linear_to_lora_layers(model, layers, params)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, w in tree_flatten(model.parameters()):
        if name.endswith(".lora_a"):
            weights[name] = w
        elif name.endswith(".lora_b"):
            weights[name] = mx.array(rng.normal(0, b_scale / rank**0.5, size=w.shape).astype(np.float32))
    out.mkdir(parents=True, exist_ok=True)
    if peft:
        tensors = {}
        for name, w in weights.items():
            module, leaf = name.rsplit(".", 1)
            tensors[f"base_model.model.{module}.lora_{leaf[-1].upper()}.weight"] = w.T
        mx.save_safetensors(str(out / "adapter_model.safetensors"), tensors)
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": scale * rank,
            "target_modules": sorted({k.rsplit(".", 1)[-1] for k in params["keys"]}),
            "lora_dropout": 0.0,
            "bias": "none",
            "base_model_name_or_path": str(base),
        }
    else:
        mx.save_safetensors(str(out / "adapters.safetensors"), weights)
        config = {"model": str(base), "fine_tune_type": "lora", "num_layers": layers, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
