"""KV cache groups as one mechanism (core/kv_groups.py): the chunked-local kind (Llama 4) frees a
chunk's blocks once the next chunk starts, checked against positions counted one by one and
against mlx-lm's own Llama 4 on its own caches (a ChunkedKVCache on each chunked layer); a kind
the registry does not know is refused by name.
"""

from __future__ import annotations

import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.core.block_manager import BlockManager
from mlxpaged.core.kv_groups import GroupSpec
from mlxpaged.core.sequence import Sequence
from mlxpaged.loading.loader import load
from mlxpaged.testing.tiny_model import write_tiny_family

from drive import run_all
from reference import contiguous_generate

LONG = (
    "Paged attention borrows an idea from operating systems: virtual memory and paging. "
    "Copy-on-write lets many samples share the blocks of one prompt until they diverge."
)


def read_blocks(num_tokens: int, chunk: int, block_size: int, num_blocks: int) -> set[int]:
    """Blocks holding a position that some token at `num_tokens` or later reads (its own chunk
    up to itself), counted position by position over the next chunks."""
    read = {q for p in range(num_tokens, num_tokens + 3 * chunk) for q in range(p - p % chunk, p + 1)}
    return {i for i in range(num_blocks) if read & set(range(i * block_size, (i + 1) * block_size))}


@pytest.mark.parametrize("chunk", [1, 3, 4, 6, 9, 16])
def test_chunked_group_releases_exactly_the_blocks_no_later_token_reads(chunk):
    bm = BlockManager(64, 4, groups=[GroupSpec("full"), GroupSpec("chunked_local", chunk)])
    s = Sequence(list(range(100)), 100)
    for n in (1, 3, 5, 8, 2, 11, 1, 1, 7):  # prefill chunks and decodes across block and chunk boundaries
        assert bm.allocate_slots(s, n) is not None
        s.num_computed_tokens += n
        bm.allocate_slots(s, 0)  # releases what no later token reads, takes nothing
        held = {i for i, b in enumerate(s.tables[1]) if b is not None}
        assert held == read_blocks(s.num_computed_tokens, chunk, 4, len(s.block_table)), (chunk, n)
        assert len(s.block_table) == len(s.tables[1]) and None not in s.block_table
        bm.check([s])
    bm.free(s)
    bm.trim_groups()
    assert bm.groups[1].pool.num_used == 0 == bm.pool.num_used


def test_an_unknown_kind_of_group_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown KV cache group kind 'paged_lru'"):
        BlockManager(8, 4, groups=[GroupSpec("full"), GroupSpec("paged_lru", 4)])
    with pytest.raises(ValueError, match="group 0 must be full attention"):
        BlockManager(8, 4, groups=[GroupSpec("sliding_window", 4)])


@pytest.mark.parametrize("chunk", [4, 9])
def test_llama4_chunked_layers_hold_a_chunk_and_a_block_and_give_mlx_lm_tokens(tmp_path, chunk):
    """Two Llama 4 requests at once, prompts several chunks long, prefilled in pieces of 8: each
    sequence's chunked group holds at most a chunk plus a block while it decodes (a chunk plus a
    prefill piece while it prefills; mlx-lm's ChunkedKVCache keeps a chunk), the full group
    everything, and the tokens are mlx-lm's on its own caches. A second run of the first prompt
    takes its cached blocks."""
    import mlx_lm

    path = write_tiny_family(tmp_path / "l4", "llama4", attention_chunk_size=chunk)
    loaded, (ref_model, tok) = load(str(path), "float32"), mlx_lm.load(str(path))
    engine = LLMEngine(
        loaded, EngineConfig.of(block_size=4, num_blocks=96, max_num_batched_tokens=8, attention_impl="reference")
    )
    assert [g.kind for g in engine.block_manager.groups] == ["full", "chunked_local"]
    prompts = [tok.encode(LONG), tok.encode(LONG[40:])]
    assert min(len(p) for p in prompts) > 4 * chunk
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rids = [engine.add_request(p, greedy) for p in prompts]
    done, decode_peak, peak = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
        for s in engine.live_sequences():
            held = sum(b is not None for b in s.tables[1])
            peak = max(peak, held)
            if s.num_computed_tokens >= s.num_prompt_tokens:  # decoding
                decode_peak = max(decode_peak, held)
    assert 0 < decode_peak <= -(-chunk // 4) + 1
    assert peak <= -(-(chunk + 8) // 4) + 1
    assert engine.stats.blocks_in_use_peak >= sum(len(p) for p in prompts) // 4  # the full group keeps all
    for rid, p in zip(rids, prompts):
        assert list(done[rid].outputs[0].token_ids) == contiguous_generate(ref_model, p, 16)
    rid = engine.add_request(prompts[0], greedy)
    again = run_all(engine)[rid]
    assert again.num_cached_tokens >= len(prompts[0]) - 4
    assert list(again.outputs[0].token_ids) == contiguous_generate(ref_model, prompts[0], 16)
