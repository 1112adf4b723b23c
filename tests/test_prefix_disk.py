"""The prefix cache's disk tier (worker/prefix_store.py): restarts, eviction, faults, the cap,
quantized blocks and the namespace.

References: mlx-lm's own Qwen2 on its contiguous cache (greedy tokens), a run with no disk tier
(the same engine without `prefix_cache_dir`), and the bytes of the pool that wrote the blocks.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from disk_cases import engine, ids, run_flushed

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.testing.slowness import wall
from mlxpaged.worker import prefix_store

from reference import contiguous_generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LOG = "mlxpaged.prefix_store"


def run(e: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY):
    outs = run_flushed(e, prompts, params)
    e.check_invariants()
    return outs


def block_files(store: Path) -> list[Path]:
    return sorted(store.rglob("*" + prefix_store.SUFFIX), key=lambda p: p.stat().st_mtime_ns)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG and r.levelno == logging.WARNING]


@pytest.fixture(scope="module")
def prompt600():
    return ids(0, 600)


@pytest.fixture(scope="module")
def reference600(mlx_lm_tiny, prompt600):
    model, _ = mlx_lm_tiny
    return contiguous_generate(model, prompt600, GREEDY.max_tokens)


# -- the core hook, without MLX ----------------------------------------------------------------------
class DictTier:
    """A second tier in a dict: what a store would hold, by hash (an independent shadow of the disk)."""

    def __init__(self):
        self.blocks: dict[bytes, tuple[int, ...]] = {}
        self.lookups: list[int] = []

    def lookup(self, block_hashes, token_ids) -> int:
        n = 0
        for h, t in zip(block_hashes, token_ids):
            if self.blocks.get(h) != t:
                break
            n += 1
        self.lookups.append(len(block_hashes))
        return n

    def wants(self, block_hash) -> bool:
        return block_hash not in self.blocks


def test_block_manager_takes_second_tier_blocks_after_memory_hits():
    from mlxpaged.core.block_manager import BlockManager
    from mlxpaged.core.sequence import Sequence

    bm, tier = BlockManager(16, 4), DictTier()
    bm.second_tier = tier
    tokens = list(range(100, 122))  # 5 full blocks of 4, then 2 tokens
    a = Sequence(list(tokens), len(tokens))
    assert bm.allocate_slots(a, 22) == [] and bm.match_second_tier(a) == []  # nothing matched: a fresh table
    a.num_computed_tokens = 22
    bm.cache_full_blocks(a)
    written = bm.take_to_store()
    assert [b for _, b, _ in written] == [blk.block_id for blk in a.block_table[:5]]
    tier.blocks = {h: t for h, _, t in written}
    keep = a.block_table[0]
    bm.free(a)
    for _ in range(15):  # evict all but the first block from memory (LRU: the tail went first)
        assert bm.pool.allocate() is not None
    assert bm.pool.num_free == 1 and keep.block_hash is not None
    for block_id in (1, 2, 3):  # three free blocks, no longer cached
        bm.pool.release(bm.pool.blocks[block_id])
    b = Sequence(list(tokens), len(tokens))
    assert bm.match_prefix(b) == 4  # block 0 from memory
    loads = bm.match_second_tier(b)[0]  # group 0's (the only group)
    assert len(loads) == 3 == bm.pool.num_free + 3  # blocks 1-3 from the tier, limited by the free blocks
    assert [h for h, _ in loads] == b.block_hashes[1:4] == [h for h, _, _ in written[1:4]]
    assert [blk.block_id for blk in b.block_table[1:]] == [blk for _, blk in loads]
    assert b.num_computed_tokens == 16 and all(bm.pool.cached[h].block_id == blk for h, blk in loads)
    assert tier.lookups == [4]  # blocks 1..4: never the block holding the last token
    assert bm.take_to_store() == []  # loaded blocks are not written back


def test_a_hit_block_an_answer_filled_goes_to_the_tier_with_the_next_prompt():
    """An agent's next prompt holds its last answer: the block that answer filled was never a
    prompt block, so memory alone holds it; the next prompt hits it there, and the tier takes it
    then, or a restart finds the chain on disk broken at it. A block freed and taken for other
    tokens before the engine reads it is not written under its old hash."""
    from mlxpaged.core.block_manager import BlockManager
    from mlxpaged.core.sequence import Sequence

    bm, tier = BlockManager(16, 4), DictTier()
    bm.second_tier = tier
    prompt = list(range(100, 110))  # blocks 0-1 full, block 2 holds 2 prompt tokens
    a = Sequence(list(prompt), len(prompt))
    bm.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    tier.blocks |= {h: t for h, _, t in bm.take_to_store()}
    assert len(tier.blocks) == 2
    for tok in range(200, 206):  # the answer fills blocks 2 and 3: named in memory, not stored
        a.token_ids.append(tok)
        bm.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        bm.cache_full_blocks(a)
    assert bm.take_to_store() == [] and len(a.block_hashes) == 4
    nxt = a.token_ids + list(range(300, 306))  # the next turn: the whole history, then new tokens
    b = Sequence(list(nxt), len(nxt))
    assert bm.match_prefix(b) == 16
    stored = bm.take_to_store()
    assert [h for h, _, _ in stored] == a.block_hashes[2:4]  # the answer's blocks, the rest was on disk
    bm.allocate_slots(b, len(nxt) - 16)  # b computes the rest of its prompt: block 4 is a prompt block
    b.num_computed_tokens = len(nxt)
    bm.cache_full_blocks(b)
    stored += bm.take_to_store()
    assert len(stored) == 3
    tier.blocks |= {h: t for h, _, t in stored}
    fresh = BlockManager(16, 4)  # a restart: memory empty, the tier as it was
    fresh.second_tier = tier
    c = Sequence(list(nxt), len(nxt))
    assert (
        fresh.match_prefix(c) == 0 and len(fresh.match_second_tier(c)[0]) == 5
    )  # all of b's full blocks but the last token's

    d = Sequence(list(nxt), len(nxt))  # a hit whose block is evicted and reused before the engine reads it
    tier.blocks.clear()
    assert bm.match_prefix(d) == 20 and len(bm.to_store) == 5
    bm.free(d)
    bm.free(b)
    bm.free(a)
    while bm.pool.num_free:
        bm.pool.allocate()
    assert bm.take_to_store() == []


# -- restart ---------------------------------------------------------------------------------------
def test_restart_serves_the_prefix_from_disk(tiny_loaded, tmp_path, prompt600, reference600):
    store = tmp_path / "store"
    first = run(engine(tiny_loaded, store), [prompt600])[0]
    assert first.outputs[0].token_ids == reference600
    assert first.num_cached_tokens == 0
    assert len(block_files(store)) == (600 + 8 - 1) // 16  # every full block computed (the last token is not)
    again = engine(tiny_loaded, store)  # a new pool: nothing in memory
    second = run(again, [prompt600])[0]
    assert second.num_cached_tokens == 592  # all but the block holding the last prompt token
    assert second.outputs[0].token_ids == reference600
    st = again.stats_dict()
    assert st["prefix_cache_disk_hit_tokens"] == 592 and st["prefix_cache_hit_tokens"] == 592
    assert st["prompt_tokens"] == 600 and again.stats.computed_prefill_tokens == 8


def test_restart_keeps_a_conversation_whole(tiny_loaded, mlx_lm_tiny, tmp_path, prompt600):
    """An agent's turns: each prompt is the last prompt, its answer and new text. After a restart
    the next turn finds every full block of the last prompt on disk, the blocks the first answer
    filled included, and gives mlx-lm's tokens."""
    store, params = tmp_path / "store", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    e = engine(tiny_loaded, store)
    first = run(e, [prompt600], params)[0]
    second_prompt = prompt600 + first.outputs[0].token_ids + ids(2, 37)  # 661 tokens
    assert run(e, [second_prompt], params)[0].num_cached_tokens == 608  # memory: the answer's blocks too
    third = second_prompt + ids(3, 20)
    out = run(engine(tiny_loaded, store), [third], params)[0]
    assert out.num_cached_tokens == len(second_prompt) // 16 * 16  # 656; 592 when the chain breaks
    assert out.outputs[0].token_ids == contiguous_generate(mlx_lm_tiny[0], third, 24)


def test_disk_hit_equals_contiguous_reference_on_a_new_question(tiny_loaded, mlx_lm_tiny, tmp_path, prompt600):
    """A shared prefix from disk, then a different suffix: tokens equal mlx-lm's contiguous cache."""
    store = tmp_path / "store"
    run(engine(tiny_loaded, store), [prompt600])
    asked = prompt600 + ids(1, 37)
    e = engine(tiny_loaded, store)
    out = run(e, [asked])[0]
    assert out.num_cached_tokens == 592
    assert out.outputs[0].token_ids == contiguous_generate(mlx_lm_tiny[0], asked, GREEDY.max_tokens)


def test_no_async_scheduling_and_chunked_prefill(tiny_loaded, tmp_path, prompt600, reference600):
    store = tmp_path / "store"
    run(engine(tiny_loaded, store, async_scheduling=False, max_num_batched_tokens=100), [prompt600])
    e = engine(tiny_loaded, store, async_scheduling=False, max_num_batched_tokens=100)
    out = run(e, [prompt600])[0]
    assert out.num_cached_tokens == 592 and out.outputs[0].token_ids == reference600


# -- eviction ----------------------------------------------------------------------------------------
def test_evicted_prefix_comes_back_from_disk(tiny_loaded, tmp_path, prompt600, reference600):
    store = tmp_path / "store"
    e = engine(tiny_loaded, store, num_blocks=38)  # exactly one 600-token request (607 slots): no room to keep it
    other = ids(2, 600)
    out = run(e, [prompt600])
    run(e, [other])  # evicts every block of the first prompt
    assert not any(b.token_ids == tuple(prompt600[:16]) for b in e.block_manager.pool.cached.values())
    out = run(e, [prompt600])[0]
    assert out.outputs[0].token_ids == reference600
    assert out.num_cached_tokens == 592
    assert e.stats_dict()["prefix_cache_disk_hit_tokens"] == 592


# -- faults --------------------------------------------------------------------------------------------
def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _foreign(path: Path) -> None:
    """The file as another namespace wrote it (header's namespace digest differs, all else equal)."""
    data = bytearray(path.read_bytes())
    off = prefix_store._HEADER.size - 64
    data[off : off + 32] = bytes(32)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_flip_byte, _truncate, _foreign], ids=["flipped-byte", "truncated", "foreign"])
def test_bad_file_is_skipped_deleted_and_recomputed(tiny_loaded, tmp_path, prompt600, reference600, damage, caplog):
    store = tmp_path / "store"
    run(engine(tiny_loaded, store), [prompt600])
    e = engine(tiny_loaded, store)
    tenth = e.prefix_store.path_of(_chain_hashes(e, prompt600)[10])
    damage(tenth)
    with caplog.at_level(logging.WARNING, logger=LOG):
        out = run(e, [prompt600])[0]
    assert out.outputs[0].token_ids == reference600
    assert out.num_cached_tokens == 10 * 16  # the blocks before the bad one
    assert len(warnings_of(caplog)) == 1, warnings_of(caplog)
    assert e.prefix_store.stats.bad_files == 1
    assert tenth.exists()  # deleted, then written again from the recomputed block
    assert run(engine(tiny_loaded, store), [prompt600])[0].num_cached_tokens == 592


def _chain_hashes(e: LLMEngine, prompt: list[int]) -> list[bytes]:
    bm, hashes, parent = e.block_manager, [], None
    for i in range(len(prompt) // 16):
        parent = bm.hash_fn(parent, tuple(prompt[i * 16 : (i + 1) * 16]), bm.extra_key)
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["disk-full", "read-only"])
def test_write_failure_turns_the_tier_off(tiny_loaded, tmp_path, prompt600, reference600, code, monkeypatch, caplog):
    def fail(path, data):
        raise OSError(code, os.strerror(code))

    e = engine(tiny_loaded, tmp_path / "store")
    monkeypatch.setattr(prefix_store, "_atomic_write", fail)  # every block write from now on
    with caplog.at_level(logging.WARNING, logger=LOG):
        outs = run(e, [prompt600, ids(3, 300)])
        outs += run(e, [prompt600])
    assert outs[0].outputs[0].token_ids == reference600 == outs[2].outputs[0].token_ids
    assert len(warnings_of(caplog)) == 1 and os.strerror(code) in warnings_of(caplog)[0]
    assert not e.prefix_store.enabled and block_files(tmp_path / "store") == []
    assert e.prefix_store.stats.written_blocks == 0


def test_unusable_directory_warns_once_and_serves(tiny_loaded, tmp_path, prompt600, reference600, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger=LOG):
        e = engine(tiny_loaded, blocker / "store")
        out = run(e, [prompt600])[0]
    assert out.outputs[0].token_ids == reference600
    assert len(warnings_of(caplog)) == 1 and not e.prefix_store.enabled


# -- the cap ---------------------------------------------------------------------------------------------
def test_cap_holds_and_evicts_least_recently_used(tiny_loaded, tmp_path, monkeypatch):
    """The cap counts block files. `kept` is read by a second engine each round, as another process
    would: with RESCAN_S = 0 the writer rescans the directory before each eviction and sees its touches."""
    monkeypatch.setattr(prefix_store, "RESCAN_S", 0.0)
    store = tmp_path / "store"
    probe = engine(tiny_loaded, store, num_blocks=64)
    file_bytes = probe.prefix_store.file_nbytes
    cap_blocks = 25
    gb = cap_blocks * file_bytes / 1e9
    e = engine(tiny_loaded, store, num_blocks=64, prefix_cache_disk_gb=gb)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    kept = ids(9, 40)  # read back often: least recently used never
    run(e, [kept], params)
    for start in range(0, 200, 10):
        run(e, [ids(1000 + i, 40) for i in range(start, start + 10)], params)
        reader = engine(tiny_loaded, store, num_blocks=64, prefix_cache_disk_gb=gb)
        assert run(reader, [kept], params)[0].num_cached_tokens == 32  # a disk hit, which touches its files
        on_disk = sum(p.stat().st_size for p in store.rglob("*") if p.is_file() and p.suffix == ".kvb")
        assert on_disk <= gb * 1e9, (start, on_disk)
    assert e.prefix_store.stats.evicted_blocks > 0
    last = engine(tiny_loaded, store, num_blocks=64, prefix_cache_disk_gb=gb)
    assert run(last, [kept], params)[0].num_cached_tokens == 32  # survived 200 prompts' worth of writes
    assert run(last, [ids(1000, 40)], params)[0].num_cached_tokens == 0  # the first prompt's blocks went first


# -- quantized blocks ---------------------------------------------------------------------------------------
def test_quantized_blocks_round_trip(tiny_loaded, tmp_path, prompt600):
    store = tmp_path / "store"
    a = engine(tiny_loaded, store, kv_bits=8, kv_group_size=32)
    first = run(a, [prompt600])[0]
    b = engine(tiny_loaded, store, kv_bits=8, kv_group_size=32)
    second = run(b, [prompt600])[0]
    assert second.num_cached_tokens == 592 and second.outputs[0].token_ids == first.outputs[0].token_ids
    assert len(a.kv_cache.arrays) == 3 * 2 * tiny_loaded.model.args.num_hidden_layers  # codes, scales, biases
    for h in _chain_hashes(a, prompt600)[:37]:
        ba, bb = a.block_manager.pool.cached[h].block_id, b.block_manager.pool.cached[h].block_id
        for xa, xb in zip(a.kv_cache.arrays, b.kv_cache.arrays):
            assert np.array_equal(np.array(xa[ba]), np.array(xb[bb]))


# -- the namespace -----------------------------------------------------------------------------------------------
def test_a_store_of_other_weights_is_never_read(tmp_path, prompt600, caplog):
    """Two checkpoints at the same path (so the same block hashes) that differ in one weight."""
    import mlx_lm

    from mlxpaged.loading.loader import load
    from mlxpaged.testing.tiny_model import write_tiny_qwen2

    ckpt, store = tmp_path / "ckpt", tmp_path / "store"
    write_tiny_qwen2(ckpt)
    first = engine(load(str(ckpt), "float32"), store)
    run(first, [prompt600])
    weights = mx.load(str(ckpt / "model.safetensors"))
    w = np.array(weights["model.layers.1.self_attn.v_proj.weight"])
    w[3, 5] += 0.5
    weights["model.layers.1.self_attn.v_proj.weight"] = mx.array(w)
    mx.save_safetensors(str(ckpt / "model.safetensors"), weights, metadata={"format": "mlx"})
    other = load(str(ckpt), "float32")
    e = engine(other, store)
    hashes = _chain_hashes(e, prompt600)
    assert hashes == _chain_hashes(first, prompt600)  # same block hashes: only the namespace keeps them apart
    assert first.prefix_store.path_of(hashes[0]).exists() and not e.prefix_store.path_of(hashes[0]).exists()
    with caplog.at_level(logging.WARNING, logger=LOG):
        out = run(e, [prompt600])[0]
    assert out.num_cached_tokens == 0 and warnings_of(caplog) == []
    assert out.outputs[0].token_ids == contiguous_generate(mlx_lm.load(str(ckpt))[0], prompt600, GREEDY.max_tokens)
    assert len([d for d in store.iterdir() if d.is_dir()]) == 2  # two namespaces side by side


def test_namespace_names_every_setting(tiny_loaded, tmp_path):
    digests = set()
    for kw in [{}, {"block_size": 32}, {"kv_bits": 8}, {"kv_bits": 8, "kv_group_size": 32}, {"kv_bits": 4}]:
        e = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=8, **kw))
        for rank, world in [(0, 1), (0, 2), (1, 2)]:
            digests.add(
                prefix_store.namespace(prefix_store.namespace_parts(tiny_loaded, e.kv_cache, rank=rank, world=world))
            )
    assert len(digests) == 15


# -- cost control ----------------------------------------------------------------------------------------------------
def test_reads_slower_than_recomputing_are_not_used(tiny_loaded, tmp_path, prompt600, reference600):
    store = tmp_path / "store"
    run(engine(tiny_loaded, store), [prompt600])
    e = engine(tiny_loaded, store)
    s = e.prefix_store
    s._read_s_per_block, s.recompute_s_per_token = 1.0, 1e-9  # as if the disk were slower than the model
    e.stats.prefill_time = 0.0  # keep the engine from overwriting the estimate before the lookup
    out = run(e, [prompt600])[0]
    assert out.num_cached_tokens == 0 and s.stats.skipped_slow == 1 and out.outputs[0].token_ids == reference600


# -- settings and the CLI ----------------------------------------------------------------------------------------------
def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig.of(prefix_cache_dir="/tmp/x", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix_cache_disk_gb"):
        EngineConfig.of(prefix_cache_dir="/tmp/x", prefix_cache_disk_gb=0)
    with pytest.raises(ValueError, match="needs prefix_cache_dir"):
        EngineConfig.of(prefix_cache_disk_gb=1.0)


def test_generate_cli_reuses_the_prefix_across_runs(tiny_model_path, tmp_path, prompt600):
    import json

    prompt = " ".join(["The KV cache stores the keys and values of every token a sequence has seen."] * 20)
    cmd = [
        sys.executable,
        "-m",
        "mlxpaged.cli",
        "generate",
        "--model",
        str(tiny_model_path),
        "--dtype",
        "float32",
        "--prompt",
        prompt,
        "--no-chat",
        "--max-tokens",
        "4",
        "--json",
        "--prefix-cache-dir",
        str(tmp_path / "store"),
    ]
    runs = [json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout) for _ in range(2)]
    first, second = (r["outputs"][0] for r in runs)
    assert first["num_cached_tokens"] == 0 and second["num_cached_tokens"] > 0
    assert second["token_ids"] == first["token_ids"]
    assert runs[1]["stats"]["prefix_cache_disk_hit_tokens"] == second["num_cached_tokens"]


# -- a server restart over HTTP ----------------------------------------------------------------------------------------
@pytest.mark.server
def test_server_restart_reports_cached_tokens(tiny_model_path, tiny_loaded, tmp_path, prompt600, reference600):
    """`mlxpaged serve` stopped (Ctrl-C) and started again on the same DIR: the same 600-token
    prompt is served from disk, with the first run's (and mlx-lm's) greedy tokens."""
    from server_proc import Server

    def serve_once() -> tuple[list[int], int, dict]:
        s = Server(tiny_model_path, "--num-blocks", "64", "--prefix-cache-dir", str(tmp_path / "store"))
        try:
            r = s.client().completions.create(
                model=str(tiny_model_path),
                prompt=prompt600,
                max_tokens=8,
                temperature=0.0,
                extra_body={"ignore_eos": True},
                logprobs=0,
            )
            metrics = s.metrics()
        finally:
            code, err = s.interrupt()
        assert code == 0, err
        assert "prefix_store" not in err, err  # no warning
        return (r.choices[0].text, r.choices[0].logprobs.tokens), r.usage.prompt_tokens_details.cached_tokens, metrics

    text1, cached1, m1 = serve_once()
    text2, cached2, m2 = serve_once()
    assert cached1 == 0 and cached2 >= 592
    assert text2 == text1 and text1[0] == tiny_loaded.tokenizer.decode(reference600)
    assert m2['mlxpaged_prefix_cache_hit_tokens_total{tier="disk"}'] == cached2
    assert m2['mlxpaged_prefix_cache_hit_tokens_total{tier="memory"}'] == 0


# -- tensor parallelism ------------------------------------------------------------------------------------------------
@pytest.mark.tp
def test_tensor_parallel_ranks_keep_their_own_shards(tiny_model_path, tiny_loaded, tmp_path):
    """Two ranks (mlx.launch, ring backend), launched twice on one DIR: each rank has its own
    namespace; after rank 1 loses some files, both ranks use only the blocks both have."""
    import json

    import tp_prefix_worker as w

    from launch import _ring_can_start, ring_command

    why = _ring_can_start()
    if why is not None:
        pytest.skip(why)
    store = tmp_path / "store"

    def launch_once(tag: str) -> list[dict]:
        r = subprocess.run(
            [
                *ring_command(),
                w.__file__,
                "--model",
                str(tiny_model_path),
                "--store",
                str(store),
                "--out",
                str(tmp_path / tag),
            ],
            capture_output=True,
            text=True,
            timeout=wall(300),
        )
        files = [tmp_path / f"{tag}{rank}.json" for rank in range(2)]
        assert all(f.exists() for f in files), r.stdout + r.stderr
        return [json.loads(f.read_text()) for f in files]

    ref = run(LLMEngine(tiny_loaded, EngineConfig.of(block_size=w.BLOCK_SIZE, num_blocks=64)), [w.PROMPT])[0]
    first = launch_once("first")
    assert [r["cached"] for r in first] == [0, 0]
    assert first[0]["namespace_dir"] != first[1]["namespace_dir"]
    second = launch_once("second")
    assert [r["cached"] for r in second] == [36, 36] and [r["local_hit_blocks"] for r in second] == [9, 9]
    # Rank 1 loses its blocks from the fourth on: rank 0 still reads 9, but both use 3.
    rank1 = Path(second[1]["namespace_dir"])
    for h in _chain_hashes_bs(tiny_loaded, w.PROMPT, w.BLOCK_SIZE)[3:]:
        (rank1 / h.hex()[:2] / (h.hex() + prefix_store.SUFFIX)).unlink()
    third = launch_once("third")
    assert [r["cached"] for r in third] == [12, 12] and [r["local_hit_blocks"] for r in third] == [9, 3]
    for r in first + second + third:
        assert r["tokens"] == ref.outputs[0].token_ids


def _chain_hashes_bs(loaded, prompt: list[int], bs: int) -> list[bytes]:
    from mlxpaged.core.block_manager import sha256_block_hash

    hashes, parent = [], None
    for i in range(len(prompt) // bs):
        parent = sha256_block_hash(parent, tuple(prompt[i * bs : (i + 1) * bs]), loaded.identity)
        hashes.append(parent)
    return hashes


# -- the real-model tier -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real():
    import mlx_lm

    from mlxpaged.loading.gguf import convert_gguf
    from mlxpaged.loading.loader import load
    from mlxpaged.loading.offline_model import ensure_offline_model

    path = convert_gguf(ensure_offline_model())
    loaded = load(str(path), "float32")
    ref, _ = mlx_lm.load(str(path))
    ref.set_dtype(mx.float32)
    return loaded, ref


def test_real_model_restart_from_disk(real, tmp_path):
    """Qwen2.5-Coder-0.5B (float32): a 600-token prompt after a restart comes from disk, with
    mlx-lm's contiguous greedy tokens both times."""
    from mlxpaged.bench.prefix_disk import prompt_ids

    loaded, ref = real
    prefix, question = prompt_ids(loaded.tokenizer, loaded.model.args.vocab_size, 580, 20, 0)
    prompt = prefix + question
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = run(engine(loaded, tmp_path / "store", num_blocks=64), [prompt], params)[0]
    again = engine(loaded, tmp_path / "store", num_blocks=64)
    second = run(again, [prompt], params)[0]
    want = contiguous_generate(ref, prompt, 16)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 592
    assert first.outputs[0].token_ids == want and second.outputs[0].token_ids == want
    assert again.stats.computed_prefill_tokens == 8


def test_two_processes_on_one_dir(tiny_model_path, tiny_loaded, mlx_lm_tiny, tmp_path, caplog):
    """Two `generate` processes write the same blocks into one DIR at the same time (write-then-
    rename, no lock): a third engine then reads every block, with no bad file."""
    import json

    text = " ".join(["Paged attention borrows an idea from operating systems: virtual memory and paging."] * 30)
    prompt = tiny_loaded.tokenizer.encode(text)
    want = contiguous_generate(mlx_lm_tiny[0], prompt, 8)
    store = tmp_path / "store"
    cmd = [
        sys.executable,
        "-m",
        "mlxpaged.cli",
        "generate",
        "--model",
        str(tiny_model_path),
        "--dtype",
        "float32",
        "--prompt",
        text,
        "--no-chat",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--json",
        "--prefix-cache-dir",
        str(store),
    ]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=wall(300)) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert json.loads(out)["outputs"][0]["token_ids"] == want
    assert not list(store.rglob("*.tmp"))
    e = engine(tiny_loaded, store)
    with caplog.at_level(logging.WARNING, logger=LOG):
        out = run(e, [prompt])[0]
    assert out.num_cached_tokens == (len(prompt) - 1) // 16 * 16 and out.outputs[0].token_ids == want
    assert warnings_of(caplog) == [] and e.prefix_store.stats.bad_files == 0
