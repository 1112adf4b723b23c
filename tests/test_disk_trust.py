"""What the prefix cache's disk tier trusts: only regular files of its own user, private to that
user, and state checkpoints that pass a checksum and match the model's state array by array.

References: mlx-lm's own models on their contiguous caches (greedy tokens), `os.stat` modes, a
child process run as another user (`nobody`, when the tests run as root), and the block hash
chain recomputed from the prompt.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import zlib
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.loading.loader import load
from mlxpaged.testing.tiny_model import write_tiny_family
from mlxpaged.worker import prefix_store

from reference import contiguous_generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
NOBODY = 65534


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 380, n).tolist()


def run(e: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY):
    rid = e.add_request(prompt, params)
    done = {}
    while e.has_unfinished_requests():
        done.update({o.request_id: o for o in e.step() if o.finished})
    if e.prefix_store is not None:
        e.prefix_store.flush()
    return done[rid]


def chain(e: LLMEngine, prompt: list[int]) -> list[bytes]:
    """The prompt's block hashes, as the block manager chains them."""
    bm, bs, hashes, parent = e.block_manager, e.block_manager.block_size, [], None
    for i in range(len(prompt) // bs):
        parent = bm.hash_fn(parent, tuple(prompt[i * bs : (i + 1) * bs]), bm.extra_key)
        hashes.append(parent)
    return hashes


def warnings_of(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.WARNING]


class FifoWatch:
    """Frees a reader blocked on the FIFO at `path` (by opening its write end, so the reader sees
    end of file) and records that it had to: a tier that opens without blocking is never caught."""

    def __init__(self, path: Path, after_s: float = 3.0):
        self.path, self.after_s, self.freed = path, after_s, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        if self._stop.wait(self.after_s):
            return
        while not self._stop.wait(0.2):
            try:
                if not stat.S_ISFIFO(os.lstat(self.path).st_mode):
                    return  # deleted or replaced: nothing can block on it any more
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO unless a reader waits
            except OSError:
                continue
            self.freed = True
            os.close(fd)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# -- block files ---------------------------------------------------------------------------------------
def _fifo(path: Path, tmp: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _symlink(path: Path, tmp: Path) -> None:
    """The block's own valid bytes, through a symlink (as if the link pointed anywhere)."""
    target = tmp / "elsewhere.kvb"
    path.rename(target)
    path.symlink_to(target)


def _other_user(path: Path, tmp: Path) -> None:
    """The block's own valid bytes, in a file another user owns."""
    if os.geteuid() != 0:
        pytest.skip("[expected] giving a file to another user needs root")
    os.chown(path, NOBODY, NOBODY)


@pytest.mark.parametrize("plant", [_fifo, _symlink, _other_user], ids=["fifo", "symlink", "other-user"])
def test_a_block_path_that_is_not_our_regular_file_is_deleted_and_recomputed(
    tiny_loaded, mlx_lm_tiny, tmp_path, plant, caplog
):
    """A FIFO at a block path once blocked the engine in `open()` for good; a symlink or another
    user's file was read as a block. Each is now skipped without blocking, deleted with one
    warning, and the block recomputed (and written again as a regular file): mlx-lm's tokens."""
    store, prompt = tmp_path / "store", ids(0, 200)
    want = contiguous_generate(mlx_lm_tiny[0], prompt, GREEDY.max_tokens)
    cfg = EngineConfig.of(num_blocks=64, prefix_cache_dir=str(store))
    assert run(LLMEngine(tiny_loaded, cfg), prompt).outputs[0].token_ids == want
    e = LLMEngine(tiny_loaded, cfg)
    path = e.prefix_store.path_of(chain(e, prompt)[5])
    plant(path, tmp_path)
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="mlxpaged.prefix_store"), FifoWatch(path) as watch:
        out = run(e, prompt)
    took = time.perf_counter() - t0
    assert not watch.freed, f"the engine blocked in open() on a FIFO ({took:.1f} s until the test freed it)"
    assert out.outputs[0].token_ids == want
    assert out.num_cached_tokens == 5 * 16  # the blocks before the planted one
    said = warnings_of(caplog, "mlxpaged.prefix_store")
    assert len(said) == 1 and path.name in said[0], said
    st = os.lstat(path)  # written again from the recomputed block
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600


def test_the_weights_digest_memo_is_not_read_through_a_fifo(tiny_loaded, tmp_path):
    """DIR's digest memo is read at every start: a FIFO there is passed over, not waited on."""
    store = tmp_path / "store"
    store.mkdir()
    os.mkfifo(store / "weights-digests.json")
    with FifoWatch(store / "weights-digests.json", after_s=1.0) as watch:
        e = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=16, prefix_cache_dir=str(store)))
    assert not watch.freed and e.prefix_store.enabled


# -- file modes -----------------------------------------------------------------------------------------
@pytest.fixture
def open_dir():
    """A folder every user may enter (pytest's own temporary folders are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="mlxpaged-disk-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o277], ids=["umask-022", "umask-000", "umask-277"])
def test_files_are_0600_in_0700_folders(tiny_loaded, open_dir, umask):
    """Block files hold their token ids in plain int64: with the usual umask they were 0644 in
    0755 folders, and another local user read prompts back from them."""
    store = open_dir / "a" / "store"  # two folders to make
    old = os.umask(umask)
    try:
        run(LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=64, prefix_cache_dir=str(store))), ids(1, 100))
    finally:
        os.umask(old)
    modes = {str(p.relative_to(open_dir)): oct(stat.S_IMODE(os.lstat(p).st_mode)) for p in open_dir.rglob("*")}
    blocks = list(store.rglob("*" + prefix_store.SUFFIX))
    assert len(blocks) == 6 and (store / "weights-digests.json").exists(), modes
    assert len(modes) == 5 + len(blocks) + len({b.parent for b in blocks}), modes  # a, store, memo, namespace + json
    for p in open_dir.rglob("*"):
        assert stat.S_IMODE(os.lstat(p).st_mode) == (0o700 if p.is_dir() else 0o600), modes
    if os.geteuid() == 0:  # the reproducer itself: another user reads a block's token ids
        r = subprocess.run(["cat", str(blocks[0])], user=NOBODY, capture_output=True)
        assert r.returncode != 0 and b"Permission denied" in r.stderr, r.stderr


def test_an_older_store_is_made_private(tiny_loaded, tmp_path):
    """A store written 0644 in 0755 folders (as before) is tightened when an engine opens it, and
    its blocks are still read."""
    store, prompt = tmp_path / "store", ids(2, 100)
    cfg = EngineConfig.of(num_blocks=64, prefix_cache_dir=str(store))
    run(LLMEngine(tiny_loaded, cfg), prompt)
    for p in store.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    e = LLMEngine(tiny_loaded, cfg)
    assert run(e, prompt).num_cached_tokens == 96
    ns = e.prefix_store.dir
    for p in [ns, *ns.rglob("*")]:
        if p.is_dir() or p.suffix == prefix_store.SUFFIX:
            assert stat.S_IMODE(os.lstat(p).st_mode) == (0o700 if p.is_dir() else 0o600), p


@pytest.mark.parametrize("kind", ["symlink", "other-user"])
def test_a_namespace_folder_not_our_own_turns_the_tier_off(tiny_loaded, mlx_lm_tiny, tmp_path, kind, caplog):
    """A symlink (to a folder anyone may write) or another user's folder where the tier's
    namespace folder goes: it is neither written to nor read; one warning, and serving goes on."""
    store, prompt = tmp_path / "store", ids(3, 60)
    probe = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=32, prefix_cache_dir=str(store)))
    ns = probe.prefix_store.dir
    shutil.rmtree(ns)
    theirs = tmp_path / "theirs" if kind == "symlink" else ns
    theirs.mkdir()
    theirs.chmod(0o777)
    if kind == "symlink":
        ns.symlink_to(theirs)
    elif os.geteuid() == 0:
        os.chown(ns, NOBODY, NOBODY)
    else:
        pytest.skip("[expected] giving a folder to another user needs root")
    with caplog.at_level(logging.WARNING, logger="mlxpaged.prefix_store"):
        e = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=32, prefix_cache_dir=str(store)))
        out = run(e, prompt)
    assert not e.prefix_store.enabled and list(theirs.iterdir()) == []
    said = warnings_of(caplog, "mlxpaged.prefix_store")
    assert len(said) == 1 and ("symlink" if kind == "symlink" else "another user") in said[0], said
    assert out.outputs[0].token_ids == contiguous_generate(mlx_lm_tiny[0], prompt, GREEDY.max_tokens)


# -- a hybrid model's state checkpoints --------------------------------------------------------------------
@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = write_tiny_family(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")
    ref_model, tok = mlx_lm.load(str(path))
    return load(str(path), "float32"), ref_model


def _hybrid_engine(loaded, store: Path, **kw) -> LLMEngine:
    return LLMEngine(
        loaded,
        EngineConfig.of(block_size=4, num_blocks=96, attention_impl="reference", prefix_cache_dir=str(store), **kw),
    )


def _rewrite(path: Path, change) -> None:
    """The file's arrays passed through `change`, under its own metadata; a `crc32` there is set
    to the new tensor data's CRC-32 (found from mlx's own serialization), so only the arrays differ."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    arrays = {k: change(v) for k, v in arrays.items()}
    if "crc32" in meta:
        buf = io.BytesIO()
        mx.save_safetensors(buf, arrays, metadata=meta)
        blob = buf.getvalue()
        meta = {**meta, "crc32": f"{zlib.crc32(blob[8 + int.from_bytes(blob[:8], 'little') :]):08x}"}
    mx.save_safetensors(str(path), arrays, metadata=meta)


def _values(path: Path, tmp: Path) -> None:
    """Right names and shapes, other values, the checksum left as it was."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    mx.save_safetensors(str(path), {k: v * 3 + 1 for k, v in arrays.items()}, metadata=meta)


def _shapes(path: Path, tmp: Path) -> None:
    """One sequence's arrays one column short, under a checksum that matches them."""
    _rewrite(path, lambda a: a[..., :-1])


def _state_fifo(path: Path, tmp: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize("damage", [_values, _shapes, _state_fifo], ids=["wrong-values", "wrong-shapes", "fifo"])
def test_a_bad_state_checkpoint_is_deleted_and_recomputed(hybrid, tmp_path, damage, caplog):
    """The state after the last block a restart would hit is damaged. Before, wrong values were
    taken (the greedy answer changed) and wrong inner shapes failed every request with this
    prefix; now the file is deleted with one warning, the hit ends a block earlier, and the
    tokens are mlx-lm's."""
    loaded, ref_model = hybrid
    store, prompt = tmp_path / "store", ids(4, 41)
    want = contiguous_generate(ref_model, prompt, 12)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    run(_hybrid_engine(loaded, store, max_num_batched_tokens=8), prompt, params)  # a state every 2 blocks
    e = _hybrid_engine(loaded, store)
    states = e.prefix_store.dir / "states"
    last = states / (chain(e, prompt)[9].hex() + ".safetensors")  # after block 10: a restart's whole hit
    assert last.exists() and len(list(states.iterdir())) == 5
    damage(last, tmp_path)
    with caplog.at_level(logging.WARNING, logger="mlxpaged.state_cache"):
        out = run(e, prompt, params)
    assert out.outputs[0].token_ids == want
    assert out.num_cached_tokens == 8 * 4  # the hit ends at the state before instead, after block 8
    said = warnings_of(caplog, "mlxpaged.state_cache")
    assert len(said) == 1 and last.name in said[0], said
    assert e.runner.checkpoints.bad_files == 1
    again = _hybrid_engine(loaded, store)  # the recomputed state was written back: a whole hit again
    assert run(again, prompt, params).num_cached_tokens == 10 * 4


def test_state_checkpoints_are_private_and_checked_whole(hybrid, tmp_path):
    """State files are 0600 in a 0700 folder; each holds the model's state array by array (the
    shapes and dtypes mlx-lm's own cache has after a token) and a CRC-32 of its tensor data."""
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    loaded, ref_model = hybrid
    store = tmp_path / "store"
    old = os.umask(0o022)
    try:
        e = _hybrid_engine(loaded, store, max_num_batched_tokens=8)
        run(e, ids(5, 30))  # chunks end at tokens 8, 16, 24 and 30: a state after blocks 2, 4, 6 and 7
    finally:
        os.umask(old)
    states = e.prefix_store.dir / "states"
    files = sorted(states.glob("*.safetensors"))
    assert len(files) == 4 and stat.S_IMODE(os.lstat(states).st_mode) == 0o700
    caches = make_prompt_cache(ref_model)
    ref_model(mx.array([[1]]), cache=caches)
    want = {
        f"{k}.{j}": (list(a.shape), str(a.dtype))
        for k, c in enumerate(c for c in caches if isinstance(c, ArraysCache))
        for j, a in enumerate(c.cache)
    }
    for f in files:
        assert stat.S_IMODE(os.lstat(f).st_mode) == 0o600
        arrays, meta = mx.load(str(f), return_metadata=True)
        assert {k: (list(v.shape), str(v.dtype)) for k, v in arrays.items()} == want
        blob = f.read_bytes()
        n = int.from_bytes(blob[:8], "little")
        assert json.loads(blob[8 : 8 + n])["__metadata__"]["crc32"] == f"{zlib.crc32(blob[8 + n :]):08x}"
        assert meta["block_hash"] == f.stem
