"""The tensors of a quantized checkpoint: GGUF block weights kept as MLX affine layers.

Layout (what mlx-lm's ``load_model`` reads into ``nn.QuantizedLinear`` /
``nn.QuantizedEmbedding``): a quantized layer ``P`` stores ``P.weight`` (uint32 packed
codes), ``P.scales`` and ``P.biases``; ``config.json`` carries ``quantization`` =
``{"group_size": 32, "bits": <most common>, "mode": "affine"}`` plus one
``{"group_size": 32, "bits": b}`` entry per layer whose bits differ.

Which tensors: every 2-D weight of a block type (see :mod:`.mlx_quant`); float
tensors (F32/F16/BF16, norms, biases) stay float, stored in their own dtype so
nothing is rounded.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from .mlx_quant import EXACT_BITS, GROUP_SIZE, REQUANT_TYPES, to_mlx
from .reader import GGUFError, GGUFFile

__all__ = ["quantized_tensors"]

log = logging.getLogger("mlxpaged.loading.gguf")

_FLOAT_DTYPES = {T.F32: "float32", T.F16: "float16", T.BF16: "bfloat16"}


def _float_tensor(g: GGUFFile, name: str):
    import mlx.core as mx

    info = g.tensors[name]
    # Quantized 1-D tensors do not occur in qwen2 GGUFs; should one, float32 holds it exactly.
    dtype = _FLOAT_DTYPES.get(info.type, "float32")
    return mx.array(g.dequantize(name)).astype(getattr(mx, dtype))


def quantized_tensors(
    g: GGUFFile, sources: dict[str, str]
) -> tuple[dict[str, Any], dict[str, tuple[int, ...]], dict[str, Any], dict[str, Any]]:
    """Build the checkpoint tensors for ``sources`` (HF name -> GGUF tensor name).

    Returns ``(tensors, shapes, quantization, report)``: the arrays to save, each
    weight's logical (unquantized) shape, the ``quantization`` entry for
    config.json, and a JSON-able report: per tensor its GGUF type, bits and
    whether the mapping is exact; requantized tensors also get ``max_error``,
    ``rms_error`` (absolute, against the GGUF's own float32 decoding) and
    ``rms_weight``.
    """
    import mlx.core as mx

    tensors: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    layer_bits: dict[str, int] = {}
    report: dict[str, Any] = {}
    for hf, src in sources.items():
        info = g.tensors[src]
        shapes[hf] = info.shape
        quantizable = len(info.shape) == 2 and hf.endswith(".weight") and info.shape[1] % GROUP_SIZE == 0
        if info.type not in EXACT_BITS and info.type not in REQUANT_TYPES or not quantizable:
            if info.type not in _FLOAT_DTYPES:
                raise GGUFError(f"{g.name}: cannot keep {src!r} ({info.type.name}, shape {info.shape}) quantized")
            tensors[hf] = _float_tensor(g, src)
            continue
        q = to_mlx(g.raw(src), info.type, info.shape)
        layer = hf[: -len(".weight")]
        tensors[f"{layer}.weight"] = mx.array(q.weight)
        tensors[f"{layer}.scales"] = mx.array(q.scales)
        tensors[f"{layer}.biases"] = mx.array(q.biases)
        layer_bits[layer] = q.bits
        entry: dict[str, Any] = {"gguf_type": info.type.name, "bits": q.bits, "exact": q.exact}
        if not q.exact:
            rms_w = float(np.sqrt(np.mean(np.square(g.dequantize(src), dtype=np.float64))))
            entry.update(max_error=q.max_error, rms_error=q.rms_error, rms_weight=rms_w)
            log.info(
                "requantized %s (%s -> %d-bit, group %d): max error %.3g, RMS error %.3g (RMS weight %.3g)",
                src,
                info.type.name,
                q.bits,
                GROUP_SIZE,
                q.max_error,
                q.rms_error,
                rms_w,
            )
        report[hf] = entry
    default_bits = Counter(layer_bits.values()).most_common(1)[0][0] if layer_bits else 8
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default_bits, "mode": "affine"}
    for layer, bits in sorted(layer_bits.items()):
        if bits != default_bits:
            quantization[layer] = {"group_size": GROUP_SIZE, "bits": bits}
    return tensors, shapes, quantization, report
