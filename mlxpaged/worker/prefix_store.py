"""The disk tier of the prefix cache: full KV blocks stored under their chained block hash.

Layout: `DIR/<namespace>/<hash[:2]>/<hash>.kvb`, one file per block. `<namespace>` is a digest
of everything that changes a block's bytes (`namespace_parts`): the weights by content, the
dtype, the KV quantization (bits, group size, key scales and offsets), the block size, the cache
shape, the model code and this format, and the tensor-parallel rank and world size. A store
written by another model or other settings lives in another directory and is never read.

A file is a fixed header, the block's token ids (int64) and the payload, which starts at a
64-byte aligned offset: every pool array's rows of the block (`PagedKVCache.arrays` order),
raw. The header holds the namespace digest, the block hash, the token count, the payload size
and a CRC-32 of tokens and payload; a file whose header, size, tokens or CRC is wrong is
skipped with one warning and deleted, and the block is recomputed.

What the tier trusts: only regular files owned by the user the engine runs as. Every file is
opened without following a symlink and without blocking (`read_own`: a FIFO or device node at a
block path can never stall the engine), then checked with `fstat`; anything else at a block path
is deleted like a corrupted file. Files are created 0600 and the directories the tier makes 0700
(`private_dir`), whatever the umask: a block holds its token ids in plain int64, so no other
local user may read them. A namespace directory an older version left 0755 is tightened to 0700,
and one that is a symlink or owned by another user turns the tier off.

Writes (`save`) go to a background thread: the engine hands over bytes it has already read
back, so a step never waits for the disk. Each file is written to a temporary name unique to
the process and thread, then renamed (`os.replace`, atomic on POSIX): two processes on one
DIR need no lock, a reader sees a whole file or none, and a file deleted while another
process reads it stays readable through its open descriptor. An `OSError` on write (disk
full, read-only directory) logs one warning and turns the tier off; serving goes on.

`--prefix-cache-disk-gb` caps the bytes of block files under DIR (all namespaces; by default
`default_cap`: 8 GB, or a quarter of the free space if less): before a write, the least recently
used files (by mtime; a read hit touches its file) are deleted until the new one fits. Only the
tier's own names are counted, evicted or cleaned up (`NS_DIR`, `SHARD_DIR`, `BLOCK_FILE`,
`OWN_TMP`): anything else under DIR is left alone. Which blocks are written is the block
manager's rule: prompt blocks only, as they are computed (`BlockManager.cache_full_blocks`) or
hit in memory (`match_prefix`: an earlier answer filled them).
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import inspect
import json
import logging
import os
import queue
import re
import shutil
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("mlxpaged.prefix_store")

FORMAT_VERSION = 1
MAGIC = b"MLXPKVB\x01"
# magic, version, num_tokens, payload bytes, crc32(tokens + payload), namespace digest, block hash
_HEADER = struct.Struct("<8sIIQI32s32s")
_ALIGN = 64
SUFFIX = ".kvb"
RESCAN_S = 10.0  # how stale this process's view of other processes' files may get


# The tier's own names: DIR/<NS_DIR>/<SHARD_DIR>/<BLOCK_FILE>, and `_atomic_write`'s temporary names.
NS_DIR = re.compile(r"[0-9a-f]{32}")
SHARD_DIR = re.compile(r"[0-9a-f]{2}")
BLOCK_FILE = re.compile(r"[0-9a-f]{64}\.kvb")
OWN_TMP = re.compile(r"\.(?:[0-9a-f]{64}\.kvb|namespace\.json|weights-digests\.json)\.\d+\.\d+\.tmp")


MEMO_MAX_BYTES = 1 << 24  # the weights-digest memo: a few hundred bytes per weights file
DEFAULT_CAP_BYTES = 8 * 10**9  # without --prefix-cache-disk-gb: this, or a quarter of the free space, if less


def default_cap(root: Path) -> int:
    """The cap when none is given: `DEFAULT_CAP_BYTES`, or a quarter of the space free at start on
    DIR's filesystem if that is less (the tier never fills a disk by default)."""
    p = root
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return DEFAULT_CAP_BYTES
    return min(DEFAULT_CAP_BYTES, free // 4)


class UnsafeFile(ValueError):
    """A path in the disk tier that is not a regular file (or directory) of this user: never read."""


# Reads never follow a symlink, never wait for a FIFO's writer or a device, and never leak the fd.
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def read_own(path, max_bytes: int) -> bytes:
    """The bytes of `path`, at most `max_bytes + 1` (so an oversized file shows), if it is a regular
    file owned by this process's user. Raises FileNotFoundError if nothing is there and
    `UnsafeFile` for a symlink, a FIFO, a device or another user's file: the open cannot block
    (O_NONBLOCK) and what was opened is checked with `fstat` before a byte is read."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW on a symlink (EMLINK: FreeBSD)
            raise UnsafeFile("is a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile("is not a regular file")
        if st.st_uid != os.geteuid():
            raise UnsafeFile(f"belongs to another user (uid {st.st_uid})")
        chunks, left = [], max_bytes + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 24))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def new_dirs(path: Path) -> None:
    """Create `path` and its missing parents 0700, whatever the umask; an existing one (DIR may be
    a shared or symlinked directory) is left as it is."""
    missing, p = [], Path(path)
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
            os.chmod(d, 0o700)  # the umask may have narrowed it
        except FileExistsError:
            pass  # made by another process meanwhile


def private_dir(path: Path) -> None:
    """Make `path` (its parent exists) a directory only this user can enter: created 0700; an
    existing one must be this user's own directory, not a symlink, and is set to 0700 if it is
    wider (a store an older version made 0755). Raises OSError or `UnsafeFile`."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFile("is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeFile(f"belongs to another user (uid {st.st_uid})")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def _entries(path) -> list:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def payload_offset(num_tokens: int) -> int:
    end = _HEADER.size + 8 * num_tokens
    return -(-end // _ALIGN) * _ALIGN


# -- the namespace -----------------------------------------------------------------------------------
def _file_digest(f: Path, memo: dict) -> str:
    """The SHA-256 of `f`, or its remembered one while the file is the same file unchanged: same
    device, inode, size, mtime and ctime. ctime is the kernel's (no `cp -p`, `touch -r` or
    `os.utime` sets it), so weights replaced with the same size and mtime are hashed again."""
    st = f.stat()
    key = str(f.resolve())
    stamp = {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    stamp["ctime_ns"] = st.st_ctime_ns
    hit = memo.get(key)
    if hit and all(hit.get(k) == v for k, v in stamp.items()):
        return hit["sha256"]
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    memo[key] = {**stamp, "sha256": h.hexdigest()}
    return h.hexdigest()


def weights_digest(path: Path, memo_file: Path | None = None) -> str:
    """SHA-256 of a checkpoint's config.json and every *.safetensors file, whole.

    Hashing every byte (unlike the sampled `collectives.weights_identity`) catches a change to a
    single weight; the per-file digests are remembered in `memo_file` (written at the first start,
    its directory made if need be) by file identity and change times (`_file_digest`), so a
    restart hashes nothing that did not change.
    """
    memo = {}
    if memo_file is not None:
        try:
            memo = json.loads(read_own(memo_file, MEMO_MAX_BYTES))
        except (OSError, ValueError):  # absent, unreadable, not ours (UnsafeFile) or not JSON
            memo = {}
    files = [path / "config.json"] + sorted(path.glob("*.safetensors"))
    h = hashlib.sha256()
    for f in files:
        if f.is_file():
            h.update(f"{f.name}|{_file_digest(f, memo)}".encode())
    if memo_file is not None:
        try:
            new_dirs(memo_file.parent)
            _atomic_write(memo_file, json.dumps(memo).encode())
        except (OSError, UnsafeFile):
            pass  # only a cache of digests
    return h.hexdigest()


def _array_digest(arrays) -> str | None:
    if arrays is None:
        return None
    import mlx.core as mx

    h = hashlib.sha256()
    for a in arrays:
        h.update(b"none" if a is None else np.array(a.astype(mx.float32)).tobytes())
    return h.hexdigest()


def namespace_parts(loaded, kv_cache, *, rank: int = 0, world: int = 1, memo_file: Path | None = None) -> dict:
    """Everything that changes a block's bytes, as JSON-able values (digested by `namespace`)."""
    from ..version import __version__

    s = kv_cache.shape
    model_src = inspect.getsourcefile(type(loaded.model))
    code = hashlib.sha256(Path(model_src).read_bytes()).hexdigest() if model_src else type(loaded.model).__qualname__
    return {
        "format": FORMAT_VERSION,
        "mlxpaged": __version__,
        "model_code": code,
        "weights": weights_digest(Path(loaded.path), memo_file),
        "weights_mode": loaded.weights,
        "dtype": str(s.dtype),
        "kv_bits": s.kv_bits,
        "kv_group_size": s.kv_group_size if s.kv_bits is not None else None,
        "key_scales": _array_digest(kv_cache.key_scales),
        "key_offsets": _array_digest(kv_cache.key_offsets),
        "block_size": kv_cache.block_size,
        "cache_shape": [s.num_layers, s.num_kv_heads, s.head_dim],
        "arrays": [[list(a.shape[1:]), str(a.dtype)] for a in kv_cache.arrays],
        "rank": rank,
        "world": world,
    }


def namespace(parts: dict) -> bytes:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()


def _atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` as a whole (a temporary name, then a rename), mode 0600 whatever the
    umask; the temporary file is created new (O_EXCL, never through a symlink)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        try:
            fd = os.open(tmp, _CREATE_FLAGS, 0o600)
        except FileExistsError:  # a leftover of a killed thread with the same ids
            os.unlink(tmp)
            fd = os.open(tmp, _CREATE_FLAGS, 0o600)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, 0o600)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# -- the store ---------------------------------------------------------------------------------------
@dataclass
class StoreStats:
    hit_blocks: int = 0  # blocks read and handed to the pool
    written_blocks: int = 0
    written_bytes: int = 0
    evicted_blocks: int = 0
    bad_files: int = 0  # corrupted, truncated or foreign: deleted
    skipped_slow: int = 0  # lookups refused because reading was estimated slower than recomputing
    read_seconds: float = 0.0
    read_bytes: int = 0


class PrefixStore:
    """One namespace of the disk tier; `lookup` and `load` run on the engine thread, writes on a
    background thread.

    `block_nbytes` lists the bytes of one block in each pool array (`PagedKVCache.arrays` order).
    `agree` (tensor parallelism) turns a local hit count into the count every rank has.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        ns: bytes,
        block_nbytes: list[int],
        block_size: int,
        *,
        cap_bytes: int | None = None,
        agree: Callable[[int], int] | None = None,
        parts: dict | None = None,
    ):
        self.root = Path(root)
        self.ns = ns
        self.dir = self.root / ns.hex()[:32]
        self.block_nbytes = list(block_nbytes)
        self.payload_nbytes = sum(block_nbytes)
        self.block_size = block_size
        self.file_nbytes = payload_offset(block_size) + self.payload_nbytes
        given = cap_bytes is not None
        self.cap_bytes = cap_bytes if given else default_cap(self.root)
        self.agree = agree
        self.stats = StoreStats()
        self.enabled = True
        self.recompute_s_per_token: float | None = None  # set by the engine from its prefill speed
        self._read_s_per_block: float | None = None
        self._lookups = 0
        self._staged: dict[bytes, bytes] = {}  # verified payloads, until `load` copies them
        self._lock = threading.Lock()  # guards _files, _total, _pending
        self._files: OrderedDict[str, int] = OrderedDict()  # every file under root, LRU first -> size
        self._total = 0
        self._pending: set[bytes] = set()  # hashes queued or being written
        self._last_scan = 0.0
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        if given and cap_bytes < self.file_nbytes:
            raise ValueError(
                f"prefix cache disk cap of {cap_bytes} bytes holds no block ({self.file_nbytes} bytes each)"
            )
        if self.cap_bytes < self.file_nbytes:
            self._disable(f"the disk under {self.root} is too full for the default cap (--prefix-cache-disk-gb)")
            return
        try:
            new_dirs(self.root)
            private_dir(self.dir)
            if parts is not None:
                desc = self.dir / "namespace.json"
                if not desc.exists():
                    _atomic_write(desc, json.dumps(parts, indent=1, sort_keys=True).encode())
            self._scan()
        except UnsafeFile as e:
            self._disable(f"prefix cache directory {self.dir} {e}")
            return
        except OSError as e:
            self._disable(f"cannot use prefix cache directory {self.root} ({e.strerror or e})")
            return
        self._thread = threading.Thread(target=self._writer, name="mlxpaged-prefix-store", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @classmethod
    def for_model(
        cls,
        root: str | os.PathLike,
        loaded,
        kv_cache,
        block_size: int,
        *,
        cap_bytes: int | None = None,
        rank: int = 0,
        world: int = 1,
        agree: Callable[[int], int] | None = None,
    ) -> PrefixStore:
        """The store under `root` for `loaded`'s blocks in `kv_cache`: namespaced by everything that
        changes a block's bytes; on a tensor-parallel rank, by its rank too (`agree` as above)."""
        root = Path(root).expanduser()
        parts = namespace_parts(loaded, kv_cache, rank=rank, world=world, memo_file=root / "weights-digests.json")
        return cls(
            root,
            namespace(parts),
            kv_cache.block_nbytes(),
            block_size,
            cap_bytes=cap_bytes,
            agree=agree,
            parts=parts,
        )

    # -- bookkeeping ------------------------------------------------------------------------------
    def path_of(self, block_hash: bytes) -> Path:
        hx = block_hash.hex()
        return self.dir / hx[:2] / (hx + SUFFIX)

    def _scan(self) -> None:
        """Rebuild the LRU view of every block file under root (all namespaces), oldest first;
        removes temporary files a killed process left behind (older than a minute).

        Only this tier's own layout is looked at (`NS_DIR`/`SHARD_DIR`/`BLOCK_FILE`, `OWN_TMP`):
        DIR may be shared with other files, which are never counted, evicted or deleted."""
        found = []
        now = time.time()

        def stale_tmp(p: str, name: str) -> None:
            try:
                if OWN_TMP.fullmatch(name) and now - os.stat(p).st_mtime > 60:
                    os.unlink(p)
            except OSError:
                pass

        def tighten(p: str, st=None) -> None:
            """A directory or block file of ours an older version left readable to others: 0700/0600."""
            try:
                st = st or os.lstat(p)
                want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
                if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != want:
                    os.chmod(p, want, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass

        for ns in _entries(self.root):
            if not ns.is_dir(follow_symlinks=False):
                stale_tmp(ns.path, ns.name)  # the digest memo's temporary files live in DIR itself
                continue
            if not NS_DIR.fullmatch(ns.name):
                continue
            tighten(ns.path)
            for shard in _entries(ns.path):
                if not shard.is_dir(follow_symlinks=False):
                    stale_tmp(shard.path, shard.name)
                    continue
                if not SHARD_DIR.fullmatch(shard.name):
                    continue
                tighten(shard.path)
                for f in _entries(shard.path):
                    if BLOCK_FILE.fullmatch(f.name) and f.name.startswith(shard.name):
                        try:
                            st = f.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if stat.S_ISREG(st.st_mode):
                            found.append((st.st_mtime_ns, f.path, st.st_size))
                            tighten(f.path, st)
                    else:
                        stale_tmp(f.path, f.name)
        found.sort()
        with self._lock:
            self._files = OrderedDict((p, size) for _, p, size in found)
            self._total = sum(size for _, _, size in found)
            self._last_scan = time.monotonic()

    def _disable(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            log.warning("%s; the disk prefix cache is off, serving goes on", why)

    def _bad_file(self, path: Path, why: str) -> None:
        self.stats.bad_files += 1
        log.warning("prefix cache file %s %s: deleted, the block is recomputed", path.name, why)
        try:
            os.unlink(path)
        except OSError:
            pass
        with self._lock:
            size = self._files.pop(str(path), None)
            if size is not None:
                self._total -= size

    @property
    def total_bytes(self) -> int:
        return self._total

    # -- reads (engine thread) -------------------------------------------------------------------------
    def wants(self, block_hash: bytes) -> bool:
        """Whether a newly full block should be written (not stored nor queued already)."""
        if not self.enabled:
            return False
        with self._lock:
            return block_hash not in self._pending and str(self.path_of(block_hash)) not in self._files

    def _reading_pays(self) -> bool:
        """Read unless the measured read time of a block exceeds the time to recompute its tokens;
        every 64th lookup reads anyway, so the estimate follows the disk and the load."""
        self._lookups += 1
        if self._read_s_per_block is None or self.recompute_s_per_token is None or self._lookups % 64 == 0:
            return True
        return self._read_s_per_block < self.recompute_s_per_token * self.block_size

    def lookup(self, block_hashes: list[bytes], token_ids: list[tuple[int, ...]]) -> int:
        """How many leading blocks of `block_hashes` (holding `token_ids`) the store has; reads
        and verifies them now, keeping the bytes for `load`. A bad file ends the run (and is deleted)."""
        n = self._lookup_local(block_hashes, token_ids) if block_hashes else 0
        if self.agree is not None:
            n = self.agree(n)
        return n

    def _lookup_local(self, block_hashes, token_ids) -> int:
        if not self.enabled:
            return 0
        if not self._reading_pays():
            self.stats.skipped_slow += 1
            return 0
        t0 = time.perf_counter()
        n = 0
        for h, toks in zip(block_hashes, token_ids):
            payload = self._read(h, toks)
            if payload is None:
                break
            self._staged[h] = payload
            n += 1
        if n:
            dt = (time.perf_counter() - t0) / n
            self._read_s_per_block = dt if self._read_s_per_block is None else 0.7 * self._read_s_per_block + 0.3 * dt
            self.stats.read_seconds += dt * n
            self.stats.read_bytes += n * self.file_nbytes
        return n

    def _read(self, block_hash: bytes, toks: tuple[int, ...]) -> bytes | None:
        path = self.path_of(block_hash)
        try:
            data = read_own(path, self.file_nbytes)
        except FileNotFoundError:
            return None
        except UnsafeFile as e:
            self._bad_file(path, str(e))
            return None
        except OSError as e:
            log.warning("cannot read prefix cache file %s (%s); the block is recomputed", path.name, e.strerror or e)
            return None
        if len(data) < _HEADER.size:
            self._bad_file(path, "is truncated")
            return None
        magic, version, num_tokens, nbytes, crc, ns, bh = _HEADER.unpack_from(data)
        if magic != MAGIC or version != FORMAT_VERSION:
            self._bad_file(path, "is not a block file of this version")
            return None
        if ns != self.ns or bh != block_hash or num_tokens != self.block_size or nbytes != self.payload_nbytes:
            self._bad_file(path, "belongs to another cache (namespace, hash or layout differ)")
            return None
        off = payload_offset(num_tokens)
        if len(data) != off + nbytes:
            self._bad_file(path, "is truncated" if len(data) < off + nbytes else "has trailing bytes")
            return None
        tok_bytes = data[_HEADER.size : _HEADER.size + 8 * num_tokens]
        payload = data[off:]
        if zlib.crc32(payload, zlib.crc32(tok_bytes)) != crc:
            self._bad_file(path, "fails its checksum")
            return None
        if tuple(np.frombuffer(tok_bytes, np.int64).tolist()) != tuple(toks):
            return None  # a hash collision: not this block (the file is fine)
        self.stats.hit_blocks += 1
        with self._lock:
            if str(path) in self._files:
                self._files.move_to_end(str(path))
        self._queue.put(("touch", path))
        return payload

    def take_staged(self, block_hashes: list[bytes]) -> list[bytes]:
        """The verified payloads of blocks a lookup found, for the engine to copy into the pool."""
        out = [self._staged.pop(h) for h in block_hashes]
        self._staged.clear()  # any left over belong to a lookup the scheduler did not use
        return out

    def split_payload(self, payloads: list[bytes]) -> list[np.ndarray]:
        """Per pool array, the rows of every payload: `uint8 [len(payloads), block_nbytes[i]]`."""
        buf = np.frombuffer(b"".join(payloads), np.uint8).reshape(len(payloads), self.payload_nbytes)
        out, off = [], 0
        for nb in self.block_nbytes:
            out.append(buf[:, off : off + nb])
            off += nb
        return out

    # -- writes ------------------------------------------------------------------------------------------
    def save(self, items: list[tuple[bytes, tuple[int, ...]]], rows: list[np.ndarray]) -> None:
        """Queue blocks for writing: `items[j]` (hash, token ids) holds `rows[i][j]` (uint8) of each
        pool array `i`. Returns at once."""
        if not self.enabled or not items:
            return
        with self._lock:
            self._pending.update(h for h, _ in items)
        for j, (h, toks) in enumerate(items):
            payload = b"".join(r[j].tobytes() for r in rows)
            self._queue.put(("write", h, toks, payload))

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued write is on disk (or the tier is off)."""
        done = threading.Event()
        if self._thread is None or not self._thread.is_alive():
            return
        self._queue.put(("flush", done))
        done.wait(timeout)

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self.flush()
            self._queue.put(None)
            self._thread.join(5)

    def _writer(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            kind = job[0]
            try:
                if kind == "flush":
                    job[1].set()
                elif kind == "touch":
                    os.utime(job[1], follow_symlinks=False)
                elif kind == "write" and self.enabled:
                    self._write(*job[1:])
            except FileNotFoundError:
                pass  # touched a file another process evicted
            except OSError as e:
                self._disable(f"cannot write to prefix cache directory {self.root} ({e.strerror or e})")
            except Exception as e:  # never let the writer thread die silently
                self._disable(f"prefix cache writer failed ({type(e).__name__}: {e})")
            finally:
                if kind == "write":
                    with self._lock:
                        self._pending.discard(job[1])

    def _write(self, block_hash: bytes, toks: tuple[int, ...], payload: bytes) -> None:
        path = self.path_of(block_hash)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.utime(path, follow_symlinks=False)
                return
        except FileNotFoundError:
            pass  # anything else there (a FIFO, a symlink, another user's file) is replaced below
        size = self.file_nbytes
        self._make_room(size)
        tok_bytes = np.asarray(toks, np.int64).tobytes()
        crc = zlib.crc32(payload, zlib.crc32(tok_bytes))
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(toks), len(payload), crc, self.ns, block_hash)
        pad = b"\0" * (payload_offset(len(toks)) - _HEADER.size - len(tok_bytes))
        private_dir(path.parent)
        _atomic_write(path, header + tok_bytes + pad + payload)
        with self._lock:
            self._files[str(path)] = size
            self._total += size
        self.stats.written_blocks += 1
        self.stats.written_bytes += size

    def _make_room(self, size: int) -> None:
        """Delete least recently used files until `size` more bytes fit under the cap."""
        if self._total + size > self.cap_bytes and time.monotonic() - self._last_scan > RESCAN_S:
            self._scan()  # count what other processes wrote (and forget what they deleted)
        while self._total + size > self.cap_bytes and self._files:
            with self._lock:
                victim, vsize = self._files.popitem(last=False)
                self._total -= vsize
            try:
                os.unlink(victim)
                self.stats.evicted_blocks += 1
            except FileNotFoundError:
                pass
