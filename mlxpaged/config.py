"""Engine settings, validated once."""

from __future__ import annotations

from dataclasses import dataclass

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64)


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
class EngineConfig:
    """Sizes of the KV pool and of each step's batch.

    num_blocks: blocks in the pool; `None` makes the pool grow as blocks are needed, a chunk
      (`kv_chunk_blocks`, default 4096 slots) at a time, up to `kv_memory_gb` GB if set, else
      `kv_memory_fraction` of the available memory (memory alone: it holds what is in use); an
      idle server trims it back (`BlockPool.trim`). `max_kv_tokens` caps only a fixed pool sized
      from memory (`generate`'s, a tensor-parallel rank's).
    max_num_seqs: sequences (samples) running at once. max_num_batched_tokens: tokens one step
      computes (decodes plus prefill chunks); a longer prompt is prefilled in chunks.
    watermark: share of the pool kept free when admitting a request, so running sequences
      can grow a little before anyone is preempted.
    kv_bits: None keeps K/V rows in the model's dtype; 8 or 4 stores them quantized along
      head_dim in groups of `kv_group_size` (32 or 64) with a scale and a bias per group, so
      the same memory holds about 1.9x (8-bit) or 3.5x (4-bit) the tokens of a float16 cache.
    async_scheduling: launch step t+1 (`mx.async_eval`) before reading step t's sampled tokens
      back, so scheduling, input building, stop checks and detokenizing overlap the device's
      work; the outputs are the same as with it off (engine.py says how, and when a step
      still waits: beam-search rows).
    prefix_cache_dir: a directory for the prefix cache's disk tier (docs/prefix-cache.md): full
      blocks are written there by hash and read back on a memory miss, across restarts.
      prefix_cache_disk_gb caps it (least recently used blocks go first; None: 8 GB or a quarter of the free space).
    speculative: None (off) or "ngram": prompt lookup proposes up to `num_speculative_tokens`
      tokens per step for each sequence, from the last `prompt_lookup_max` down to
      `prompt_lookup_min` tokens found earlier in its prompt or output; all are verified in
      the step's one forward pass (engine/spec_decode.py, docs/speculative.md). Speculation
      stops while more than `speculative_max_batch_size` samples run. "draft": `draft_model` (a
      smaller checkpoint with the target's tokenizer) proposes them greedily, on its own pool with
      the target pool's block ids (engine/draft.py).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_fraction: float = 0.25
    kv_memory_gb: float | None = None
    kv_chunk_blocks: int | None = None
    max_kv_tokens: int = 65536
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    attention_impl: str = "auto"
    kv_bits: int | None = None
    kv_group_size: int = 64
    async_scheduling: bool = True
    prefix_cache_dir: str | None = None
    prefix_cache_disk_gb: float | None = None
    speculative: str | None = None
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    speculative_max_batch_size: int = 8
    draft_model: str | None = None

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
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.prefix_cache_dir is not None and not self.enable_prefix_caching:
            raise ValueError("prefix_cache_dir needs prefix caching on (drop --no-prefix-caching)")
        if self.prefix_cache_disk_gb is not None and not self.prefix_cache_disk_gb > 0:
            raise ValueError(f"prefix_cache_disk_gb must be > 0, got {self.prefix_cache_disk_gb}")
        if self.prefix_cache_disk_gb is not None and self.prefix_cache_dir is None:
            raise ValueError("prefix_cache_disk_gb needs prefix_cache_dir")
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError(f"speculative must be None, 'ngram' or 'draft', got {self.speculative!r}")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError(
                "speculative='draft' needs a draft model (--draft-model)"
                if self.draft_model is None
                else f"a draft model needs speculative='draft', got {self.speculative!r}"
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
        if self.speculative_max_batch_size < 0:
            raise ValueError(f"speculative_max_batch_size must be >= 0, got {self.speculative_max_batch_size}")
        if self.kv_group_size not in KV_GROUP_SIZES:  # checked even for a float cache: a typo is a typo
            raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {self.kv_group_size}")
        check_kv_quant(self.kv_bits, self.kv_group_size)
