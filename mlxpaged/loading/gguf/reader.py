"""A lean GGUF reader: header, metadata, tensor directory, and dequantization.

gguf-py's ``GGUFReader`` builds a numpy view for every metadata element; on a
Qwen2.5 file (151,936 vocabulary strings plus 151,387 merges) that takes 7 to 13
seconds before a single tensor is touched.  This reader parses the same format
with plain ``struct`` calls (well under a second) and keeps the tensor data
memory-mapped, so reading the tokenizer alone stays cheap.  It reuses the
``gguf`` package for the format's constants and for dequantizing block types.

Format reference: the GGUF specification in ggml's docs/gguf.md (little-endian,
versions 2 and 3).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf import quants as _gguf_quants

from ...utils import cdiv

__all__ = [
    "GGUFError",
    "GGUFFile",
    "TensorInfo",
    "SUPPORTED_TYPES",
    "dequantize",
]

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Every type llama.cpp writes when quantizing a qwen2 model with the classic and
# K-quant presets (Q2_K ... Q8_0, and the F16/BF16/F32 the rest stays in).  Each is
# checked against an independent reference in tests/test_gguf.py.  The IQ* and TQ*
# types are left out on purpose: gguf-py could dequantize them, but nothing here
# checks that it does so correctly.
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        "F32",
        "F16",
        "BF16",
        "Q8_0",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
    )
)

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class GGUFError(ValueError):
    """A GGUF file that mlxpaged cannot read or convert; the message is one line."""

    def __init__(self, message: str):
        # Metadata strings end up in messages; keep them on one line.
        super().__init__(" ".join(str(message).split()))


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory.

    ``shape`` is in numpy (row-major) order, i.e. GGUF's ``ne`` reversed, so a
    linear layer's weight is ``(out_features, in_features)`` as in PyTorch.
    """

    name: str
    shape: tuple[int, ...]
    type: GGMLQuantizationType
    offset: int  # absolute offset of the data in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


class _Cursor:
    """Sequential little-endian reads from a buffer, reporting truncation as GGUFError."""

    def __init__(self, buf, name: str):
        self.buf = buf
        self.pos = 0
        self.size = len(buf)
        self.name = name

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > self.size:
            raise GGUFError(
                f"{self.name}: truncated or corrupt GGUF (header runs past the end of the file at byte {self.pos})"
            )
        view = memoryview(self.buf)[self.pos : end]
        self.pos = end
        return view

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = self.take(n)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            # Some converters have written invalid UTF-8 in token strings; keep them readable.
            return bytes(raw).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise GGUFError(f"{self.name}: corrupt GGUF (unknown metadata value type {vtype})") from None
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype = self.scalar("<I")
            count = self.scalar("<Q")
            if etype in _SCALAR_FORMATS_BY_INT:
                fmt = _SCALAR_FORMATS_BY_INT[etype]
                itemsize = struct.calcsize(fmt)
                raw = self.take(count * itemsize)
                # Numeric arrays (token types, scores) can be 150k long: decode in one go.
                return np.frombuffer(raw, dtype=np.dtype(fmt)).tolist()
            if count > self.size - self.pos:
                raise GGUFError(
                    f"{self.name}: truncated or corrupt GGUF (array of {count} items past the end of the file)"
                )
            return [self.value(etype) for _ in range(count)]
        return self.scalar(_SCALAR_FORMATS[vtype])


_SCALAR_FORMATS_BY_INT = {int(k): v for k, v in _SCALAR_FORMATS.items()}


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (dict), ``tensors`` (name -> TensorInfo).

    Tensor data stays on disk (memory-mapped) until :meth:`raw` or
    :meth:`dequantize` asks for it.  Raises :class:`GGUFError` for a file that is
    not GGUF, is truncated, or has a corrupt header.
    """

    def __init__(self, path: str | os.PathLike, *, read_tensors: bool = True):
        self.path = Path(path)
        self.name = str(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 4 or f.read(4) != GGUF_MAGIC:
                    raise GGUFError(f"{self.name} is not a GGUF file (no GGUF magic at the start)")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(f"cannot read {self.name}: {e.strerror or e}") from None
        self.file_size = size
        cur = _Cursor(self._mmap, self.name)
        cur.take(4)
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            if self.version & 0xFFFF == 0 and self.version:
                raise GGUFError(f"{self.name}: big-endian GGUF files are not supported")
            raise GGUFError(f"{self.name}: unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors = cur.scalar("<Q")
        n_kv = cur.scalar("<Q")
        # A record takes at least 8 bytes: bigger counts can only come from garbage.
        if n_tensors > size // 8 or n_kv > size // 8:
            raise GGUFError(f"{self.name}: corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata keys)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        self.tensors: dict[str, TensorInfo] = {}
        if not read_tensors:
            return
        raw_infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if n_dims > 8:
                raise GGUFError(f"{self.name}: corrupt GGUF (tensor {name!r} has {n_dims} dimensions)")
            ne = [cur.scalar("<Q") for _ in range(n_dims)]
            ttype = cur.scalar("<I")
            offset = cur.scalar("<Q")
            raw_infos.append((name, ne, ttype, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)) or DEFAULT_ALIGNMENT
        data_start = cdiv(cur.pos, alignment) * alignment
        for name, ne, ttype, offset in raw_infos:
            try:
                qtype = GGMLQuantizationType(ttype)
            except ValueError:
                raise GGUFError(f"{self.name}: unknown tensor type {ttype} for {name!r}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(ne, dtype=np.int64)) if ne else 1
            if ne and ne[0] % block:
                raise GGUFError(
                    f"{self.name}: corrupt GGUF (row of {name!r} is {ne[0]} values, not a multiple of {block})"
                )
            nbytes = n // block * type_size
            start = data_start + offset
            if start + nbytes > size:
                raise GGUFError(
                    f"{self.name}: truncated GGUF (tensor {name!r} ends at byte {start + nbytes}, file has {size})"
                )
            self.tensors[name] = TensorInfo(name, tuple(int(d) for d in reversed(ne)), qtype, start, nbytes)

    # -- metadata helpers -------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.name}: missing metadata key {key!r}")
        return self.metadata[key]

    # -- tensor data --------------------------------------------------------
    def raw(self, name: str, rows: slice | np.ndarray | None = None) -> np.ndarray:
        """The tensor's bytes as uint8 of shape (rows, bytes per row), optionally a subset of rows."""
        info = self.tensors[name]
        data = np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        n_rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
        data = data.reshape(n_rows, -1)
        return data if rows is None else data[rows]

    def dequantize(self, name: str, rows: slice | np.ndarray | None = None) -> np.ndarray:
        """The tensor as float32 in numpy order (or the selected rows of its 2-D view)."""
        info = self.tensors[name]
        if info.type not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{self.name}: unsupported tensor type {info.type.name} for {name!r} "
                f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})"
            )
        out = dequantize(self.raw(name, rows), info.type)
        return out.reshape(info.shape) if rows is None else out

    def close(self) -> None:
        try:
            self._mmap.close()
        except BufferError:
            # numpy views of the mapping are still alive; the mapping goes when they do.
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Decode rows of raw GGUF bytes (uint8, shape (..., bytes per row)) to float32.

    Float types are decoded here; block types go to ``gguf.quants.dequantize``
    (llama.cpp's own numpy port of ggml's reference decoders).
    """
    qtype = GGMLQuantizationType(qtype)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32).copy()
    if qtype == GGMLQuantizationType.F16:
        return raw.view(np.float16).astype(np.float32)
    if qtype == GGMLQuantizationType.BF16:
        # bfloat16 is the top half of a float32.
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if qtype not in SUPPORTED_TYPES:
        raise GGUFError(f"unsupported tensor type {qtype.name}")
    return _gguf_quants.dequantize(raw, qtype).astype(np.float32, copy=False)
