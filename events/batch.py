"""The sample-batch wire format: named tensors as raw bytes behind a small msgpack header.

Layout of an encoded batch::

    magic "RBB\\0" | u16 version | u16 flags (0) | u32 header length | msgpack header
    | zero padding to 64 | field bytes, each field starting on a 64-byte boundary

The prefix's flags are 0, or ``FLAG_UNHASHED`` for a batch written in place (``layout``) into a
segment the kernel seals: it carries no checksum (its 8 bytes are zero) and cannot be verified.

The header is a msgpack map ``{meta, fields, data_nbytes, hash_chunk, checksum}`` (the
checksum last, as 8 little-endian bytes, so that it can be filled in after the rest); each
field is ``{name, dtype, shape, offset, nbytes}`` (``offset`` from the start of the data
section), plus ``ragged: "values" | "offsets"`` for the two halves of a ragged field.

``encode`` is zero-copy: it returns the header and memoryviews of the (contiguous, CPU)
tensors, which a store writes with scatter-gather I/O. ``decode`` builds tensors with
``torch.frombuffer`` over the given buffer, so they share its memory. The checksum is
xxh3-64 over the field bytes cut into ``hash_chunk`` pieces, folded with xxh3-64 over the
pieces' digests, so that large batches are hashed by several threads (xxhash releases the
GIL). ``layout`` places the fields of a batch before any tensor exists, so that a producer
can build its tensors directly where a store keeps the bytes. Nothing here unpickles: malformed input raises ``DecodeError`` and nothing else.
"""

from __future__ import annotations

import _thread
import itertools
import math
import os
import struct
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash

from rollout_bus.events.errors import ChecksumMismatch, DecodeError, InvalidRequest, PayloadTooLarge

MAGIC = b"RBB\x00"
FORMAT_VERSION = 1
FLAG_UNHASHED = 1
"""Prefix flag: no checksum was computed (a batch built in place in a segment the kernel seals)."""
ALIGN = 64
HASH_CHUNK = 2 << 20
DEFAULT_MAX_BYTES = 1 << 30
PARALLEL_HASH_MIN_BYTES = 16 << 20
MAX_HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
HELPER_EXIT_WAIT_S = 0.05
"""How long verifying a received batch waits for hash helpers to let go of its buffer (see ``_Hasher``)."""
_PREFIX = struct.Struct("<4sHHI")
_FLAGS, _FLAGS_AT = struct.Struct("<H"), 6  # the prefix's flags field
_ZEROS = bytes(ALIGN)

DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

Buffer = bytes | bytearray | memoryview


# --- ragged fields -----------------------------------------------------------------------

def pack_ragged(seqs: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat values and int64 offsets (``len(seqs) + 1`` of them) of a list of 1-D tensors."""
    lengths = [int(s.shape[0]) for s in seqs]
    if any(s.dim() != 1 for s in seqs):
        raise InvalidRequest("pack_ragged takes 1-D tensors")
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    if lengths:
        torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=offsets[1:])
    if seqs:
        values = torch.cat([s.to(dtype) if dtype is not None else s for s in seqs])
    else:
        values = torch.empty(0, dtype=dtype or torch.int64)
    return values, offsets


def unpack_ragged(values: torch.Tensor, offsets: torch.Tensor) -> list[torch.Tensor]:
    """The rows of a ragged field, as views of ``values``."""
    bounds = offsets.tolist()
    return [values[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]


@dataclass(frozen=True)
class Ragged:
    """A ragged field: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``."""

    values: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def from_list(cls, seqs: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> Ragged:
        return cls(*pack_ragged(seqs, dtype))

    def to_list(self) -> list[torch.Tensor]:
        return unpack_ragged(self.values, self.offsets)

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.values[int(self.offsets[i]):int(self.offsets[i + 1])]


# --- encoding ----------------------------------------------------------------------------

class EncodedBatch:
    """An encoded batch as a list of buffers to write in order; ``nbytes`` is their total.

    The buffers are views of the caller's tensors: keep the tensors unchanged until the
    batch is written. ``buffers[0]`` is the header. A batch encoded with
    ``defer_checksum=True`` hashes its tensors in the background from ``start_checksum``
    on, while a store writes ``buffers[1:]``; ``finish`` completes the hash and writes it
    into the header, so a store that can write the header last overlaps hashing with I/O.
    ``tobytes``, ``write_into`` and ``checksum`` finish first by themselves.
    """

    def __init__(self, buffers: list[Buffer], nbytes: int, views: list[memoryview], keep: list[torch.Tensor],
                 checksum_at: int) -> None:
        self.buffers = buffers
        self.nbytes = nbytes
        self._fields = {id(v) for v in views}  # which of ``buffers`` are hashed (the rest is padding)
        self._hasher = _Hasher(views, HASH_CHUNK)
        self._keep = keep
        self._checksum_at = checksum_at
        self._checksum: int | None = None

    def start_checksum(self) -> None:
        """Begin hashing in background threads (no-op once started or finished)."""
        if self._checksum is None:
            self._hasher.start(max(1, MAX_HASH_THREADS - 1))

    def finish(self) -> int:
        """Complete the checksum (helping the background threads) and write it into the header."""
        if self._checksum is None:
            self._set_checksum(self._hasher.result())
        assert self._checksum is not None
        return self._checksum

    def _set_checksum(self, value: int) -> None:
        header = self.buffers[0]
        assert isinstance(header, bytearray)
        header[self._checksum_at:self._checksum_at + 8] = value.to_bytes(8, "little")
        self._checksum = value

    @property
    def checksum(self) -> int:
        return self.finish()

    def unhashed_header(self) -> bytearray:
        """A copy of the header that says ``FLAG_UNHASHED`` (its checksum left zero), for a store whose
        segment the kernel seals: the batch is then written without hashing it."""
        header = bytearray(self.buffers[0])
        _FLAGS.pack_into(header, _FLAGS_AT, FLAG_UNHASHED)
        return header

    def tobytes(self) -> bytes:
        """One contiguous copy (for tests and small batches)."""
        self.finish()
        return b"".join(self.buffers)

    def write_into(self, out: Any, offset: int = 0) -> None:
        """Copy the batch into the writable buffer ``out`` at ``offset``: the tensor bytes first, the
        header last, each byte read once. Each ``HASH_CHUNK`` piece is copied ``COPY_STEP`` bytes at a
        time and each step hashed (streaming xxh3) from ``out`` right after it is copied, while it is
        still in the core's cache; pieces are shared out among up to ``MAX_HASH_THREADS`` threads (the
        caller and helpers; numpy's copy and xxhash release the GIL). Returns only once no helper
        touches ``out`` any more. A batch whose hash already started (``start_checksum``) or finished
        is copied and its hash finished as it is."""
        dst = np.frombuffer(out, dtype=np.uint8)
        pos = offset + len(self.buffers[0])
        if self._checksum is not None or self._hasher._started:
            for buf in self.buffers[1:]:
                src = np.frombuffer(buf, dtype=np.uint8)
                np.copyto(dst[pos:pos + src.nbytes], src)
                pos += src.nbytes
            self.finish()
        else:
            pieces: list[tuple[np.ndarray, np.ndarray]] = []
            for buf in self.buffers[1:]:
                src = np.frombuffer(buf, dtype=np.uint8)
                if id(buf) not in self._fields:  # alignment padding: not hashed
                    np.copyto(dst[pos:pos + src.nbytes], src)
                else:
                    pieces += [(dst[pos + i:pos + min(i + HASH_CHUNK, src.nbytes)], src[i:i + HASH_CHUNK])
                               for i in range(0, src.nbytes, HASH_CHUNK)]
                pos += src.nbytes
            self._set_checksum(_combine(_copy_and_hash(pieces, self.nbytes)))
        dst[offset:offset + len(self.buffers[0])] = np.frombuffer(self.buffers[0], dtype=np.uint8)


COPY_STEP = 256 << 10
"""Bytes copied and then hashed at a time by ``EncodedBatch.write_into``: small enough to be hashed
from the core's own cache (L2) right after the copy."""


def _copy_piece(dst: np.ndarray, src: np.ndarray) -> int:
    """Copy ``src`` into ``dst`` ``COPY_STEP`` bytes at a time, hashing each step from ``dst`` as copied:
    the digest of the whole piece (streaming xxh3-64 equals the one-shot digest)."""
    h = xxhash.xxh3_64()
    for i in range(0, src.nbytes, COPY_STEP):
        step = dst[i:i + COPY_STEP]
        np.copyto(step, src[i:i + COPY_STEP])
        h.update(step.data)
    return h.intdigest()


def _copy_and_hash(pieces: list[tuple[np.ndarray, np.ndarray]], nbytes: int) -> list[int]:
    """Digests of ``pieces`` (destination, source) copied by ``_copy_piece``, taken in turn by the caller
    and, for a large batch, helper threads. Once the caller has no piece left to take it closes the
    work: a helper not yet scheduled then exits without touching anything (no wait for it), and the
    caller waits only for helpers in the middle of a piece (one still copying when the buffer is
    handed on would write into it later)."""
    digests: list[int] = [0] * len(pieces)
    taken = itertools.count()
    failed: list[BaseException] = []
    lock = threading.Lock()
    idle = threading.Condition(lock)
    state = {"closed": False, "active": 0}

    def work(helper: bool) -> None:
        while True:
            with lock:
                if state["closed"]:
                    return
                i = next(taken)
                if i >= len(pieces):
                    return
                if helper:
                    state["active"] += 1
            try:
                digests[i] = _copy_piece(*pieces[i])
            except BaseException as exc:  # noqa: BLE001 - raised in the caller
                failed.append(exc)
                return
            finally:
                if helper:
                    with lock:
                        state["active"] -= 1
                        idle.notify_all()

    if nbytes >= PARALLEL_HASH_MIN_BYTES and MAX_HASH_THREADS > 1:
        for _ in range(min(MAX_HASH_THREADS - 1, len(pieces) - 1)):
            _thread.start_new_thread(work, (True,))  # not threading.Thread: its start() waits for the thread
    try:
        work(False)
    finally:
        with lock:
            state["closed"] = True
            while state["active"]:
                idle.wait()
    if failed:
        raise failed[0]
    return digests


def _bytes_view(t: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """A byte memoryview of ``t``'s memory; a non-contiguous or non-CPU tensor is copied first."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8)
    return raw.numpy().data.cast("B"), raw


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def encode(tensors: Mapping[str, torch.Tensor | Ragged], meta: Mapping[str, Any] | None = None, *,
           max_bytes: int = DEFAULT_MAX_BYTES, defer_checksum: bool = False) -> EncodedBatch:
    """Encode named tensors (and ragged fields) and a small msgpack-able ``meta`` map.

    Raises ``PayloadTooLarge`` (before hashing or touching any store) when the encoded batch
    would exceed ``max_bytes``, and ``InvalidRequest`` for unsupported dtypes or meta. With
    ``defer_checksum`` the hash is left to ``EncodedBatch.start_checksum``/``finish``.
    """
    parts: list[tuple[str, str | None, torch.Tensor]] = []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"field names must be non-empty strings, got {name!r}")
        if isinstance(value, Ragged):
            if value.offsets.dtype != torch.int64 or value.offsets.dim() != 1:
                raise InvalidRequest(f"{name}: ragged offsets must be a 1-D int64 tensor")
            parts += [(name, "values", value.values), (name, "offsets", value.offsets)]
        elif isinstance(value, torch.Tensor):
            parts.append((name, None, value))
        else:
            raise InvalidRequest(f"{name}: expected a tensor or Ragged, got {type(value).__name__}")

    records: list[dict[str, Any]] = []
    views: list[memoryview] = []
    keep: list[torch.Tensor] = []
    offset = 0
    for name, role, t in parts:
        if t.dtype not in _DTYPE_NAMES:
            raise InvalidRequest(f"{name}: dtype {t.dtype} is not supported; use one of {sorted(DTYPES)}")
        nbytes = t.numel() * t.element_size()
        offset = _align(offset)
        record: dict[str, Any] = {"name": name, "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                                  "offset": offset, "nbytes": nbytes}
        if role is not None:
            record["ragged"] = role
        records.append(record)
        offset += nbytes
    data_nbytes = offset

    try:
        meta_obj = dict(meta or {})
        probe = msgpack.packb(meta_obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRequest(f"batch meta must be msgpack-serialisable (str keys, plain values): {exc}") from None
    estimate = _PREFIX.size + len(probe) + 64 * (len(records) + 1) + ALIGN + data_nbytes
    if estimate > max_bytes:
        raise PayloadTooLarge(
            f"batch of {data_nbytes / 2**20:.1f} MiB of tensors (+{len(probe)} bytes of meta) exceeds the "
            f"{max_bytes / 2**20:.1f} MiB limit (max_bytes={max_bytes}): split it or raise the limit")

    for _, _, t in parts:
        view, raw = _bytes_view(t)
        views.append(view)
        keep.append(raw)
    # the checksum is the map's last entry, a fixed-size bin: its 8 bytes end the msgpack header
    header = msgpack.packb({"meta": meta_obj, "fields": records, "data_nbytes": data_nbytes,
                            "hash_chunk": HASH_CHUNK, "checksum": bytes(8)}, use_bin_type=True)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header)) + header
    head_nbytes = _align(len(prefix))
    buffers: list[Buffer] = [bytearray(prefix + bytes(head_nbytes - len(prefix)))]
    pos = 0
    for record, view in zip(records, views, strict=True):
        if record["offset"] > pos:
            buffers.append(_ZEROS[:record["offset"] - pos])
        if view.nbytes:
            buffers.append(view)
        pos = record["offset"] + record["nbytes"]
    nbytes = head_nbytes + data_nbytes
    if nbytes > max_bytes:
        raise PayloadTooLarge(f"encoded batch of {nbytes} bytes exceeds max_bytes={max_bytes}")
    batch = EncodedBatch(buffers, nbytes, views, keep, len(prefix) - 8)
    if not defer_checksum:
        batch.finish()
    return batch


# --- layout for batches built in place ------------------------------------------------------

@dataclass(frozen=True)
class RaggedSpec:
    """A ragged field to allocate: ``rows`` rows over ``values`` elements of ``dtype`` (``values_shape``
    when each element is itself a tensor)."""

    values: int
    rows: int
    dtype: torch.dtype
    values_shape: tuple[int, ...] = ()


FieldSpec = tuple[Sequence[int], torch.dtype] | RaggedSpec
"""A field to allocate: ``(shape, dtype)`` of a tensor, or a ``RaggedSpec``."""


@dataclass(frozen=True)
class Layout:
    """Where each field of a batch goes before any tensor exists: ``head`` (prefix, header, padding)
    starts the buffer, each part of a field lies at its absolute ``offset``; ``nbytes`` in all. The
    header says ``FLAG_UNHASHED``: such a batch is for a store whose segment the kernel seals."""

    head: bytes
    parts: tuple[tuple[str, str | None, torch.dtype, tuple[int, ...], int, int], ...]
    nbytes: int

    def tensors(self, buffer: Any) -> dict[str, torch.Tensor | Ragged]:
        """The fields as tensors over ``buffer`` (writable, at least ``nbytes`` long), ragged ones as ``Ragged``."""
        mv = memoryview(buffer).cast("B")
        out: dict[str, torch.Tensor | Ragged] = {}
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, role, dtype, shape, offset, nbytes in self.parts:
            if nbytes:
                t = torch.frombuffer(mv, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset).view(shape)
            else:
                t = torch.empty(shape, dtype=dtype)
            if role is None:
                out[name] = t
            else:
                halves.setdefault(name, {})[role] = t
        for name, h in halves.items():
            out[name] = Ragged(h["values"], h["offsets"])
        return out


def layout(fields: Mapping[str, FieldSpec], meta: Mapping[str, Any] | None = None, *,
           max_bytes: int = DEFAULT_MAX_BYTES) -> Layout:
    """The layout of a batch of ``fields`` and ``meta``, to be filled in place and never hashed.

    Raises ``PayloadTooLarge`` over ``max_bytes`` and ``InvalidRequest`` for bad names, shapes or dtypes.
    """
    parts: list[tuple[str, str | None, torch.dtype, tuple[int, ...]]] = []
    for name, spec in fields.items():
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"field names must be non-empty strings, got {name!r}")
        if isinstance(spec, RaggedSpec):
            if spec.values < 0 or spec.rows < 0 or any(d < 0 for d in spec.values_shape):
                raise InvalidRequest(f"{name}: negative size in {spec}")
            parts += [(name, "values", spec.dtype, (spec.values, *spec.values_shape)),
                      (name, "offsets", torch.int64, (spec.rows + 1,))]
        elif isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], torch.dtype):
            shape = tuple(spec[0])
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise InvalidRequest(f"{name}: bad shape {spec[0]!r}")
            parts.append((name, None, spec[1], shape))
        else:
            raise InvalidRequest(f"{name}: expected (shape, dtype) or a RaggedSpec, got {spec!r}")
    records: list[dict[str, Any]] = []
    offset = 0
    for name, role, dtype, shape in parts:
        if dtype not in _DTYPE_NAMES:
            raise InvalidRequest(f"{name}: dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        offset = _align(offset)
        record: dict[str, Any] = {"name": name, "dtype": _DTYPE_NAMES[dtype], "shape": list(shape),
                                  "offset": offset, "nbytes": math.prod(shape) * dtype.itemsize}
        if role is not None:
            record["ragged"] = role
        records.append(record)
        offset += record["nbytes"]
    try:
        header = msgpack.packb({"meta": dict(meta or {}), "fields": records, "data_nbytes": offset,
                                "hash_chunk": HASH_CHUNK, "checksum": bytes(8)}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRequest(f"batch meta must be msgpack-serialisable (str keys, plain values): {exc}") from None
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, FLAG_UNHASHED, len(header)) + header
    head_nbytes = _align(len(prefix))
    nbytes = head_nbytes + offset
    if nbytes > max_bytes:
        raise PayloadTooLarge(f"batch of {nbytes / 2**20:.1f} MiB exceeds the {max_bytes / 2**20:.1f} MiB limit "
                              f"(max_bytes={max_bytes}): split it or raise the limit")
    placed = tuple((name, role, dtype, shape, head_nbytes + r["offset"], r["nbytes"])
                   for (name, role, dtype, shape), r in zip(parts, records, strict=True))
    return Layout(prefix + bytes(head_nbytes - len(prefix)), placed, nbytes)


# --- checksum ----------------------------------------------------------------------------

def checksum_views(views: Sequence[memoryview], chunk: int = HASH_CHUNK, release_wait_s: float = 0.0) -> int:
    """xxh3-64 over the xxh3-64 digests of each field's bytes cut into ``chunk``-byte pieces.

    ``release_wait_s``: how long to wait for helper threads to let go of the views (``_Hasher``)."""
    hasher = _Hasher(views, chunk, release_wait_s)
    if hasher.nbytes >= PARALLEL_HASH_MIN_BYTES and MAX_HASH_THREADS > 1:
        hasher.start(MAX_HASH_THREADS - 1)
    return hasher.result()


class _Hasher:
    """Digests of pieces, taken in turn by helper threads and by the thread asking for the result.

    ``result`` never waits for a helper's hash: once no piece is left to take, it hashes itself
    any piece a helper has not finished (a helper descheduled on a busy machine costs at most
    that piece twice, never a scheduler time slice), and helpers stop taking pieces. When asked
    (``release_wait_s``, at decode) it then gives helpers that long to let go of the piece they
    hold: a view kept alive by a helper keeps the hashed buffer alive (a reader's mapping of a shm
    segment, whose lock then keeps it from being recycled when the batch is released right after
    decoding, so the next batch pays for a fresh segment: 30-100 ms of page allocation against
    a wait that is only long when a helper was descheduled mid-piece).
    """

    def __init__(self, views: Sequence[memoryview], chunk: int, release_wait_s: float = 0.0) -> None:
        self.pieces = [v[i:i + chunk] for v in views for i in range(0, v.nbytes, chunk)]
        self.nbytes = sum(v.nbytes for v in views)
        self.digests: list[int | None] = [None] * len(self.pieces)
        self._next = itertools.count()
        self._done = threading.Event()
        self._started = False
        self._exits: list[threading.Event] = []
        self._release_wait_s = release_wait_s

    def start(self, threads: int) -> None:
        if self._started:
            return
        self._started = True
        for _ in range(min(threads, len(self.pieces))):
            exited = threading.Event()
            self._exits.append(exited)
            _thread.start_new_thread(self._helper, (exited,))  # not threading.Thread: start() waits for the thread

    def _helper(self, exited: threading.Event) -> None:
        try:
            self._work()
        finally:
            exited.set()

    def _work(self) -> None:
        pieces, digests = self.pieces, self.digests
        while not self._done.is_set():
            i = next(self._next)
            try:
                piece = pieces[i]
            except IndexError:  # none left, or ``result`` has emptied the list
                return
            digests[i] = xxhash.xxh3_64_intdigest(piece)
            del piece

    def result(self) -> int:
        self._work()
        self._done.set()
        out = [d if d is not None else xxhash.xxh3_64_intdigest(p) for d, p in zip(self.digests, self.pieces,
                                                                                  strict=True)]
        # drop the views now: a helper thread not yet scheduled holds this object, and through the views
        # the buffer hashed (a reader's mapping of a shm segment, which stays locked while it lives)
        self.pieces.clear()
        deadline = time.monotonic() + self._release_wait_s
        for exited in self._exits if self._release_wait_s > 0 else ():
            if not exited.wait(max(0.0, deadline - time.monotonic())):
                break
        return _combine(out)


def _combine(digests: Sequence[int]) -> int:
    """The batch checksum from the digests of its pieces, in order."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))


# --- decoding ----------------------------------------------------------------------------

@dataclass
class Batch:
    """A decoded batch; tensors share memory with the buffer it was decoded from."""

    tensors: dict[str, torch.Tensor]
    ragged: dict[str, Ragged]
    meta: dict[str, Any]
    nbytes: int
    checksum: int

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def rows(self, name: str) -> Ragged:
        return self.ragged[name]


def decode(buffer: Any, *, verify: bool = True) -> Batch:
    """Decode a batch; raises ``ChecksumMismatch`` or ``DecodeError`` and nothing else.

    ``buffer`` is anything with the buffer protocol (bytes, bytearray, memoryview, mmap,
    numpy array). Tensors decoded from a read-only buffer must not be written to.
    """
    try:
        return _decode(buffer, verify)
    except DecodeError:
        raise
    except Exception as exc:  # a decoder lets nothing but DecodeError escape
        raise DecodeError(f"malformed batch: {type(exc).__name__}: {exc}") from None


def _fail(reason: str) -> DecodeError:
    return DecodeError(f"malformed batch: {reason}")


def _decode(buffer: Any, verify: bool) -> Batch:
    mv = memoryview(buffer)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    total = mv.nbytes
    if total < _PREFIX.size:
        raise _fail(f"{total} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, flags, header_len = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise _fail(f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise _fail(f"format version {version}, this decoder reads {FORMAT_VERSION}")
    if _PREFIX.size + header_len > total:
        raise _fail(f"header of {header_len} bytes runs past the end ({total} bytes)")
    header = msgpack.unpackb(mv[_PREFIX.size:_PREFIX.size + header_len], raw=False, strict_map_key=False)
    if not isinstance(header, dict):
        raise _fail("header is not a map")
    meta, records = header.get("meta"), header.get("fields")
    if not isinstance(meta, dict) or not isinstance(records, list):
        raise _fail("header lacks meta or fields")
    data_nbytes, hash_chunk = _uint(header, "data_nbytes"), _uint(header, "hash_chunk")
    raw_sum = header.get("checksum")
    if not isinstance(raw_sum, bytes) or len(raw_sum) != 8:
        raise _fail("checksum must be 8 bytes")
    checksum = int.from_bytes(raw_sum, "little")
    if hash_chunk < 4096 or hash_chunk & (hash_chunk - 1):
        raise _fail(f"hash_chunk {hash_chunk} is not a power of two >= 4096")
    data_start = _align(_PREFIX.size + header_len)
    if data_start + data_nbytes != total:
        raise _fail(f"expected {data_start + data_nbytes} bytes, got {total} (truncated or padded)")
    data = mv[data_start:]

    readonly = mv.readonly
    fields = [_field(r, data_nbytes) for r in records]
    if verify and flags & FLAG_UNHASHED:
        raise ChecksumMismatch("batch carries no checksum (it was built in place for a kernel-sealed segment): "
                               "it can be read unverified only from a segment whose seals the reader checked")
    if verify:
        actual = checksum_views([data[f.offset:f.offset + f.nbytes] for f in fields], hash_chunk,
                                HELPER_EXIT_WAIT_S)
        if actual != checksum:
            raise ChecksumMismatch(f"batch checksum mismatch: header says {checksum:#018x}, bytes hash to "
                                   f"{actual:#018x} (corrupted or truncated payload)")
    tensors: dict[str, torch.Tensor] = {}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for f in fields:
        t = _tensor(mv, data_start + f.offset, f, readonly)
        if f.ragged is None:
            if f.name in tensors or f.name in halves:
                raise _fail(f"duplicate field {f.name!r}")
            tensors[f.name] = t
        else:
            slot = halves.setdefault(f.name, {})
            if f.name in tensors or f.ragged in slot:
                raise _fail(f"duplicate field {f.name!r}")
            slot[f.ragged] = t
    ragged = {name: _ragged(name, parts) for name, parts in halves.items()}
    return Batch(tensors, ragged, meta, total, checksum)


@dataclass(frozen=True)
class _Field:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    ragged: str | None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _uint(record: dict[Any, Any], key: str) -> int:
    value = record.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _fail(f"{key} must be a non-negative integer, got {value!r}")
    return value


def _field(r: Any, data_nbytes: int) -> _Field:
    if not isinstance(r, dict):
        raise _fail("field record is not a map")
    name, dtype, shape, ragged = r.get("name"), r.get("dtype"), r.get("shape"), r.get("ragged")
    if not isinstance(name, str) or not name:
        raise _fail("field without a name")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _fail(f"{name}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > 32 or not all(_is_int(d) for d in shape):
        raise _fail(f"{name}: bad shape {shape!r}")
    offset, nbytes = _uint(r, "offset"), _uint(r, "nbytes")
    if offset + nbytes > data_nbytes:
        raise _fail(f"{name}: bytes [{offset}, +{nbytes}) outside the {data_nbytes}-byte data section")
    tdtype = DTYPES[dtype]
    if math.prod(shape) * tdtype.itemsize != nbytes:
        raise _fail(f"{name}: shape {shape} of {dtype} is not {nbytes} bytes")
    if ragged not in (None, "values", "offsets"):
        raise _fail(f"{name}: bad ragged role {ragged!r}")
    return _Field(name, tdtype, tuple(shape), offset, nbytes, ragged)


def _tensor(mv: memoryview, offset: int, f: _Field, readonly: bool) -> torch.Tensor:
    if f.nbytes == 0:
        return torch.empty(f.shape, dtype=f.dtype)
    count = f.nbytes // f.dtype.itemsize
    if readonly:  # torch warns once about read-only buffers; the caller was told not to write
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(mv, dtype=f.dtype, count=count, offset=offset)
    else:
        flat = torch.frombuffer(mv, dtype=f.dtype, count=count, offset=offset)
    return flat.view(f.shape)


def _ragged(name: str, parts: dict[str, torch.Tensor]) -> Ragged:
    values, offsets = parts.get("values"), parts.get("offsets")
    if values is None or offsets is None:
        raise _fail(f"{name}: ragged field lacks its values or offsets")
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.shape[0] < 1 or values.dim() < 1:
        raise _fail(f"{name}: ragged offsets must be 1-D int64 over values of at least 1 dimension")
    if int(offsets[0]) != 0 or int(offsets[-1]) != values.shape[0] or bool((offsets[1:] < offsets[:-1]).any()):
        raise _fail(f"{name}: ragged offsets are not a non-decreasing run from 0 to {values.shape[0]}")
    return Ragged(values, offsets)
