"""LoRA adapters served per request, rows of many adapters in one packed forward pass.

An adapter is what `mlx_lm.lora` writes (`adapter_config.json` + `adapters.safetensors`: for each
targeted linear `<path>.lora_a` `[in, r]` and `<path>.lora_b` `[r, out]`, one `scale`), or a PEFT
LoRA (`adapter_model.safetensors`: `base_model.model.<path>.lora_A.weight` `[r, in]` and
`lora_B.weight` `[out, r]`, scale `lora_alpha / r`, or `/ sqrt(r)` with rsLoRA), read into mlx-lm's
layout. mlx-lm's `LoRALinear` computes, with dropout off at inference,

    y = linear(x) + (scale * ((x @ lora_a) @ lora_b)).astype(x.dtype)

and so does `LoRARows` here, for each packed row with its own adapter's `lora_a`, `lora_b` and
`scale`: the base product (a `Linear` or a `QuantizedLinear`, QLoRA-style) once for all rows, then
the low-rank products gathered by adapter (`mx.gather_mm`; `sorted_indices` when the rows come
grouped). A row without an adapter reads slot 0, whose weights and scale are zero: its output is
the base model's, bit for bit.

The model knows nothing of adapters but `AttentionMetadata.lora`, a `StepAdapters` built by the
model runner for one pass (each packed row's slot): the paged pass swaps each targeted linear for a
`LoRARows` for that pass only (paged_adapter.py `_swapped`); nothing is stored on mlx-lm's modules.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import AdapterRefused, MlxPagedError

_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True, eq=False)
class Adapter:
    """One loaded adapter: `slot` is its index in `AdapterSet`'s stacks (1..N; 0 is the base
    model); `key` (its weights' and scale's digest) is folded into a first block's hash, so its
    cached blocks are shared only with requests of the same adapter (core/block_manager.py)."""

    name: str
    path: Path
    slot: int
    key: bytes


@dataclass(frozen=True)
class _Target:
    """One targeted linear: where it sits (`parent[attr]`) and every slot's low-rank weights.
    Invariant: `a` is `[N + 1, in, r]` and `b` `[N + 1, r, out]`, slot 0 zeros, slot k adapter
    k's (zeros where adapter k does not target this linear, or has a smaller rank)."""

    parent: nn.Module
    attr: str
    a: mx.array
    b: mx.array


class StepAdapters:
    """One pass's adapters: `rows[t]` is packed row t's slot, `scales[t]` its adapter's scale
    (0 for the base model). Built by the model runner, read by the paged pass (`swaps`)."""

    __slots__ = ("targets", "rows", "scales", "sorted")

    def __init__(self, targets: dict[str, _Target], slots: np.ndarray, scales: np.ndarray):
        self.targets = targets
        self.rows = mx.array(slots.astype(np.uint32))
        self.scales = mx.array(scales[slots].astype(np.float32))[:, None, None]  # [T, 1, 1]
        self.sorted = bool(np.all(slots[1:] >= slots[:-1]))

    def swaps(self) -> list:
        """(module, name, stand-in) for each targeted linear, for `paged_adapter._swapped`."""
        return [(t.parent, t.attr, LoRARows(t.parent[t.attr], t.a, t.b, self)) for t in self.targets.values()]


class LoRARows:
    """A targeted linear for one pass over packed rows of several adapters.

    Our own layer, not mlx-lm's `LoRALinear`, because that one applies one adapter (its own
    `lora_a`, `lora_b`, `scale`) to every row; here the base product is computed once for all the
    step's rows and each row adds its own adapter's low-rank product, in `LoRALinear.__call__`'s
    order of operations, gathered by the row's slot. A plain callable put in its parent for one
    pass (it holds no parameters)."""

    __slots__ = ("linear", "a", "b", "step")

    def __init__(self, linear: nn.Module, a: mx.array, b: mx.array, step: StepAdapters):
        self.linear, self.a, self.b, self.step = linear, a, b, step

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        rows = self.step.rows
        if x.ndim not in (2, 3) or x.shape[0] != rows.shape[0]:
            from .paged_adapter import AdapterError

            raise AdapterError(
                f"a LoRA-targeted linear got input {x.shape}, not the pass's {rows.shape[0]} packed rows first"
            )
        s = self.step.sorted
        z = mx.gather_mm(x.reshape(x.shape[0], -1, x.shape[-1]), self.a, rhs_indices=rows, sorted_indices=s)
        z = mx.gather_mm(z, self.b, rhs_indices=rows, sorted_indices=s)  # [T, rows of x, out]
        return y + (self.step.scales.astype(z.dtype) * z).reshape(y.shape).astype(x.dtype)


def _input_dims(linear: nn.Module) -> int:
    out, inp = linear.weight.shape
    return inp * 32 // linear.bits if isinstance(linear, nn.QuantizedLinear) else inp


def read_adapter(path: str | Path) -> tuple[dict[str, tuple[mx.array, mx.array]], float]:
    """`({module path: (lora_a [in, r], lora_b [r, out])}, scale)` of the adapter at `path`, in
    mlx-lm's layout; raises MlxPagedError naming what is missing or not a LoRA this serves."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise MlxPagedError(f"adapter {path}: not a directory (give the folder mlx_lm.lora wrote)")
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise MlxPagedError(f"adapter {path}: no adapter_config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise MlxPagedError(f"adapter {path}: adapter_config.json is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise MlxPagedError(f"adapter {path}: adapter_config.json is not a JSON object")
    if (path / "adapters.safetensors").is_file():
        return _read_mlx_lm(path, cfg)
    if (path / "adapter_model.safetensors").is_file():
        return _read_peft(path, cfg)
    raise MlxPagedError(f"adapter {path}: neither adapters.safetensors (mlx-lm) nor adapter_model.safetensors (PEFT)")


def _load(file: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(file))
    except Exception as e:  # noqa: BLE001 - a damaged file is refused in one line
        raise MlxPagedError(f"adapter {file}: cannot be read ({str(e).splitlines()[0][:120]})") from None


def _read_mlx_lm(path: Path, cfg: dict) -> tuple[dict, float]:
    kind = cfg.get("fine_tune_type", "lora")
    if kind != "lora":
        raise MlxPagedError(f"adapter {path}: fine_tune_type {kind!r} is not served (only LoRA adapters: 'lora')")
    params = cfg.get("lora_parameters")
    if not isinstance(params, dict) or not isinstance(params.get("scale"), (int, float)):
        raise MlxPagedError(f"adapter {path}: adapter_config.json has no lora_parameters.scale")
    pairs: dict[str, dict[str, mx.array]] = {}
    for name, w in _load(path / "adapters.safetensors").items():
        module, _, leaf = name.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise MlxPagedError(f"adapter {path}: tensor {name} is not a LoRA weight (lora_a, lora_b)")
        pairs.setdefault(module, {})[leaf] = w
    return _paired(path, pairs, "lora_a", "lora_b"), float(params["scale"])


def _read_peft(path: Path, cfg: dict) -> tuple[dict, float]:
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise MlxPagedError(f"adapter {path}: peft_type {kind!r} is not served (only LORA)")
    for field, off in (("use_dora", False), ("bias", "none"), ("modules_to_save", None)):
        if cfg.get(field, off) not in (off, None, [], {}):
            raise MlxPagedError(f"adapter {path}: {field} {cfg[field]!r} is not served (plain LoRA only)")
    for field in ("rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            raise MlxPagedError(f"adapter {path}: a per-module {field} is not served (one rank and alpha)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise MlxPagedError(f"adapter {path}: adapter_config.json needs an integer r and a lora_alpha")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    pairs: dict[str, dict[str, mx.array]] = {}
    for name, w in _load(path / "adapter_model.safetensors").items():
        short = name.removeprefix(_PEFT_PREFIX)
        for leaf in ("lora_A", "lora_B"):
            if short.endswith(f".{leaf}.weight"):
                pairs.setdefault(short.removesuffix(f".{leaf}.weight"), {})[leaf] = w.T  # mlx-lm's [in, r], [r, out]
                break
        else:
            raise MlxPagedError(f"adapter {path}: tensor {name} is not a LoRA weight (lora_A, lora_B)")
    return _paired(path, pairs, "lora_A", "lora_B"), float(scale)


def _paired(path: Path, pairs: dict, a: str, b: str) -> dict[str, tuple[mx.array, mx.array]]:
    out = {}
    for module, got in pairs.items():
        if set(got) != {a, b}:
            raise MlxPagedError(f"adapter {path}: {module} has {', '.join(sorted(got))} but not both {a} and {b}")
        if got[a].ndim != 2 or got[b].ndim != 2 or got[a].shape[1] != got[b].shape[0]:
            raise MlxPagedError(
                f"adapter {path}: {module}'s {a} {tuple(got[a].shape)} and {b} {tuple(got[b].shape)} "
                "are not a LoRA pair"
            )
        out[module] = (got[a], got[b])
    if not out:
        raise MlxPagedError(f"adapter {path}: no LoRA weights")
    return out


def _folder(name: str) -> Path | None:
    """`name` as an existing folder, resolved, or None (a name a client sent: never raises)."""
    try:
        p = Path(name).expanduser()
        return p.resolve() if p.is_dir() else None
    except (OSError, ValueError, RuntimeError):
        return None


def _digest(path: Path, weights: dict, scale: float) -> bytes:
    h = hashlib.sha256(repr(scale).encode())
    for name in sorted(weights):
        for w in weights[name]:
            h.update(name.encode())
            h.update(np.asarray(w.astype(mx.float32)).tobytes())
    return b"adapter:" + h.digest()


class AdapterSet:
    """The adapters one engine serves, by name, stacked per targeted linear (`_Target`).

    Invariant: `adapters[name].slot` is k in 1..N, `scales[k]` its scale (`scales[0] == 0`), and
    every target's stacks have N + 1 slots. Adding an adapter rebuilds the stacks and swaps them in
    whole (`_targets` is replaced, never changed), so a pass built before keeps its own."""

    def __init__(self, model: nn.Module, model_type: str = "model", directory: str | Path | None = None):
        from .cache_spec import RECURRENT
        from .paged_adapter import cache_spec

        self.model, self.model_type = model, model_type
        # a folder whose adapter folders requests may name, each loaded on first use (`get`)
        self.directory = Path(directory).expanduser().resolve() if directory is not None else None
        if self.directory is not None and not self.directory.is_dir():
            raise MlxPagedError(f"adapter directory {directory}: not a directory")
        self.adapters: dict[str, Adapter] = {}
        self._weights: list[dict[str, tuple[mx.array, mx.array]]] = [{}]  # by slot; slot 0 the base
        self.scales = np.zeros(1, dtype=np.float32)
        self._targets: dict[str, _Target] = {}
        self._modules = dict(model.named_modules())
        # the linears that see the pass's packed rows: those inside the decoder layers (not the output
        # layer, which sees only the sampled rows, nor a recurrent layer, run per sequence)
        kinds = [lay.kind for lay in cache_spec(model).layers]
        self._in_layers = {
            id(m) for layer, kind in zip(model.layers, kinds) if kind != RECURRENT for _, m in layer.named_modules()
        }

    @classmethod
    def load(
        cls, model: nn.Module, adapters: dict[str, str], model_type: str = "model", directory: str | None = None
    ) -> AdapterSet:
        out = cls(model, model_type, directory)
        for name, path in (adapters or {}).items():
            out.add(name, path)
        return out

    def names(self) -> str:
        served = ", ".join(f"'{n}'" for n in self.adapters) or "none"
        return served + (", and the adapter folders of its adapter directory" if self.directory else "")

    def find(self, name: str) -> Adapter | tuple[str, Path]:
        """The adapter `name` names (its name, or the folder it was loaded from), or, when it names
        a folder in `directory` not loaded yet, (its name, that folder); KeyError naming it. Reads
        only: safe from any thread."""
        found = self.adapters.get(name)
        if found is not None:
            return found
        folder = _folder(name)  # a path given as it was at start (mlx_lm.server's `adapters` is one)
        if folder is not None:
            found = next((a for a in self.adapters.values() if a.path == folder), None)
            if found is not None:
                return found
        if self.directory is not None:
            if folder is None and "/" not in name and "\\" not in name:
                folder = _folder(str(self.directory / name))
            if folder is not None and folder.parent == self.directory and not folder.name.startswith("."):
                loaded = self.adapters.get(folder.name)
                return loaded if loaded is not None and loaded.path == folder else (folder.name, folder)
        raise KeyError(f"unknown adapter '{name}': this model serves {self.names()}")

    def get(self, name: str) -> Adapter:
        """`find`, loading a folder of `directory` on first use (on the engine's thread: `add`
        replaces the stacks the passes read); KeyError naming an unknown adapter, AdapterRefused
        naming why a folder cannot be served."""
        found = self.find(name)
        if isinstance(found, Adapter):
            return found
        try:
            return self.add(*found)
        except MlxPagedError as e:  # named, not by its path on the server
            raise AdapterRefused(str(e).replace(f"adapter {found[1]}", f"adapter '{found[0]}'")) from None

    def add(self, name: str, path: str | Path) -> Adapter:
        """Load, check against the model and stack one adapter; MlxPagedError naming a mismatch."""
        if not name or ":" in name:
            raise MlxPagedError(f"adapter name {name!r}: give a non-empty name without ':'")
        if name in self.adapters:
            raise MlxPagedError(f"adapter name '{name}' is given twice")
        weights, scale = read_adapter(path)
        for module, (a, b) in weights.items():
            self._check(name, module, a, b)
        path = Path(path).expanduser().resolve()
        adapter = Adapter(name, path, len(self._weights), _digest(path, weights, scale))
        self._weights.append(weights)
        self.scales = np.append(self.scales, np.float32(scale))
        self._targets = self._stack()
        self.adapters[name] = adapter
        return adapter

    def _check(self, name: str, module: str, a: mx.array, b: mx.array) -> None:
        linear = self._modules.get(module)
        where = f"adapter '{name}' ({self.model_type})"
        if linear is None:
            raise MlxPagedError(f"{where}: {module} is not a layer of this model: an adapter for another base model")
        if not isinstance(linear, (nn.Linear, nn.QuantizedLinear)) or id(linear) not in self._in_layers:
            raise MlxPagedError(
                f"{where}: {module} is a {type(linear).__name__}; adapters are served on the linear layers of "
                "the attention layers (their attention and MLP), not on embeddings, experts, the output layer "
                "or recurrent layers"
            )
        want = (_input_dims(linear), linear.weight.shape[0])
        if a.shape[0] != want[0] or b.shape[1] != want[1]:
            raise MlxPagedError(
                f"{where}: {module} is {want[0]} -> {want[1]} in this model, the adapter's is "
                f"{a.shape[0]} -> {b.shape[1]}: an adapter for another base model"
            )

    def _stack(self) -> dict[str, _Target]:
        out = {}
        paths = dict.fromkeys(m for w in self._weights for m in w)
        for module in paths:
            linear = self._modules[module]
            parent_path, _, attr = module.rpartition(".")
            parent = self._modules.get(parent_path)
            if parent is None or parent.get(attr) is not linear:
                raise MlxPagedError(f"adapter target {module}: its parent module cannot be found in the model")
            inp, outd = _input_dims(linear), linear.weight.shape[0]
            r = max(w[module][0].shape[1] for w in self._weights if module in w)
            dtype = mx.float32 if any(module in w and w[module][0].dtype == mx.float32 for w in self._weights) else None
            a_rows, b_rows = [], []
            for w in self._weights:
                a, b = w.get(module, (None, None))
                dt = dtype or (a.dtype if a is not None else linear.weight.dtype)
                za, zb = mx.zeros((inp, r), dtype=dt), mx.zeros((r, outd), dtype=dt)
                if a is not None:  # a smaller rank: zero columns of A and rows of B add nothing
                    za[:, : a.shape[1]] = a.astype(dt)
                    zb[: b.shape[0], :] = b.astype(dt)
                a_rows.append(za)
                b_rows.append(zb)
            out[module] = _Target(parent, attr, mx.stack(a_rows), mx.stack(b_rows))
        mx.eval([t.a for t in out.values()] + [t.b for t in out.values()])
        return out

    def step(self, slots) -> StepAdapters | None:
        """One pass's input for packed rows whose slots are `slots` (None when all are the base's)."""
        slots = np.asarray(slots, dtype=np.int64)
        if not slots.any():
            return None
        return StepAdapters(self._targets, slots, self.scales)
