"""Payloads as files under a directory, e.g. a filesystem shared by the hosts of a cluster.

A payload is written to a temp name and renamed into place, so a reader sees the whole
file or nothing. Reads map the file copy-on-write (``MAP_PRIVATE``): tensors decode
without copying, may be written to without touching the file, and stay valid after the
file is deleted or replaced. Files carry no TTL: the channel's ``delete_expired`` removes old ones.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from rollout_bus.events.batch import Buffer, EncodedBatch
from rollout_bus.events.errors import DecodeError, PayloadMissing
from rollout_bus.events.names import Keys
from rollout_bus.events.payload.base import PayloadBuffer, PayloadStore, Reference, check_ref, write_vectored

TMP_PREFIX = ".tmp-"


def write_all(fd: int, buffers: Sequence[Buffer], offset: int | None = None) -> int:
    """Write every buffer in order with ``writev`` (or ``pwritev`` at ``offset``); returns bytes written."""
    if offset is None:
        return write_vectored(lambda views, _done: os.writev(fd, views), buffers)
    start = offset
    return write_vectored(lambda views, done: os.pwritev(fd, views, start + done), buffers)


class FileStore(PayloadStore):
    name: ClassVar[str] = "file"

    def __init__(self, root: str | os.PathLike[str], keys: Keys) -> None:
        self.base = str(Path(root).resolve())
        self.root = Path(root) / keys.namespace
        self.root.mkdir(parents=True, exist_ok=True)

    def locator(self) -> dict[str, Any]:
        return {"store": self.name, "root": self.base, "host": None}

    def path(self, ref: str) -> Path:
        return self.root / check_ref(ref)

    def put(self, ref: str, batch: EncodedBatch, ttl_s: int) -> Reference:
        path = self.path(ref)
        tmp = self.root / f"{TMP_PREFIX}{ref}-{uuid.uuid4().hex[:12]}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            batch.start_checksum()  # hashing runs while the tensor bytes are written; the header goes last
            header = batch.buffers[0]
            write_all(fd, batch.buffers[1:], offset=len(header))
            batch.finish()
            write_all(fd, [header], offset=0)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, path)
        return {"store": self.name, "ref": ref, "nbytes": batch.nbytes, "path": str(path)}

    def get(self, reference: Reference) -> PayloadBuffer:
        ref = self._ref(reference)
        try:
            fd = os.open(self.path(ref), os.O_RDONLY)
        except FileNotFoundError:
            raise self._missing(ref) from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise DecodeError(f"payload file of {ref} is empty")
            declared = reference.get("nbytes", size)
            if type(declared) is not int or declared != size:
                raise DecodeError(f"payload file of {ref} holds {size} bytes, its reference says {declared!r}")
            self._check_size(ref, size)
            return memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_COPY))
        finally:
            os.close(fd)  # the mapping outlives the descriptor

    def delete(self, reference: Reference) -> None:
        self.path(self._ref(reference)).unlink(missing_ok=True)

    def delete_expired(self, older_than_s: float) -> int:
        """Remove payload and temp files last written more than ``older_than_s`` ago."""
        cutoff = time.time() - older_than_s
        removed = 0
        for entry in os.scandir(self.root):
            try:
                if entry.is_file(follow_symlinks=False) and entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    def _missing(self, ref: str) -> PayloadMissing:
        return PayloadMissing(f"payload {ref} is gone from {self.root} (swept, released by every group, or "
                              f"written to a directory this host does not share)")
