"""The engine's parts, built once from a loaded model and its settings: `build_parts` reads what
the model is (its cache spec, its cache shape, its tokenizer) once and hands the values down to
each part (the pools, the block manager, the runner, the scheduler and the step layers), so no
part goes back to the model for them. `LLMEngine.__init__` receives the `EngineParts` and stores
them; `engine.builder.build_engine` (and a bare `LLMEngine(loaded, config)`) ask for them here.

This module imports nothing of `llm_engine` (which imports it), and `builder` imports
`llm_engine` through the tensor-parallel engine, so the parts are built here, not in `builder`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..attention import resolve_impl
from ..config import EngineConfig
from ..core.block_manager import BlockManager, HashFn, sha256_block_hash
from ..core.kv_groups import GroupSpec, RecurrentStateGroup
from ..core.scheduler import Scheduler
from ..models.lora import AdapterSet
from ..utils import cdiv
from ..worker.kv_cache import CacheShape, PagedKVCache, growable_pool, pool_blocks
from ..worker.kv_calibration import model_key_scales
from ..worker.model_runner import ModelRunner
from ..worker.prefix_store import PrefixStore
from ..worker.state_cache import CHECKPOINT_BYTES, CHECKPOINTS, Checkpoints, spec_nbytes, state_spec
from .beam_search import BeamLayer
from .draft import DraftProposer, draft_slots, load_draft
from .grammar_layer import GrammarLayer
from .guided import GrammarCompiler
from .kv_connector import DiskConnector
from .multimodal import EncoderCache
from .pooling import PoolingLayer
from .prompt_logprobs import PromptLogprobs
from .recurrent_state import CheckpointNamer
from .spec_decode import NgramProposer, Verifier
from .stats import EngineStats
from .step import Layers
from .stopping import StopChecker, detokenizers, hidden_token_ids

if TYPE_CHECKING:  # annotations only: loading imports nothing of the engine
    from ..loading.loader import LoadedModel

# (rank, world size, agree on a hit count): a plain engine is rank 0 of 1 and agrees with itself
Ranks = tuple[int, int, Callable[[int], int] | None]
SOLO: Ranks = (0, 1, None)


@dataclass
class EngineParts:
    """Everything an `LLMEngine` runs with, wired to each other: the block manager's groups match
    the KV pools' groups and sizes, the runner and the disk connector write those pools, and
    `layers` holds the step layers in the order the step calls them (step.py). The named layers
    (`beams`, `prompt_logprobs`, `pooling`, `grammar`) are also in `layers`, dormant until a
    request wakes them."""

    adapters: AdapterSet | None
    detokenizer: Callable
    cache_shape: CacheShape
    state_bytes: int  # one sequence's recurrent state, every layer (0: no recurrent layer)
    block_manager: BlockManager
    kv_cache: PagedKVCache
    runner: ModelRunner
    scheduler: Scheduler
    check_stop: StopChecker
    stats: EngineStats
    layers: Layers
    drafter: DraftProposer | None
    prefix_store: PrefixStore | None
    beams: BeamLayer
    prompt_logprobs: PromptLogprobs
    pooling: PoolingLayer
    grammar: GrammarLayer
    encoder_cache: EncoderCache


def build_parts(
    loaded: LoadedModel,
    config: EngineConfig,
    *,
    hash_fn: HashFn = sha256_block_hash,
    adapters: AdapterSet | None = None,
    ranks: Ranks = SOLO,
) -> EngineParts:
    """The parts of an engine over `loaded` with `config`. `adapters`: the LoRA adapters the
    requests may name, already checked against the model (`AdapterSet.load`); `ranks`: this
    process's place in a tensor-parallel group (the disk tier is namespaced by rank and agrees on
    hits).

    The parts are built from the bottom up: what the model needs on the device (its states, key
    scales, pool size, pools, runner and disk tier), then the block manager and the scheduler over
    those pools, then the step layers the engine calls."""
    model, tokenizer, spec = loaded.model, loaded.tokenizer, loaded.cache_spec
    bs = config.cache.block_size
    draft = load_draft(config.speculative.draft_model, loaded.dtype) if config.speculative.method == "draft" else None
    # A hybrid model (recurrent layers, worker/state_cache.py): one sequence's state bytes, and its
    # prefix-state checkpoints when prefix caching is on.
    state_bytes, checkpoints = 0, None
    if spec.num_recurrent:
        states = state_spec(model)
        state_bytes = spec_nbytes(states)
        if config.cache.enable_prefix_caching:
            checkpoints = Checkpoints(min(CHECKPOINT_BYTES, CHECKPOINTS * state_bytes), states, bs)
    cache_shape = CacheShape.of(loaded).quantized(config.cache.kv_bits, config.cache.kv_group_size)
    # A quantized cache divides keys by per-channel scales, measured once per loaded model (kv_calibration.py).
    quant = config.cache.kv_bits is not None and not cache_shape.keys_only  # MLA: keys stay unscaled
    scales = model_key_scales(loaded) if quant else None
    # The draft's pool has the target pool's block ids: its bytes count in every block.
    extra = CacheShape.of(draft).bytes_per_block(bs) if draft is not None else 0
    # A hybrid's running sequences hold recurrent states beside their blocks: a pool sized from
    # memory leaves room for max_num_seqs of them (and the checkpoints), at most half its budget.
    held = state_bytes * config.scheduler.max_num_seqs + (checkpoints.cap_bytes if checkpoints else 0)
    growth = growable_pool(loaded, config, extra, held)  # (start, cap, chunk), or None for a fixed pool
    num_blocks = growth[0] if growth else pool_blocks(loaded, config, extra_block_bytes=extra, reserved_bytes=held)
    # Layers of each kind of cache form a group of their own (core/kv_groups.py), whose blocks
    # no later token reads go back. A growing pool's local group (a window, a chunk) starts at a
    # span's worth of blocks and grows by as much (memory follows the spans); a fixed pool gives
    # every group its size (what a group releases is room for more sequences, as in vLLM).
    kinds, layer_groups = spec.groups()
    steps = [cdiv(span, bs) + 1 if span is not None and growth else None for _, span in kinds]
    groups = [GroupSpec(k, n, min(step, num_blocks) if step else None) for (k, n), step in zip(kinds, steps)]
    kv_cache = PagedKVCache.for_model(
        model,
        spec,
        cache_shape,
        num_blocks,
        bs,
        scales,
        groups=layer_groups if len(kinds) > 1 else (),
        group_blocks=tuple(g.num_blocks or num_blocks for g in groups),
    )
    # With the Metal kernel in use, build and check its variants now, before any request: a
    # variant that fails falls back to the reference with one warning (attention/metal.py).
    metal = resolve_impl(config.attention_impl) == "metal"
    if metal:
        from ..attention.metal import check_pools

        check_pools(model.args.num_attention_heads, kv_cache.keys)
    runner = ModelRunner(model, kv_cache, config.attention_impl, checkpoints, adapters)
    prefix_store = None
    if config.cache.prefix_cache_dir:
        # The disk tier (prefix_store.py); on a tensor-parallel rank its lookups agree on the smallest hit count.
        gb = config.cache.prefix_cache_disk_gb
        rank, world, agree = ranks
        prefix_store = PrefixStore.for_model(
            config.cache.prefix_cache_dir,
            loaded,
            kv_cache,
            bs,
            cap_bytes=None if gb is None else int(gb * 1e9),
            rank=rank,
            world=world,
            agree=agree,
        )
    if checkpoints is not None and prefix_store is not None and prefix_store.enabled:
        checkpoints.disk = prefix_store.dir / "states"  # beside the blocks, in their namespace
    block_manager = BlockManager(
        num_blocks,
        bs,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        hash_fn=hash_fn,
        extra_key=loaded.identity,
        groups=groups
        + ([RecurrentStateGroup(checkpoints)] if checkpoints is not None else []),  # hits end at a checkpoint
    )
    if growth:
        block_manager.pool.enable_growth(growth[1], growth[2])
        for g, step in zip(block_manager.groups[1:], steps[1:]):
            g.pool.enable_growth(max(growth[1], g.pool.num_blocks), step)
    proposer = None
    if config.speculative.method == "ngram":
        proposer = NgramProposer(config.speculative.prompt_lookup_min, config.speculative.prompt_lookup_max)
    elif config.speculative.method == "draft":
        proposer = draft_slots
    scheduler = Scheduler(config, block_manager, proposer)
    check_stop = StopChecker(set(getattr(tokenizer, "eos_token_ids", None) or []), hidden_token_ids(tokenizer))
    stats = EngineStats()
    drafter = DraftProposer(draft, loaded, num_blocks, bs, config.attention_impl) if draft is not None else None
    # The features beyond the plain pipeline, called at each of its stages in this order (step.py).
    layers = Layers([drafter] if drafter is not None else [])
    if config.speculative.method is not None:
        layers.append(Verifier(scheduler, stats, check_stop))
    # (dormant until a request asks for their feature: the plain step calls neither)
    beams = BeamLayer(scheduler, stats, lambda t: t in check_stop.eos_token_ids)
    layers.append(beams, dormant=True)
    prompt_logprobs = PromptLogprobs()
    layers.append(prompt_logprobs, dormant=True)
    pooling = PoolingLayer(scheduler)
    layers.append(pooling, dormant=True)
    # Grammars are compiled by the first guided request; each rank of a tensor-parallel group
    # would time its masks apart, so there none is failed as too slow (grammar_layer.py).
    vocab_size = model.args.vocab_size
    grammar = GrammarLayer(
        lambda: GrammarCompiler(tokenizer, vocab_size, check_stop.eos_token_ids),
        judge_time=getattr(model, "tp_group", None) is None,
    )
    layers.append(grammar, dormant=True)
    if checkpoints is not None:
        layers.append(CheckpointNamer(checkpoints))
    if prefix_store is not None:
        layers.append(DiskConnector(prefix_store, kv_cache, block_manager, stats))
    if metal:  # the layers' own kernels (a draft's pools)
        for layer in layers.check_kernels:
            layer.check_kernels()
    return EngineParts(
        adapters=adapters,
        detokenizer=detokenizers(tokenizer),
        cache_shape=cache_shape,
        state_bytes=state_bytes,
        block_manager=block_manager,
        kv_cache=kv_cache,
        runner=runner,
        scheduler=scheduler,
        check_stop=check_stop,
        stats=stats,
        layers=layers,
        drafter=drafter,
        prefix_store=prefix_store,
        beams=beams,
        prompt_logprobs=prompt_logprobs,
        pooling=pooling,
        grammar=grammar,
        encoder_cache=EncoderCache(),  # a vision model's tower outputs, by image (multimodal.py)
    )
