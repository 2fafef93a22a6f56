"""Payloads in shared memory (``/dev/shm``) for a producer and consumers on one host.

Fresh tmpfs pages cost more to allocate than to fill (a new 64 MiB file takes ~30 ms here,
a memcpy ~4 ms), so segments are pooled: a released payload's file is renamed into
``.free/`` and a later ``put`` renames it back and writes into it through a mapping this
process keeps, like Ray's plasma store keeps its arena mapped.

Reuse must never change bytes a reader still maps. A reader holds a shared ``flock`` on
the segment for as long as its mapping lives (the descriptor closes when the last tensor
decoded from it is freed); a segment is recycled only if an exclusive ``flock`` succeeds,
otherwise it is unlinked and the kernel frees it after the last reader.

Readers map copy-on-write by default (``reads="private"``): tensors may be written to
without touching the segment, at the price of mapping every page afresh for each batch.
``reads="shared"`` keeps one shared mapping per segment, like the writer, so a warm
segment decodes without a single page fault; its tensors then alias the segment, so an
in-place write is seen by every reader of that batch on the host (clone before mutating).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import socket
import tempfile
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from rollout_bus.events.batch import EncodedBatch
from rollout_bus.events.errors import DecodeError
from rollout_bus.events.names import Keys
from rollout_bus.events.payload.base import PayloadBuffer, PayloadStore, Reference
from rollout_bus.events.payload.file import FileStore

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/dev/shm/rollout-bus" if os.path.isdir("/dev/shm") else os.path.join(
    tempfile.gettempdir(), "rollout-bus-shm")
DEFAULT_POOL_BYTES = 2 << 30
FREE_DIR = ".free"
WRITING_PREFIX = ".w-"
MADV_POPULATE_WRITE = 23
MIB = 1 << 20


def capacity_for(nbytes: int) -> int:
    """Segment size for ``nbytes``: rounded up to a step of 1/8 of its power of two (at least 1 MiB)."""
    step = max(MIB, 1 << max(0, nbytes.bit_length() - 4))
    return max(step, (nbytes + step - 1) // step * step)


@dataclass
class _Mapping:
    fd: int
    mm: mmap.mmap
    size: int

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()  # still exported to a live batch: unmapped when that batch is freed
        os.close(self.fd)


class ShmStore(FileStore):
    name: ClassVar[str] = "shm"

    def __init__(self, keys: Keys, root: str | os.PathLike[str] = DEFAULT_ROOT, *,
                 pool_bytes: int = DEFAULT_POOL_BYTES, reads: Literal["private", "shared"] = "private") -> None:
        super().__init__(root, keys)
        if reads not in ("private", "shared"):
            raise ValueError(f"reads must be 'private' or 'shared', got {reads!r}")
        self.free_dir = self.root / FREE_DIR
        self.free_dir.mkdir(exist_ok=True)
        self.pool_bytes = pool_bytes
        self.reads = reads
        self.host = socket.gethostname()
        self.fallback: PayloadStore | None = None
        """Where a batch goes when one of its readers is on another host (``shm?fallback=redis``)."""
        self._maps: OrderedDict[tuple[int, int], _Mapping] = OrderedDict()
        self._lock = threading.RLock()  # guards the mapping cache

    def locator(self) -> dict[str, Any]:
        return {"store": self.name, "root": self.base, "host": self.host}

    # --- writing -----------------------------------------------------------------------
    def put(self, ref: str, batch: EncodedBatch, ttl_s: int) -> Reference:
        with self._lock:
            return self._put(ref, batch)

    def _put(self, ref: str, batch: EncodedBatch) -> Reference:
        path = self.path(ref)
        self._drop_stale_mappings()
        fd, tmp, size = self._claim(batch.nbytes)
        try:
            mapping = self._mapping(fd, size)
            batch.write_into(mapping.mm)  # no view of the mapping outlives this call
            os.utime(fd)  # writes through a warm mapping do not touch mtime; ``delete_expired`` reads it
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return {"store": self.name, "ref": ref, "nbytes": batch.nbytes, "path": str(path), "host": self.host}

    def _claim(self, nbytes: int) -> tuple[int, Path, int]:
        """A segment of at least ``nbytes`` under a private temp name: a free one if any fits, else a new one."""
        want = capacity_for(nbytes)
        for size, name in sorted(self._free_segments()):
            if size < nbytes or size > 2 * want:
                continue
            tmp = self.root / f"{WRITING_PREFIX}{uuid.uuid4().hex[:12]}"
            try:
                os.rename(self.free_dir / name, tmp)  # atomic: exactly one claimer wins
            except FileNotFoundError:
                continue
            return os.open(tmp, os.O_RDWR), tmp, size
        tmp = self.root / f"{WRITING_PREFIX}{uuid.uuid4().hex[:12]}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, want)
        return fd, tmp, want

    def _mapping(self, fd: int, size: int, *, populate: bool = True) -> _Mapping:
        """This process's shared read-write mapping of a segment, kept across batches (LRU, bounded)."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        mapping = self._maps.get(key)
        if mapping is not None and mapping.size == size:
            self._maps.move_to_end(key)
            return mapping
        if mapping is not None:
            del self._maps[key]
            mapping.close()
        own = os.dup(fd)
        mm = mmap.mmap(own, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if populate:
            with contextlib.suppress(OSError, ValueError):
                mm.madvise(MADV_POPULATE_WRITE)  # allocate and map every page in one call (Linux 5.14+)
        mapping = self._maps[key] = _Mapping(own, mm, size)
        while sum(m.size for m in self._maps.values()) > self.pool_bytes + size and len(self._maps) > 1:
            _, old = self._maps.popitem(last=False)
            old.close()
        return mapping

    def _drop_stale_mappings(self) -> None:
        """Unmap segments that were unlinked (swept, or deleted while read): they would pin their memory."""
        for key, mapping in list(self._maps.items()):
            if os.fstat(mapping.fd).st_nlink == 0:
                del self._maps[key]
                mapping.close()

    # --- reading -----------------------------------------------------------------------
    def get(self, reference: Reference) -> PayloadBuffer:
        ref, nbytes = self._local_ref(reference, self.host, "shared memory")
        path = self.path(ref)
        if self.reads == "shared":
            with self._lock:
                self._drop_stale_mappings()
        for _ in range(3):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise self._missing(ref) from None
            try:
                buffer = self._locked_view(ref, path, fd, nbytes)
            except BaseException:
                os.close(fd)
                raise
            if buffer is not None:
                return buffer
            os.close(fd)  # recycled or replaced between open and lock: look again
        raise self._missing(ref)

    def _locked_view(self, ref: str, path: Path, fd: int, nbytes: int) -> PayloadBuffer | None:
        """Lock ``fd`` shared and map it; None if ``path`` no longer names that file. On success the
        descriptor (and its lock) is closed when the returned buffer's last user is freed."""
        fcntl.flock(fd, fcntl.LOCK_SH)
        st = os.fstat(fd)
        try:
            if os.stat(path).st_ino != st.st_ino:
                return None
        except FileNotFoundError:
            raise self._missing(ref) from None
        if nbytes > st.st_size:
            raise DecodeError(f"shm payload {ref}: reference says {nbytes} bytes, segment holds {st.st_size}")
        if self.reads == "shared":
            view = self._shared_view(path, st, nbytes)
            weakref.finalize(view, os.close, fd)  # the shared lock lives as long as this batch's view
            return view.data
        mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY)
        weakref.finalize(mm, os.close, fd)  # the shared lock lives exactly as long as the mapping
        return memoryview(mm)

    def _shared_view(self, path: Path, st: os.stat_result, nbytes: int) -> np.ndarray:
        """A per-batch array over this process's cached shared mapping of the segment."""
        with self._lock:
            mapping = self._maps.get((st.st_dev, st.st_ino))
            if mapping is None or mapping.size != st.st_size:
                rw = os.open(path, os.O_RDWR)
                try:
                    if os.fstat(rw).st_ino != st.st_ino:
                        raise self._missing(path.name)
                    mapping = self._mapping(rw, st.st_size, populate=False)
                finally:
                    os.close(rw)
            return np.frombuffer(mapping.mm, dtype=np.uint8, count=nbytes)

    # --- releasing ---------------------------------------------------------------------
    def delete(self, reference: Reference) -> None:
        path = self.path(self._ref(reference))
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            st = os.fstat(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                unread = True
            except BlockingIOError:
                unread = False  # a reader still maps it
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino != st.st_ino:
                    return  # replaced by a newer payload of the same ref meanwhile
                if unread and self._pool_room(st.st_size):
                    os.utime(fd)  # idle time in the pool counts from now
                    os.rename(path, self.free_dir / f"{st.st_size:016x}-{uuid.uuid4().hex[:12]}")
                else:
                    os.unlink(path)
        finally:
            os.close(fd)

    def _free_segments(self) -> list[tuple[int, str]]:
        out = []
        for name in os.listdir(self.free_dir):
            size, _, _ = name.partition("-")
            with contextlib.suppress(ValueError):
                out.append((int(size, 16), name))
        return out

    def _pool_room(self, size: int) -> bool:
        return sum(s for s, _ in self._free_segments()) + size <= self.pool_bytes

    def delete_expired(self, older_than_s: float) -> int:
        """Remove payloads, half-written segments and pooled segments idle for ``older_than_s``."""
        removed = super().delete_expired(older_than_s)
        cutoff = time.time() - older_than_s
        for entry in os.scandir(self.free_dir):
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed += 1
        with self._lock:
            self._drop_stale_mappings()
        return removed

    def clear_pool(self) -> None:
        """Unlink every pooled segment and drop this process's mappings."""
        for _, name in self._free_segments():
            (self.free_dir / name).unlink(missing_ok=True)
        self.close()

    def close(self) -> None:
        with self._lock:
            while self._maps:
                _, mapping = self._maps.popitem()
                mapping.close()
