"""Shared-storage backend: one file per value on a shared volume (NFS, CephFS, hostPath...).

Writes go to a unique temp file in the final directory and are published with ``os.replace``,
so readers (any process, any pod) see a whole old or a whole new value, and concurrent writers
of the same key simply race to the last rename. An optional size cap evicts least recently
used files (mtime, refreshed on reads at most every ``touch_interval_s``).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from epdserve.connectors.storage.base import BlockStore, StoreStats

logger = logging.getLogger(__name__)

SUFFIX = ".epd"
STALE_TEMP_S = 3600.0  # temp files older than this are leftovers of a crashed writer


@dataclass(frozen=True)
class SharedStorageConfig:
    """A directory on a shared volume, and an optional size cap with LRU eviction."""

    path: str = "/cache/kv"
    max_bytes: int | None = None  # evict least recently used files above this (None: no cap)
    evict_to: float = 0.9  # after eviction, usage is at most evict_to * max_bytes
    rescan_interval_s: float = 60.0  # re-measure usage (other writers) at least this often
    fanout_chars: int = 2  # subdirectory = first hex chars of the key's hash (256 dirs)
    touch_on_read: bool = True  # refresh mtime on hits so eviction is LRU, not FIFO
    touch_interval_s: float = 10.0
    fsync: bool = False  # durability across node crashes; the cache is rebuildable
    max_value_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path must name a directory")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0 or None, got {self.max_bytes}")
        if not 0 < self.evict_to <= 1:
            raise ValueError(f"evict_to must be in (0, 1], got {self.evict_to}")
        if not 0 <= self.fanout_chars <= 8:
            raise ValueError(f"fanout_chars must be 0..8, got {self.fanout_chars}")


class SharedStorageBlockStore(BlockStore):
    """Files named by a hash of the key under ``{path}/{hash[:fanout]}/``."""

    def __init__(self, config: SharedStorageConfig):
        self.config = config
        self.root = os.path.abspath(config.path)
        self.stats = StoreStats()
        self._dirs: set[str] = set()
        self._seq = itertools.count()
        self._evict_lock = threading.Lock()
        self._usage: int | None = None  # bytes, measured by the last scan plus our own puts
        self._scanned_at = 0.0
        self._last_errno: int | None = None
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:  # read-only volume: reads may still work
            logger.warning("cannot create %s: %s", self.root, exc)

    def path_of(self, key: str) -> str:
        """The file that holds ``key``'s value."""
        digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        return os.path.join(self.root, digest[: self.config.fanout_chars], digest + SUFFIX)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        done = [self._put(key, value) for key, value in items]
        stored = sum(done)
        self.stats.add(puts=stored, put_failures=len(items) - stored)
        if stored and self.config.max_bytes is not None:
            self._account(sum(len(v) for (_, v), ok in zip(items, done, strict=True) if ok))
        return done

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        values = [self._get(key) for key in keys]
        self.stats.add(gets=len(keys), hits=sum(v is not None for v in values))
        return values

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.isfile(self.path_of(key)) for key in keys]

    def delete_many(self, keys: Sequence[str]) -> int:
        deleted = 0
        for key in keys:
            try:
                os.unlink(self.path_of(key))
                deleted += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.debug("cannot delete %s: %s", key, exc)
        return deleted

    def close(self) -> None:
        pass  # no handles are kept open between calls

    def _put(self, key: str, value: bytes) -> bool:
        if len(value) > self.config.max_value_bytes:
            return False
        final = self.path_of(key)
        directory = os.path.dirname(final)
        tmp = f"{directory}/.{os.path.basename(final)}.{os.getpid()}.{next(self._seq)}.tmp"
        for retry in (False, True):  # once more if the directory vanished (volume wiped)
            try:
                if directory not in self._dirs:
                    os.makedirs(directory, exist_ok=True)
                    self._dirs.add(directory)
                with open(tmp, "xb") as f:
                    f.write(value)
                    if self.config.fsync:
                        os.fsync(f.fileno())
                os.replace(tmp, final)
                return True
            except OSError as exc:
                self._discard(tmp)
                self._dirs.discard(directory)
                if retry or not isinstance(exc, FileNotFoundError):
                    self._put_error(exc)
                    return False
        return False

    def _put_error(self, exc: OSError) -> None:
        """Log a write error the first time its kind shows up (every one is counted)."""
        if exc.errno != self._last_errno:
            self._last_errno = exc.errno
            logger.warning("cannot write to %s: %s", self.root, exc)

    def _get(self, key: str) -> bytes | None:
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size > self.config.max_value_bytes:
                    self.stats.add(rejected=1)
                    self._discard(path)  # it would be read, and refused, again by every pod
                    return None
                value = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:  # e.g. EIO on a flaky network volume, EISDIR
            self.stats.add(get_failures=1)
            logger.warning("cannot read %s: %s", key, exc)
            return None
        if self.config.touch_on_read and time.time() - st.st_mtime > self.config.touch_interval_s:
            # best effort: a read-only volume or a concurrent eviction just skips it
            with contextlib.suppress(OSError):
                os.utime(path)
        return value

    @staticmethod
    def _discard(path: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)

    def _account(self, added: int) -> None:
        """Track usage; scan and evict when over the cap or when the last scan is old."""
        with self._evict_lock:
            stale = time.monotonic() - self._scanned_at > self.config.rescan_interval_s
            if self._usage is not None:
                self._usage += added
            if self._usage is None or stale or self._usage > self.config.max_bytes:
                self._usage = self._evict()
                self._scanned_at = time.monotonic()

    def _evict(self) -> int:
        """Measure the volume and delete least recently used files down to ``evict_to``."""
        files, total, now = [], 0, time.time()
        for entry in _walk(self.root):
            try:
                st = entry.stat()
            except OSError:
                continue  # renamed or evicted by another process meanwhile
            if entry.name.endswith(".tmp"):
                if now - st.st_mtime > STALE_TEMP_S:
                    self._discard(entry.path)
                continue
            files.append((st.st_mtime, st.st_size, entry.path))
            total += st.st_size
        if total <= self.config.max_bytes:
            return total
        target, evicted = self.config.evict_to * self.config.max_bytes, 0
        for _, size, path in sorted(files):
            if total <= target:
                break
            try:
                os.unlink(path)
                evicted += 1
            except FileNotFoundError:
                pass  # another process evicted it
            except OSError:
                continue  # read-only: cannot evict; count only what went
            total -= size
        self.stats.add(evictions=evicted)
        return total


def _walk(root: str):
    """Every file entry below ``root`` (the fan-out is shallow: one level, or none)."""
    try:
        top = list(os.scandir(root))
    except OSError:
        return
    for entry in top:
        if entry.is_dir(follow_symlinks=False):
            try:
                yield from (e for e in os.scandir(entry.path) if e.is_file(follow_symlinks=False))
            except OSError:
                continue
        elif entry.is_file(follow_symlinks=False):
            yield entry
