"""Engine settings in parts, each validated once, as vLLM's `VllmConfig` is: `CacheConfig` (the
pool, its quantization and the prefix cache's tiers), `SchedulerConfig` (the batch), and
`SpeculativeConfig` (speculative decoding); `EngineConfig` holds them and the kernel choice.
`EngineConfig.of(**flat)` builds one from flat settings (flags, tests), as vLLM's `EngineArgs` does.
Tensor parallelism is not a setting here: `engine/builder.py` takes it from `mx.distributed`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64)
PREFILL_ORDERS = ("fcfs", "shortest")


def check_kv_quant(bits: int | None, group_size: int, head_dim: int | None = None) -> None:
    """Raise `ValueError` unless `bits`/`group_size` name a supported quantized cache."""
    if bits is None:
        return
    if bits not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {KV_BITS} (or None for a float cache), got {bits}")
    if group_size not in KV_GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {group_size}")
    if head_dim is not None and head_dim % group_size:
        raise ValueError(f"head_dim {head_dim} is not a multiple of kv_group_size {group_size}")


@dataclass
class CacheConfig:
    """The KV pool, its quantization, and the prefix cache's two tiers.

    num_blocks: blocks in the pool; `None` makes the pool start at 4,096 slots and grow as blocks
      are needed, 1,024 slots at a time (or an eighth of itself; `kv_chunk_blocks`, if set, is
      both the start and the step), up to `kv_memory_gb` GB if set, else `kv_memory_fraction`
      of the available memory (memory alone: it holds what is in use); an idle server trims it
      back (`BlockPool.trim`). `max_kv_tokens` caps only a fixed pool sized from memory
      (`generate`'s, a tensor-parallel rank's).
    kv_bits: None keeps K/V rows in the model's dtype; 8 or 4 stores them quantized along
      head_dim in groups of `kv_group_size` (32 or 64) with a scale and a bias per group, so
      the same memory holds about 1.9x (8-bit) or 3.5x (4-bit) the tokens of a float16 cache.
    prefix_cache_dir: a directory for the prefix cache's disk tier (docs/prefix-cache.md): full
      blocks are written there by hash and read back on a memory miss, across restarts.
      prefix_cache_disk_gb caps it (least recently used blocks go first; None: 8 GB or a quarter of the free space).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_fraction: float = 0.25
    kv_memory_gb: float | None = None
    kv_chunk_blocks: int | None = None
    max_kv_tokens: int = 65536
    enable_prefix_caching: bool = True
    kv_bits: int | None = None
    kv_group_size: int = 64
    prefix_cache_dir: str | None = None
    prefix_cache_disk_gb: float | None = None

    def __post_init__(self):
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"block size must be a power of two from 1 to 256, got {bs}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise ValueError(f"kv_memory_gb must be > 0, got {self.kv_memory_gb}")
        if self.kv_chunk_blocks is not None and self.kv_chunk_blocks < 1:
            raise ValueError(f"kv_chunk_blocks must be >= 1, got {self.kv_chunk_blocks}")
        if self.prefix_cache_dir is not None and not self.enable_prefix_caching:
            raise ValueError("prefix_cache_dir needs prefix caching on (drop --no-prefix-caching)")
        if self.prefix_cache_disk_gb is not None and not self.prefix_cache_disk_gb > 0:
            raise ValueError(f"prefix_cache_disk_gb must be > 0, got {self.prefix_cache_disk_gb}")
        if self.prefix_cache_disk_gb is not None and self.prefix_cache_dir is None:
            raise ValueError("prefix_cache_disk_gb needs prefix_cache_dir")
        if self.kv_group_size not in KV_GROUP_SIZES:  # checked even for a float cache: a typo is a typo
            raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {self.kv_group_size}")
        check_kv_quant(self.kv_bits, self.kv_group_size)


@dataclass
class SchedulerConfig:
    """Each step's batch.

    max_num_seqs: sequences (samples) running at once. max_num_batched_tokens: tokens one step
      computes (decodes plus prefill chunks); a longer prompt is prefilled in chunks.
    watermark: share of the pool kept free when admitting a request, so running sequences
      can grow a little before anyone is preempted.
    async_scheduling: launch step t+1 (`mx.async_eval`) before reading step t's sampled tokens
      back, so scheduling, input building, stop checks and detokenizing overlap the device's
      work; the outputs are the same as with it off (engine.py says how, and when a step
      still waits: beam-search rows).
    prefill_order: which prompt is computed first when several wait: "fcfs" (arrival order) or
      "shortest" (fewest prompt tokens left to compute, after prefix hits: an agent's short
      follow-up turn is not queued behind another conversation's long prompt; one passed over
      for `PASSED_OVER_LIMIT` steps goes first, so none starves). The same tokens either way.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    watermark: float = 0.01
    async_scheduling: bool = True
    prefill_order: str = "fcfs"

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: `method` None (off) or "ngram": prompt lookup proposes up to
    `num_speculative_tokens` tokens per step for each sequence, from the last `prompt_lookup_max`
    down to `prompt_lookup_min` tokens found earlier in its prompt or output; all are verified in
    the step's one forward pass (engine/spec_decode.py, docs/speculative.md). Speculation stops
    while more than `max_batch_size` samples run. "draft": `draft_model` (a smaller checkpoint
    with the target's tokenizer) proposes them greedily, on its own pool with the target pool's
    block ids (engine/draft.py)."""

    method: str | None = None
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    max_batch_size: int = 8
    draft_model: str | None = None

    def __post_init__(self):
        if self.method not in (None, "ngram", "draft"):
            raise ValueError(f"speculative must be None, 'ngram' or 'draft', got {self.method!r}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError(
                "speculative='draft' needs a draft model (--draft-model)"
                if self.draft_model is None
                else f"a draft model needs speculative='draft', got {self.method!r}"
            )
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(
                f"num_speculative_tokens must be an integer from 1 to 32, got {self.num_speculative_tokens!r}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )
        if self.max_batch_size < 0:
            raise ValueError(f"speculative_max_batch_size must be >= 0, got {self.max_batch_size}")


# Flat setting (EngineConfig.of, the flags) -> (part, field) where the names differ; every other
# flat name is its part's field of the same name (`_PARTS` finds it).
_RENAMED = {
    "speculative": ("speculative", "method"),
    "speculative_max_batch_size": ("speculative", "max_batch_size"),
}


@dataclass
class EngineConfig:
    """An engine's settings: its parts, and which paged-attention implementation runs
    (`attention_impl`: "auto", "reference" or "metal"; attention/__init__.py)."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    attention_impl: str = "auto"

    @classmethod
    def of(cls, **flat) -> EngineConfig:
        """From flat settings, each named as its flag (`block_size`, `max_num_seqs`,
        `speculative`, `speculative_max_batch_size`, ...); an unknown name is a `TypeError`,
        as for any keyword."""
        parts: dict[str, dict] = {"cache": {}, "scheduler": {}, "speculative": {}}
        top = {}
        for name, value in flat.items():
            where = flat_field(name)
            if where is None:
                raise TypeError(f"EngineConfig.of() got an unexpected keyword argument {name!r}")
            part, f = where
            if part is None:
                top[f] = value
            else:
                parts[part][f] = value
        return cls(
            CacheConfig(**parts["cache"]),
            SchedulerConfig(**parts["scheduler"]),
            SpeculativeConfig(**parts["speculative"]),
            **top,
        )

    def flat(self) -> dict:
        """The flat settings `of` takes back (a tensor-parallel rank's copy, the flags)."""
        out = {"attention_impl": self.attention_impl}
        names = {v: k for k, v in _RENAMED.items()}
        for part in ("cache", "scheduler", "speculative"):
            for f in fields(getattr(self, part)):
                out[names.get((part, f.name), f.name)] = getattr(getattr(self, part), f.name)
        return out


_PARTS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "speculative": SpeculativeConfig}


def flat_field(name: str) -> tuple[str | None, str] | None:
    """(part, field) of a flat setting's name (part None: `EngineConfig`'s own), or None."""
    if name in _RENAMED:
        return _RENAMED[name]
    if name == "attention_impl":
        return None, name
    for part, cls in _PARTS.items():
        if part != "speculative" and name in cls.__dataclass_fields__:
            return part, name
    if name in SpeculativeConfig.__dataclass_fields__ and name != "method" and name != "max_batch_size":
        return "speculative", name
    return None
