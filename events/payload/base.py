"""The payload-store interface: where the bytes of a claim-checked batch live.

A store writes an ``EncodedBatch`` under a ref (``"<policy>:<batch_id>:<attempt>"``; the
attempt part keeps two live attempts of one job off each other's bytes) and returns a
reference, a small msgpack-able map that travels in the ``BatchReady`` event. ``get``
returns a buffer that ``events.batch.decode`` reads without copying. References come off
the wire: stores derive every key and path from the validated ref and their own
configuration, never from a path or key written in the reference, and check a reference's
declared size against ``max_bytes`` (the channel's maximum batch size) before they allocate
or map anything. ``write_vectored`` is the scatter-gather write loop the stores share (files, sockets).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from rollout_bus.events.batch import DEFAULT_MAX_BYTES, Buffer, EncodedBatch, Layout
from rollout_bus.events.errors import DecodeError, InvalidRequest, PayloadMissing, PayloadTooLarge
from rollout_bus.events.names import check_name

Reference = dict[str, Any]
PayloadBuffer = bytes | bytearray | memoryview

_REF_RE = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,63}:[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,63}(?::[0-9a-f]{1,32})?")
IOV_MAX = 1024  # buffers one writev/sendmsg call may take (Linux' UIO_MAXIOV)


def make_ref(policy: str, batch_id: str, attempt: str | None = None) -> str:
    """``<policy>:<batch_id>``, with ``:<attempt>`` (hex) when one attempt's bytes must not meet another's."""
    ref = f"{check_name('policy', policy)}:{check_name('batch_id', batch_id)}"
    return check_ref(ref if attempt is None else f"{ref}:{attempt}")


def check_ref(ref: Any) -> str:
    if not isinstance(ref, str) or not _REF_RE.fullmatch(ref):
        raise DecodeError(f"payload ref {ref!r} is not '<policy>:<batch_id>[:<attempt>]'")
    return ref


def check_owner(ref: Any, policy: str, batch_id: str) -> str:
    """``ref`` when it is a payload of ``policy``'s batch ``batch_id``; ``DecodeError`` otherwise (an event
    of one policy or batch pointing at another's bytes)."""
    owner, _, rest = check_ref(ref).partition(":")
    if owner != policy or rest.partition(":")[0] != batch_id:
        raise DecodeError(f"payload ref {ref!r} does not belong to batch {batch_id!r} of policy {policy!r}")
    return ref


def write_vectored(write: Callable[[list[memoryview], int], int], buffers: Sequence[Buffer]) -> int:
    """Write every byte of ``buffers`` in order through ``write(views, done)``, a scatter-gather call
    (``writev``, ``pwritev``, ``sendmsg``) given at most ``IOV_MAX`` views and the bytes written so
    far, returning how many it wrote; a partial write resumes where it stopped. Returns the total."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    total = 0
    i = 0
    while i < len(views):
        n = write(views[i:i + IOV_MAX], total)
        total += n
        while n:
            size = views[i].nbytes
            if n >= size:
                n -= size
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
    return total


class BatchDraft:
    """A batch being built in place: fill ``tensors`` (or ``draft[name]``), then publish the draft
    (``BatchChannel.publish(policy, batch_id, draft)``). A store that seals its segment (memfd) built
    the tensors in it and seals it as it is, without a copy or a checksum, if no tensor of the draft
    is referenced any more by then (``del`` them first); otherwise the draft is copied. Other stores
    give a draft in ordinary memory, encoded and copied at publish as any batch."""

    def __init__(self, layout: Layout, meta: dict[str, Any], tensors: dict[str, Any], *,
                 store: PayloadStore | None = None, segment: tuple[int, mmap.mmap] | None = None) -> None:
        self.layout = layout
        self.meta = meta
        self.tensors = tensors
        self.store = store
        """The store whose segment holds the tensors (None: ordinary memory)."""
        self._segment = segment
        self._finalizer = None if segment is None else weakref.finalize(self, _close_segment, segment)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def __getitem__(self, name: str) -> Any:
        return self.tensors[name]

    def take_segment(self) -> tuple[int, mmap.mmap]:
        """The segment's descriptor and writable mapping, handed to the store that seals them (once)."""
        if self._segment is None or self._finalizer is None:
            raise InvalidRequest("this draft was published or discarded already")
        segment, self._segment = self._segment, None
        self._finalizer.detach()
        self.tensors = {}
        return segment

    def discard(self) -> None:
        """Give the draft's memory back without publishing it."""
        self.tensors = {}
        self._segment = None
        if self._finalizer is not None:
            self._finalizer()


def _close_segment(segment: tuple[int, mmap.mmap]) -> None:
    fd, mm = segment
    with contextlib.suppress(BufferError, ValueError):
        mm.close()  # still exported to a tensor: unmapped when that tensor is freed
    os.close(fd)


class PayloadStore(ABC):
    """One backend for payload bytes; subclasses live one per file in this package."""

    name: ClassVar[str]
    max_bytes: int = DEFAULT_MAX_BYTES
    """The largest payload ``get`` accepts (the owning channel's maximum batch size)."""

    @abstractmethod
    def put(self, ref: str, batch: EncodedBatch, ttl_s: int) -> Reference:
        """Write the batch (replacing any payload of the same ref) and return its reference."""

    @abstractmethod
    def get(self, reference: Reference) -> PayloadBuffer:
        """The payload's bytes; ``PayloadMissing`` when it is gone."""

    @abstractmethod
    def delete(self, reference: Reference) -> None:
        """Remove the payload; a missing payload is not an error."""

    def get_sealed(self, reference: Reference) -> tuple[PayloadBuffer, bool]:
        """The payload's bytes, and whether the kernel vouches that they cannot have changed since the
        producer sealed them (then the reader may skip the checksum). Only a store that checks its
        segment's seals says True."""
        return self.get(reference), False

    def allocate(self, layout: Layout, meta: dict[str, Any]) -> BatchDraft:
        """A draft of a batch laid out as ``layout``, its tensors where this store can publish them from
        (by default in ordinary memory)."""
        buffer = bytearray(layout.nbytes)
        buffer[:len(layout.head)] = layout.head
        return BatchDraft(layout, meta, layout.tensors(buffer))

    def seal(self, ref: str, draft: BatchDraft, ttl_s: int) -> Reference:
        """Publish a draft this store allocated in place (only stores that do so implement it)."""
        raise InvalidRequest(f"the {self.name} store builds no batch in place")

    def delete_expired(self, older_than_s: float) -> int:
        """Remove leftovers of this store older than ``older_than_s`` that no index knows of
        (half-written temp files); returns how many were removed."""
        return 0

    def locate(self, ref: str) -> Reference:
        """A reference for ``ref`` rebuilt from the ref alone (for deleting orphans)."""
        return {"store": self.name, "ref": check_ref(ref)}

    def locator(self) -> dict[str, Any]:
        """Where this store keeps payloads, as recorded in the payload index: ``store`` (the kind),
        ``root`` (its directory, None for Redis) and ``host`` (None when every host reaches it)."""
        return {"store": self.name, "root": None, "host": None}

    def redis_keys(self, reference: Reference) -> list[str]:
        """Keys in the bus's Redis that hold this payload (deleted atomically on release); [] if none."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections and mappings held by this store object."""

    def _ref(self, reference: Reference) -> str:
        if not isinstance(reference, dict):
            raise DecodeError(f"payload reference must be a map, got {type(reference).__name__}")
        if reference.get("store") != self.name:
            raise DecodeError(f"payload reference is for store {reference.get('store')!r}, "
                              f"this is the {self.name!r} store")
        return check_ref(reference.get("ref"))

    def _local_ref(self, reference: Reference, host: str, where: str) -> tuple[str, int]:
        """The ref and size of a payload kept on ``host`` alone (``where``: what holds it there, for the message):
        ``PayloadMissing`` from another host, ``DecodeError`` without a size, ``PayloadTooLarge`` past the bound."""
        ref = self._ref(reference)
        theirs, nbytes = reference.get("host"), reference.get("nbytes")
        if theirs != host:
            raise PayloadMissing(f"payload {ref} is in {where} on host {theirs!r}, not on {host!r}: "
                                 f"use the redis or file store across hosts")
        if type(nbytes) is not int or nbytes <= 0:
            raise DecodeError(f"{self.name} payload reference {reference!r} lacks nbytes")
        self._check_size(ref, nbytes)
        return ref, nbytes

    def _check_size(self, ref: str, nbytes: int) -> None:
        """``PayloadTooLarge`` when a payload's declared size exceeds ``max_bytes`` (before any allocation)."""
        if nbytes > self.max_bytes:
            raise PayloadTooLarge(f"payload {ref} declares {nbytes} bytes, more than the maximum batch size "
                                  f"of {self.max_bytes} bytes")
