"""Reading a log file's msgpack records with bounded cost, whatever the file holds.

A log file is untrusted input (it may come from anywhere, and ``import`` writes it into Redis).
msgpack turns every byte of a record into a Python object of 50-100 bytes, so an 8 MiB record of
empty maps costs over 500 MiB once unpacked. ``RecordReader`` therefore walks each record's
msgpack structure first, without building anything, and unpacks it only when the walk stayed
within ``ReadLimits``: at most ``max_record_bytes`` bytes, ``max_objects`` objects and
``max_depth`` levels of nesting, no extension types. Unpacking then costs at most the record's
bytes plus ``max_objects`` small objects. The ``check_*`` helpers turn a record's fields into
typed values or a one-line ``DecodeError`` naming what is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import IO, Any

import msgpack

from rollout_bus.events.batch import DEFAULT_MAX_BYTES
from rollout_bus.events.errors import DecodeError

PART_BYTES = 16 << 20
"""The writer cuts payloads in parts of at most this many bytes."""
MAX_U64 = (1 << 64) - 1
_ID_RE = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
_READ_BYTES = 1 << 20


@dataclass(frozen=True)
class ReadLimits:
    """What one record may cost to read."""

    max_record_bytes: int = PART_BYTES + (1 << 20)
    """The writer's largest record is a payload part (``PART_BYTES`` of data and a few small fields); an
    entry is at most an event (``MAX_EVENT_BYTES``, 1 MiB) or a dead letter wrapping one."""
    max_objects: int = 1 << 16
    """Objects (scalars and containers) in one record: a header of a thousand streams stays far below."""
    max_depth: int = 16
    """Nesting of containers: the deepest record the writer makes (a header's group) is 4 levels."""
    max_payload_bytes: int = DEFAULT_MAX_BYTES
    """A batch's payload, all parts together (the bus's default maximum batch size)."""


class OutOfData(Exception):
    """The file ends before the record does (a cut or still-growing file)."""


class RecordReader:
    """Yields the records of a file one at a time (``next``: None at a clean end of file)."""

    def __init__(self, file: IO[bytes], limits: ReadLimits) -> None:
        self._file = file
        self.limits = limits
        self._buf = bytearray()
        self._pos = 0

    def next(self) -> Any:
        """The next record, unpacked; None at the end of the file; ``OutOfData`` for a cut record."""
        if self._pos:
            del self._buf[:self._pos]
            self._pos = 0
        try:
            self._need(1)
        except OutOfData:
            return None
        self._walk()
        raw = memoryview(self._buf)[:self._pos]
        n = self.limits.max_objects
        try:
            return msgpack.unpackb(raw, raw=False, strict_map_key=False, max_array_len=n, max_map_len=n,
                                   max_bin_len=self.limits.max_record_bytes,
                                   max_str_len=self.limits.max_record_bytes, max_ext_len=0)
        except Exception as exc:
            raise DecodeError(f"not a msgpack record: {type(exc).__name__}: {exc}") from None
        finally:
            raw.release()

    # --- the walk ------------------------------------------------------------------------
    def _need(self, n: int) -> None:
        """Make sure ``n`` bytes from the current position are in the buffer, within the record limit."""
        if self._pos + n > self.limits.max_record_bytes:
            raise DecodeError(f"record of more than {self.limits.max_record_bytes} bytes (the limit)")
        while len(self._buf) - self._pos < n:
            chunk = self._file.read(max(n - (len(self._buf) - self._pos), _READ_BYTES))
            if not chunk:
                raise OutOfData
            self._buf += chunk

    def _ensure(self, pos: int, n: int) -> None:
        """Make sure bytes ``[pos, pos + n)`` of the record are in the buffer."""
        self._pos = pos
        self._need(n)

    def _walk(self) -> None:
        """Step over one msgpack object (and everything in it), counting objects and depth; leaves the
        position at the record's end. Hot: locals only, the buffer refilled only when a read runs past it."""
        max_objects, max_depth = self.limits.max_objects, self.limits.max_depth
        buf = self._buf  # grows in place (``+=``), so this stays the buffer
        pos = self._pos
        remaining = [1]  # objects left at each open level; the first is the record itself
        objects = 0
        while remaining:
            if remaining[-1] == 0:
                remaining.pop()
                continue
            remaining[-1] -= 1
            objects += 1
            if objects > max_objects:
                raise DecodeError(f"record of more than {max_objects} objects (the limit)")
            if pos >= len(buf):
                self._ensure(pos, 1)
            tag = buf[pos]
            pos += 1
            children = skip = 0
            if tag <= 0x7F or tag >= 0xE0 or tag in (0xC0, 0xC2, 0xC3):
                continue
            if 0x80 <= tag <= 0x9F:
                children = (tag & 0x0F) * (2 if tag <= 0x8F else 1)
            elif 0xA0 <= tag <= 0xBF:
                skip = tag & 0x1F
            elif tag in _FIXED:
                skip = _FIXED[tag]
            else:
                width = _SIZED.get(tag) or _COUNTED.get(tag)
                if width is None:
                    raise DecodeError(f"msgpack type {tag:#04x} (an extension type, or none) is not used in logs")
                if pos + width > len(buf):
                    self._ensure(pos, width)
                value = int.from_bytes(buf[pos:pos + width], "big")
                pos += width
                if tag in _SIZED:
                    skip = value
                else:
                    children = value * (2 if tag >= 0xDE else 1)
            if skip:
                if pos + skip > len(buf):
                    self._ensure(pos, skip)
                pos += skip
            if children:
                if len(remaining) > max_depth:
                    raise DecodeError(f"record nested deeper than {max_depth} levels (the limit)")
                remaining.append(children)
        if pos > self.limits.max_record_bytes:  # the walk stayed within bytes read ahead: checked at its end
            raise DecodeError(f"record of more than {self.limits.max_record_bytes} bytes (the limit)")
        self._pos = pos


_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
"""bin and str: the width of their length, then that many bytes."""
_COUNTED = {0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}
"""array and map: the width of their count (of items, of pairs)."""
_FIXED = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
"""floats and sized ints: their width."""


# --- field checks ------------------------------------------------------------------------------

def check_id(value: Any, what: str = "entry id") -> str:
    """A stream entry id Redis can hold: ``<ms>-<seq>``, both below 2**64, greater than ``0-0``."""
    match = _ID_RE.fullmatch(value) if isinstance(value, str) else None
    if match is None or int(match[1]) > MAX_U64 or int(match[2]) > MAX_U64 or int(match[1]) == int(match[2]) == 0:
        raise DecodeError(f"{what} {value!r} is not a stream entry id ('<ms>-<seq>', each below 2**64, above 0-0)")
    return value


def typed(record: dict[Any, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``record[name]`` when it is of ``kind`` (an int is never a bool); ``DecodeError`` otherwise."""
    if name not in record:
        raise DecodeError(f"{where} has no {name!r}")
    value = record[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise DecodeError(f"{where}: {name!r} must be {names}, got {type(value).__name__}")
    return value


def check_fields(value: Any, where: str) -> dict[Any, Any]:
    """An entry's fields: a map of bytes (or text) to bytes (or text), as a stream holds them."""
    if not isinstance(value, dict) or not all(isinstance(k, bytes | str) and isinstance(v, bytes | str)
                                              for k, v in value.items()):
        raise DecodeError(f"{where}: 'fields' must be a map of bytes to bytes")
    return value
