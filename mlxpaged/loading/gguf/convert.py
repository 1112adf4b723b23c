"""Convert a qwen2, qwen3 or llama GGUF into a Hugging Face-style checkpoint directory, cached.

The directory holds ``config.json``, ``model.safetensors`` (HF tensor names),
``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``; it
loads with ``mlx_lm.load`` and with the engine's own loader.

Cache layout (root = ``cache_dir`` argument, else ``$MLXPAGED_CACHE``, else
``~/.cache/mlxpaged``)::

    <root>/converted/<sha256[:16]>/          float16 checkpoint (the default)
    <root>/converted/<sha256[:16]>-<dtype>/  other dtypes
    <root>/converted/<sha256[:16]>-quantized/ block weights kept quantized (weights="quantized")
    <root>/sha256-index.json                  (path, size, mtime) -> sha256
    <root>/gguf/<name>.gguf                   offline models (mlxpaged.loading.offline_model)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ... import settings
from .reader import SUPPORTED_TYPES, GGUFError, GGUFFile
from .tokenizer import eos_token_ids, tokenizer_config_from_metadata, tokenizer_from_metadata

__all__ = ["convert_gguf", "cache_root", "file_sha256", "CONVERTER_VERSION", "DTYPES", "WEIGHTS"]

# Bump when the output of a conversion changes, so stale cache entries are rebuilt.
CONVERTER_VERSION = 1
# The same for quantized checkpoints only (bumping CONVERTER_VERSION would rebuild float ones too).
QUANTIZED_VERSION = 1
MARKER = "mlxpaged_conversion.json"
DTYPES = ("float16", "bfloat16", "float32")
# "float": every tensor dequantized to `dtype`; "quantized": block weights as MLX affine
# layers (mlx_quant.py), float tensors in their own dtype.
WEIGHTS = ("float", "quantized")
# float16 by default: the dequantized values are an fp16 scale times a small
# integer, which float16 (11-bit significand) keeps 8x more precisely than
# bfloat16 (8-bit); on the 0.5B file the relative rounding error is 2e-4 vs 1.7e-3,
# and its F32 tensors are exactly representable in float16.
DEFAULT_DTYPE = "float16"

SUPPORTED_ARCHITECTURES = ("qwen2", "qwen3", "llama")
# Per architecture: the checkpoint's model_type and class, and the per-layer tensors it must have.
_ARCH = {
    "qwen2": ("qwen2", "Qwen2ForCausalLM", ("attn_q.bias", "attn_k.bias", "attn_v.bias")),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", ("attn_q_norm.weight", "attn_k_norm.weight")),
    "llama": ("llama", "LlamaForCausalLM", ()),
}
_PLAIN_LAYER = (
    "attn_norm.weight",
    "ffn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Relative difference below which output.weight is taken for the embedding quantized
# again.  Two quantizations of one matrix differ by their quantization noise (about
# 0.03 for Q5_0 vs Q8_0, under 0.3 even for Q2_K); unrelated matrices of similar
# scale differ by about sqrt(2).
_TIE_THRESHOLD = 0.5


# --------------------------------------------------------------------------- cache
def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: ``cache_dir``, else ``$MLXPAGED_CACHE``, else ``~/.cache/mlxpaged``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return settings.cache_dir()


def _write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.chmod(tmp, 0o644)  # mkstemp makes it private; cache files are for every user
    os.replace(tmp, path)


def _sha_index_path(cache_dir) -> Path:
    return cache_root(cache_dir) / "sha256-index.json"


def _read_sha_index(cache_dir) -> dict:
    try:
        index = json.loads(_sha_index_path(cache_dir).read_text())
        return index if isinstance(index, dict) else {}
    except (OSError, ValueError):
        return {}


def remember_sha256(path: str | os.PathLike, digest: str, cache_dir: str | os.PathLike | None = None) -> None:
    """Record a file's sha256 under its current (absolute path, size, mtime)."""
    p = Path(path).resolve()
    st = p.stat()
    index = _read_sha_index(cache_dir)
    index[str(p)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    try:
        _write_json_atomic(_sha_index_path(cache_dir), index)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time


def file_sha256(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """sha256 of a file, remembered by (absolute path, size, mtime) in the cache root."""
    p = Path(path).resolve()
    st = p.stat()
    entry = _read_sha_index(cache_dir).get(str(p))
    if entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        return entry["sha256"]
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    remember_sha256(p, digest, cache_dir)
    return digest


# ---------------------------------------------------------------------- conversion
def _bits_per_weight(qtype) -> float:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    return 8.0 * size / block


def _model_config(g: GGUFFile, vocab_size: int, tied: bool, dtype: str) -> dict[str, Any]:
    md, arch = g.metadata, g.metadata["general.architecture"]

    def key(k: str, default: Any = None) -> Any:
        v = md.get(f"{arch}.{k}", default)
        if v is None:
            raise GGUFError(f"{g.name}: missing metadata key '{arch}.{k}'")
        return v

    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    n_kv = int(key("attention.head_count_kv", n_heads))
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // n_heads))
    if head_dim * n_heads != hidden and arch == "qwen2":  # qwen2 has no head_dim setting
        raise GGUFError(f"{g.name}: head size {head_dim} x {n_heads} heads != hidden size {hidden}; not supported")
    model_type, cls, _ = _ARCH[arch]
    config: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(key("context_length", 32768)),
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "hidden_act": "silu",
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    else:
        config["head_dim"] = head_dim
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
        config["mlp_bias"] = False
    scaling = md.get(f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {
            "type": scaling,
            "rope_type": scaling,
            "factor": float(md.get(f"{arch}.rope.scaling.factor", 1.0)),
        }
        if f"{arch}.rope.scaling.original_context_length" in md:
            config["rope_scaling"]["original_max_position_embeddings"] = int(
                md[f"{arch}.rope.scaling.original_context_length"]
            )
    tok = md.get("tokenizer.ggml.bos_token_id")
    if tok is not None:
        config["bos_token_id"] = int(tok)
    eos = eos_token_ids(md)
    if eos:
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    return config


def _f32(v: Any) -> float:
    """A GGUF float32 as the shortest decimal that round-trips (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(v)))


def _hf_name(gguf_name: str, n_layers: int, file: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        if int(parts[1]) >= n_layers:
            raise GGUFError(f"{file}: tensor {gguf_name!r} beyond block_count {n_layers}")
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise GGUFError(f"{file}: unexpected tensor {gguf_name!r} for this model")


def _decide_tie(g: GGUFFile) -> tuple[bool, str]:
    """Whether to tie, and which GGUF tensor supplies the embedding matrix."""
    if "output.weight" not in g.tensors:
        return True, "token_embd.weight"
    emb, out = g.tensors["token_embd.weight"], g.tensors["output.weight"]
    if emb.shape != out.shape:
        return False, "token_embd.weight"
    # Compare a spread of rows rather than the full (vocab x hidden) matrices.
    rows = np.linspace(0, emb.shape[0] - 1, num=min(512, emb.shape[0])).astype(np.int64)
    a = g.dequantize("token_embd.weight", rows)
    b = g.dequantize("output.weight", rows)
    rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))
    if rel >= _TIE_THRESHOLD:
        return False, "token_embd.weight"
    # Same matrix quantized twice: keep the finer copy.
    if _bits_per_weight(out.type) > _bits_per_weight(emb.type):
        return True, "output.weight"
    return True, "token_embd.weight"


def _check_architecture(g: GGUFFile) -> None:
    arch = g.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{g.name}: no general.architecture in the GGUF metadata")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"unsupported architecture {arch!r} in {g.name}: mlxpaged supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _write_checkpoint(g: GGUFFile, out: Path, dtype: str, sha256: str, weights_mode: str = "float") -> None:
    import mlx.core as mx

    _check_architecture(g)
    for info in g.tensors.values():
        if info.type not in SUPPORTED_TYPES:
            raise GGUFError(f"{g.name}: unsupported tensor type {info.type.name} for {info.name!r}")
    if "token_embd.weight" not in g.tensors:
        raise GGUFError(f"{g.name}: no token_embd.weight tensor")
    arch = g.metadata["general.architecture"]
    n_layers = int(g.require(f"{arch}.block_count"))
    tied, embed_src = _decide_tie(g)
    vocab_size = g.tensors["token_embd.weight"].shape[0]
    config = _model_config(g, vocab_size, tied, dtype)
    mx_dtype = getattr(mx, dtype)

    if "rope_freqs.weight" in g.tensors:
        config["rope_scaling"] = _llama3_rope_scaling(g, config)
    per_layer = _PLAIN_LAYER + _ARCH[arch][2]
    if arch == "llama" and config["attention_bias"]:
        per_layer += ("attn_q.bias", "attn_k.bias", "attn_v.bias")
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{_LAYER_TENSORS[t]}" for i in range(n_layers) for t in per_layer
    }
    if not tied:
        expected.add("lm_head.weight")
    sources = {
        _hf_name(name, n_layers, g.name): name
        for name in g.tensors
        if not (tied and name in ("token_embd.weight", "output.weight")) and name != "rope_freqs.weight"
    }
    if tied:
        sources["model.embed_tokens.weight"] = embed_src
    missing = sorted(expected - sources.keys())
    if missing:
        raise GGUFError(f"{g.name}: incomplete {arch} GGUF, {len(missing)} tensors missing (first: {missing[0]})")
    unexpected = sorted(sources.keys() - expected - {"lm_head.weight"})
    if unexpected:
        raise GGUFError(f"{g.name}: unexpected tensor {sources[unexpected[0]]!r} for a {arch} model")
    _check_shapes({hf: g.tensors[src].shape for hf, src in sources.items()}, config, g.name)
    report = None
    if weights_mode == "quantized":
        from .quantized_checkpoint import quantized_tensors

        weights, _, quantization, report = quantized_tensors(g, sources)
        config["quantization"] = config["quantization_config"] = quantization
    else:
        weights = {hf: mx.array(g.dequantize(src)).astype(mx_dtype) for hf, src in sources.items()}
    if arch == "llama":
        _undo_qk_permutation(weights, config)
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights

    md = g.metadata
    tokenizer_from_metadata(md, g.name).save(str(out / "tokenizer.json"))
    _write_json_atomic(out / "tokenizer_config.json", tokenizer_config_from_metadata(md, g.name))
    _write_json_atomic(out / "config.json", config)
    gen = {"do_sample": False}
    for k in ("bos_token_id", "eos_token_id"):
        if k in config:
            gen[k] = config[k]
    if "tokenizer.ggml.padding_token_id" in md:
        gen["pad_token_id"] = int(md["tokenizer.ggml.padding_token_id"])
    _write_json_atomic(out / "generation_config.json", gen)
    counts: dict[str, int] = {}
    for info in g.tensors.values():
        counts[info.type.name] = counts.get(info.type.name, 0) + 1
    marker = {
        "converter_version": CONVERTER_VERSION,
        "source": str(g.path.resolve()),
        "source_name": md.get("general.name"),
        "sha256": sha256,
        "dtype": dtype,
        "weights": weights_mode,
        "quantized_version": QUANTIZED_VERSION if weights_mode == "quantized" else None,
        "tie_word_embeddings": tied,
        "embedding_from": embed_src,
        "tensor_types": counts,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if report is not None:
        # The conversion log: per weight its GGUF type, MLX bits, and for requantized
        # ones (Q2_K/Q3_K/Q6_K) the max and RMS error of that step.
        marker["quantized"] = report
    _write_json_atomic(out / MARKER, marker)


def _llama_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's Q/K permutation (convert_hf_to_gguf.py's
    `LlamaModel.permute`): each head's rows there are (pair, half) interleaved, here (half, pair)."""
    gguf_of_hf = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)
    return np.argsort(gguf_of_hf)


def _undo_qk_permutation(weights: dict, config: dict) -> None:
    """Put the rows of every q_proj / k_proj tensor (weight, bias, quantized scales and biases) back
    in Hugging Face order. Row order commutes with quantization: a row's blocks stay whole."""
    import mlx.core as mx

    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name in list(weights):
        layer = name.split(".")[-2] if "." in name else ""
        if layer in heads:
            a = weights[name]
            weights[name] = a[mx.array(_llama_rows(a.shape[0], heads[layer]))]


def _llama3_rope_scaling(g: GGUFFile, config: dict) -> dict:
    """Llama 3.1+ keep their RoPE frequency factors as a tensor (rope_freqs.weight); mlx-lm's
    llama takes the four settings they are computed from. Find the settings whose factors
    these are (Llama 3.1's and 3.2's), or refuse the file in one line."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    factors = np.asarray(g.dequantize("rope_freqs.weight"), dtype=np.float64).reshape(-1)
    dims, base = config["head_dim"], config["rope_theta"]
    for factor in (8.0, 32.0, 16.0, 4.0, 2.0):
        for orig in (8192, 4096, 2048):
            rs = {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": orig,
            }
            rope = Llama3RoPE(dims, config["max_position_embeddings"], False, base, rs)
            plain = base ** (np.arange(0, dims, 2) / dims)
            if factors.shape == plain.shape and np.allclose(np.array(rope._freqs) / plain, factors, rtol=1e-4):
                return rs
    raise GGUFError(f"{g.name}: rope_freqs.weight matches no Llama 3 RoPE scaling mlxpaged knows")


def _check_shapes(shapes: dict[str, tuple[int, ...]], config: dict, name: str) -> None:
    h, f = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q = config["num_attention_heads"] * hd
    kv = config["num_key_value_heads"] * hd
    want = {
        "q_proj.weight": (q, h),
        "q_proj.bias": (q,),
        "k_proj.weight": (kv, h),
        "k_proj.bias": (kv,),
        "v_proj.weight": (kv, h),
        "v_proj.bias": (kv,),
        "o_proj.weight": (h, q),
        "q_norm.weight": (hd,),
        "k_norm.weight": (hd,),
        "gate_proj.weight": (f, h),
        "up_proj.weight": (f, h),
        "down_proj.weight": (h, f),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    for k, shape in shapes.items():
        suffix = ".".join(k.split(".")[-2:])
        exp = want.get(suffix)
        if k in ("model.embed_tokens.weight", "lm_head.weight"):
            exp = (config["vocab_size"], h)
        elif k == "model.norm.weight":
            exp = (h,)
        if exp is not None and tuple(shape) != exp:
            raise GGUFError(f"{name}: tensor for {k} has shape {tuple(shape)}, expected {exp}")


def _is_current(d: Path, dtype: str, weights: str = "float") -> bool:
    try:
        marker = json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return False
    # Entries written before `weights` existed are float ones.
    same = marker.get("dtype") == dtype and marker.get("weights", "float") == weights
    if weights == "quantized":
        same = same and marker.get("quantized_version") == QUANTIZED_VERSION
    return (
        marker.get("converter_version") == CONVERTER_VERSION
        and same
        and all(
            (d / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
        )
    )


def convert_gguf(
    path: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    *,
    dtype: str = DEFAULT_DTYPE,
    force: bool = False,
    weights: str = "float",
) -> Path:
    """Convert a qwen2, qwen3 or llama GGUF to a checkpoint directory and return its path.

    The directory is ``<root>/converted/<sha256[:16]>`` (``-<dtype>`` appended
    for a dtype other than float16), with root = ``cache_dir``, else
    ``$MLXPAGED_CACHE``, else ``~/.cache/mlxpaged``.  A finished conversion is
    reused; a new one is written to a temporary directory and renamed into
    place, so readers never see a half-written checkpoint.

    ``dtype`` is the storage dtype of the weights: "float16" (default),
    "bfloat16" or "float32".  ``weights="quantized"`` instead keeps block-quantized
    weights quantized as MLX affine layers (group 32; exact for Q4_0/Q4_1/Q5_0/Q5_1/
    Q8_0/Q4_K/Q5_K, 8-bit requantized for Q2_K/Q3_K/Q6_K, errors in the marker file)
    in ``<sha256[:16]>-quantized``; ``dtype`` is then unused (float tensors keep
    their GGUF dtype).  Raises :class:`GGUFError` (one-line message) for a
    file that is not GGUF, is truncated or corrupt, has another architecture, or
    holds a tensor type outside ``SUPPORTED_TYPES``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, not {weights!r}")
    if weights == "quantized":
        dtype = DEFAULT_DTYPE  # unused: scales and float tensors keep exact dtypes
    src = Path(path)
    if not src.is_file():
        raise GGUFError(f"{src}: no such file")
    # Validate before hashing: a wrong file should fail fast, not after a 1 GB read.
    with GGUFFile(src, read_tensors=False) as g:
        _check_architecture(g)
    sha = file_sha256(src, cache_dir)
    base = cache_root(cache_dir) / "converted"
    if weights == "quantized":
        final = base / f"{sha[:16]}-quantized"
    else:
        final = base / (sha[:16] if dtype == DEFAULT_DTYPE else f"{sha[:16]}-{dtype}")
    if not force and _is_current(final, dtype, weights):
        return final
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=base, prefix=f".tmp-{final.name}-"))
    try:
        with GGUFFile(src) as g:
            _write_checkpoint(g, tmp, dtype, sha, weights)
        # mkdtemp/mkstemp create private entries; a cache is for every user of the machine.
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        if final.exists():
            # A stale (older converter, other dtype) or forced entry: move it aside first.
            old = Path(tempfile.mkdtemp(dir=base, prefix=f".old-{final.name}-"))
            try:
                os.replace(final, old / "x")
            except OSError:
                pass
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process finished the same conversion first; use theirs.
            if not _is_current(final, dtype, weights):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
