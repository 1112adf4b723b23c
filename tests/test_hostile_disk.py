"""The prefix cache's disk tier under careless neighbours: a shared
DIR, weights replaced in place with the same size and mtime, and a store that would grow unbounded.

References: a listing of DIR made by the test (what it put there), a run with no disk tier (the
same engine without `prefix_cache_dir`), and the prompt's block count.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

from disk_cases import engine, ids, run_flushed

from mlxpaged import LLMEngine, SamplingParams
from mlxpaged.loading.loader import load
from mlxpaged.testing.tiny_model import write_tiny_qwen2
from mlxpaged.worker import prefix_store

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BLOCK = 16


def run(e: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return run_flushed(e, prompts, params)


def block_files(store: Path) -> list[Path]:
    return sorted(store.rglob("*" + prefix_store.SUFFIX))


# -- 11: the tier touches only its own names ------------------------------------------------------------
def test_foreign_files_in_dir_are_never_deleted_nor_evicted(tiny_loaded, tmp_path):
    store = tmp_path / "store"
    probe = engine(tiny_loaded, store)
    ns_dir, file_bytes = probe.prefix_store.dir, probe.prefix_store.file_nbytes
    hx = "ab" * 32
    own_tmp = ns_dir / "ab" / f".{hx}.kvb.123.456.tmp"  # a killed writer's leftover: ours to clean up
    foreign = [
        store / "notes.tmp",
        store / "backup.kvb",
        store / "other" / "cache.kvb",
        store / "other" / "job.tmp",
        ns_dir / "README.tmp",
        ns_dir / "ab" / "mine.kvb",
        ns_dir / "ab" / f"{hx}.kvb.bak",
    ]
    for p in [*foreign, own_tmp]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * file_bytes)
        os.utime(p, (time.time() - 3600, time.time() - 3600))  # old: first in line for the LRU and the cleanup
    cap_blocks = 6
    e = engine(tiny_loaded, store, prefix_cache_disk_gb=cap_blocks * file_bytes / 1e9)
    assert not own_tmp.exists()
    run(e, [ids(100 + i, 3 * BLOCK + 1) for i in range(6)])  # 18 blocks through a cap of 6
    assert e.prefix_store.stats.evicted_blocks >= 12
    assert all(p.exists() for p in foreign), [p for p in foreign if not p.exists()]
    assert (
        len(set(block_files(ns_dir)) - set(foreign)) == cap_blocks
    )  # its own files held to the cap, the rest uncounted


# -- 12: weights replaced in place with the same size and mtime ----------------------------------------------
def test_weights_digest_memo_is_written_at_the_first_start(tiny_loaded, tmp_path):
    store = tmp_path / "store"
    engine(tiny_loaded, store)
    memo = store / "weights-digests.json"
    assert memo.is_file() and str((Path(tiny_loaded.path) / "model.safetensors").resolve()) in memo.read_text()


def test_weights_swapped_with_same_size_and_mtime_never_read_old_blocks(tmp_path):
    ckpt, other, store = tmp_path / "ckpt", tmp_path / "other", tmp_path / "store"
    write_tiny_qwen2(ckpt, seed=0)
    write_tiny_qwen2(other, seed=1)
    prompt = ids(0, 10 * BLOCK + 3)
    for _ in range(2):  # the second start finds its digests remembered
        run(engine(load(str(ckpt), "float32"), store), [prompt])
    w = ckpt / "model.safetensors"
    st = w.stat()
    shutil.copyfile(other / "model.safetensors", w)  # `cp -p`: other bytes, the same size and mtime
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert w.stat().st_size == st.st_size and w.stat().st_mtime_ns == st.st_mtime_ns
    swapped = load(str(ckpt), "float32")
    out = run(engine(swapped, store), [prompt])[0]
    ref = run(engine(swapped, None), [prompt])[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


# -- 14: a cap by default, and prompt blocks only ----------------------------------------------------------
def test_only_prompt_blocks_are_written(tiny_loaded, tmp_path):
    store = tmp_path / "store"
    e = engine(tiny_loaded, store)
    params = SamplingParams(temperature=1.0, max_tokens=5 * BLOCK, ignore_eos=True, n=4, seed=3)
    prompt = ids(7, 2 * BLOCK + 5)
    run(e, [prompt], params)
    assert e.prefix_store.stats.written_blocks == len(block_files(store)) == len(prompt) // BLOCK
    again = engine(tiny_loaded, store)
    assert run(again, [prompt])[0].num_cached_tokens == 2 * BLOCK  # the prompt still comes back from disk


def test_a_store_without_a_cap_is_bounded_by_default(tiny_loaded, tmp_path, monkeypatch):
    store = tmp_path / "store"
    file_bytes = engine(tiny_loaded, tmp_path / "probe").prefix_store.file_nbytes
    monkeypatch.setattr(prefix_store, "DEFAULT_CAP_BYTES", 5 * file_bytes, raising=False)
    e = engine(tiny_loaded, store)  # no prefix_cache_disk_gb
    run(e, [ids(200 + i, 2 * BLOCK + 1) for i in range(8)])  # 16 prompt blocks
    assert len(block_files(store)) == 5
    # a nearly full disk: a quarter of its free space, if that is less
    free = 3 * file_bytes * 4 + 1
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(total=10 * free, used=9 * free, free=free))
    e = engine(tiny_loaded, tmp_path / "small")
    run(e, [ids(300 + i, 2 * BLOCK + 1) for i in range(4)])
    assert len(block_files(tmp_path / "small")) == 3


# -- 13: a salted prompt's blocks on disk are found only with its salt ---------------------------------------
def test_salted_blocks_come_back_from_disk_only_with_the_salt(tiny_loaded, tmp_path):
    store, prompt = tmp_path / "store", ids(11, 4 * BLOCK + 2)
    salted = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, cache_salt="client-a")
    run(engine(tiny_loaded, store), [prompt], salted)
    assert run(engine(tiny_loaded, store), [prompt])[0].num_cached_tokens == 0  # a restart, unsalted
    other = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, cache_salt="client-b")
    assert run(engine(tiny_loaded, store), [prompt], other)[0].num_cached_tokens == 0
    assert run(engine(tiny_loaded, store), [prompt], salted)[0].num_cached_tokens == 4 * BLOCK
