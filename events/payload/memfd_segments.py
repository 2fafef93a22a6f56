"""How the memfd store gets its segments: fresh ones, huge pages, and a pool prepared ahead of need.

A segment is a sealable memfd with every page allocated and mapped writable (``new_segment``). Its
pages cost the kernel an allocation, zeroing and a page-table entry each, which a batch written into a
fresh segment waits for. ``SegmentPool`` moves that work off the batch's path: a thread of the lowest
priority keeps a few segments ready, each a fresh memfd that only this process holds and that is
handed out once, then sealed as any other (``F_SEAL_WRITE``: the guarantee is unchanged; no segment
is ever written again after sealing). Huge pages (``MFD_HUGETLB``, 512 times fewer pages to allocate
and map) are used where the administrator reserved enough of them (``vm.nr_hugepages``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from rollout_bus.events.errors import InvalidRequest

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def new_memfd(label: str, *, huge: bool = False) -> int:
    """A fresh, empty, sealable memfd named ``rollout-bus:<label>`` (as ``/proc`` shows it); ``huge``: backed
    by huge pages (``MFD_HUGETLB``: its size must be a multiple of ``huge_page_bytes()``, and it takes no
    ``write``, only mappings)."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if huge else 0)
    return os.memfd_create(f"rollout-bus:{label}", flags)


def new_segment(label: str, nbytes: int, *, huge: bool = False) -> tuple[int, mmap.mmap]:
    """A fresh sealable memfd of ``nbytes`` (see ``new_memfd``; rounded up to a huge page when ``huge``) and a
    writable shared mapping of it, every page allocated, zeroed and mapped (``populate``)."""
    size = round_up(nbytes, huge_page_bytes()) if huge else nbytes
    fd = new_memfd(label, huge=huge)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    try:
        populate(mm)
    except BaseException:
        mm.close()
        os.close(fd)
        raise
    return fd, mm


def populate(mm: mmap.mmap) -> None:
    """Allocate and map every page of a writable shared mapping in one call (``MADV_POPULATE_WRITE``, Linux
    5.14+; where the kernel lacks it, each page is faulted in when first written), without holding the GIL
    (``mmap.madvise`` holds it: tens of milliseconds for 64 MiB, which would stall every other thread of a
    producer while its pool prepares a segment). ``fallocate`` first, or ``MAP_POPULATE``, cost as much
    or more here. ``OSError`` when the pages cannot be had (``ENOMEM``): better now than a fault later."""
    if not len(mm):
        return
    anchor = ctypes.c_char.from_buffer(mm)  # the mapping's address; the export ends with ``anchor``
    address = ctypes.addressof(anchor)
    del anchor
    if _libc.madvise(address, len(mm), MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:  # EINVAL: a kernel before 5.14, whose pages fault in as they are written
            raise OSError(err, os.strerror(err))


def round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def huge_page_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The default huge page size (``Hugepagesize``), 2 MiB where the file does not say."""
    return _meminfo(meminfo).get("Hugepagesize", 2048) << 10


def huge_pages_free(meminfo: str = "/proc/meminfo") -> tuple[int, str]:
    """Bytes of default-size huge pages free for a new segment (free and not reserved), with the reason
    when there are none."""
    info = _meminfo(meminfo)
    total, free, reserved = info.get("HugePages_Total", 0), info.get("HugePages_Free", 0), info.get("HugePages_Rsvd", 0)
    available = max(0, free - reserved) * (info.get("Hugepagesize", 2048) << 10)
    if total == 0:
        return 0, "no huge pages are reserved (HugePages_Total is 0: vm.nr_hugepages)"
    if not available:
        return 0, f"all {total} reserved huge pages are in use"
    return available, ""


def _meminfo(path: str) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            words = rest.split()
            if words and words[0].isdigit():
                out[name] = int(words[0])
    return out


def trim(fd: int, nbytes: int) -> None:
    """Cut an unsealed segment down to ``nbytes`` (a huge-page segment to the huge page that holds them),
    freeing the pages past them (a pooled segment may be larger than its batch)."""
    st = os.fstat(fd)
    size = round_up(nbytes, st.st_blksize) if st.st_blksize > mmap.PAGESIZE else nbytes
    if st.st_size > size:
        os.ftruncate(fd, size)


@dataclass(frozen=True)
class MemfdSettings:
    """How a memfd store gets its segments: a pool prepared ahead of need, and huge pages."""

    pool_segments: int = 2
    """Segments prepared ahead of need at most (0: no pool; every batch then waits for fresh pages)."""
    pool_max_bytes: int = 512 << 20
    """The most memory the prepared segments hold together; a batch larger than this is never prepared."""
    pool_history: int = 4
    """A prepared segment is as large as the largest of the last this many batches."""
    pool_after: int = 2
    """Batches seen before the pool starts preparing (a one-off batch leaves no pool memory behind)."""
    huge_pages: Literal["auto", "never"] = "auto"
    """``auto``: back a segment with huge pages (``MFD_HUGETLB``) when enough are free; ``never``."""

    def __post_init__(self) -> None:
        if min(self.pool_segments, self.pool_max_bytes, self.pool_after) < 0 or self.pool_history < 1:
            raise InvalidRequest(f"memfd settings out of range: {self}")
        if self.huge_pages not in ("auto", "never"):
            raise InvalidRequest(f"memfd huge_pages={self.huge_pages!r}: use auto or never")


def use_huge_pages(settings: MemfdSettings, nbytes: int) -> tuple[bool, str]:
    """Whether a segment of ``nbytes`` gets huge pages, and why not when it does not."""
    if settings.huge_pages == "never":
        return False, "huge_pages=never"
    free, reason = huge_pages_free()
    if reason:
        return False, reason
    need = round_up(nbytes, huge_page_bytes())
    if need > free:
        return False, f"{need} bytes of huge pages needed, {free} free"
    return True, ""


def fits(size: int, nbytes: int) -> bool:
    """Whether a segment of ``size`` bytes may take a batch of ``nbytes``: large enough, and not so large
    that trimming it frees more than it keeps."""
    return nbytes <= size <= max(2 * nbytes, nbytes + (2 << 20))


@dataclass
class Prepared:
    """A segment made ahead of need: a fresh memfd, sized, every page allocated and mapped writable."""

    fd: int
    mm: mmap.mmap
    label: str

    @property
    def size(self) -> int:
        return len(self.mm)

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)


@dataclass
class PoolStats:
    hits: int = 0
    """Batches that took a prepared segment."""
    misses: int = 0
    """Batches that found none that fits and made a fresh one."""
    prepared: int = 0
    prepare_s: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    """Seconds each of the last preparations took (off the critical path)."""


class SegmentPool:
    """A few segments created, sized and populated ahead of need by a thread of the lowest priority.

    ``take`` records the batch's size and hands out the smallest prepared segment that ``fits`` it, or
    None (the caller makes a fresh one). Once ``pool_after`` batches were seen, the thread fills the
    pool up to ``pool_segments`` segments, each as large as the largest of the last ``pool_history``
    batches, never holding more than ``pool_max_bytes`` (prepared and being prepared together). It
    refills after each batch is published (``refill``), or at once when ``take`` found nothing, not
    while a batch is being written into a segment it took: the kernel's work for fresh pages would
    compete with the batch for the cores and for this process's memory map. Segments that no longer
    fit those batches, or that carry another label (the store's segment server changed), are freed.
    ``close`` frees every prepared segment and stops the thread. A prepared segment is a fresh memfd
    that only this process holds; a taken one is never prepared again.
    """

    def __init__(self, settings: MemfdSettings) -> None:
        self.settings = settings
        self.stats = PoolStats()
        self.huge_reason = ""
        """Why the last prepared segment got no huge pages ("" when it did, or none was prepared)."""
        self._cond = threading.Condition()
        self._ready: list[Prepared] = []
        self._sizes: deque[int] = deque(maxlen=settings.pool_history)
        self._seen = 0
        self._label = ""
        self._preparing = 0
        self._stalled = False
        self._wanted = False
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def held_bytes(self) -> int:
        """Bytes of the prepared segments and of the one being prepared."""
        with self._cond:
            return sum(r.size for r in self._ready) + self._preparing

    @property
    def ready(self) -> int:
        with self._cond:
            return len(self._ready)

    def take(self, label: str, nbytes: int) -> Prepared | None:
        with self._cond:
            if self._closed or self.settings.pool_segments == 0:
                return None
            if label != self._label:
                self._free(self._ready)
                self._label = label
            self._sizes.append(round_up(nbytes, mmap.PAGESIZE))
            self._seen += 1
            self._stalled = False
            usable = [r for r in self._ready if fits(r.size, nbytes)]
            best = min(usable, key=lambda r: r.size) if usable else None
            if best is None:
                self.stats.misses += 1
                self._wanted = True
            else:
                self._ready.remove(best)
                self.stats.hits += 1
            if self._thread is None and self._seen >= self.settings.pool_after:
                self._thread = threading.Thread(target=self._run, name="memfd-pool", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return best

    def refill(self) -> None:
        """A batch was published: prepare what the pool lacks."""
        with self._cond:
            self._wanted = True
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until the thread has nothing left to prepare (True) or ``timeout_s`` passes (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or (self._preparing == 0 and not self._next()),
                                       timeout_s)

    def close(self) -> None:
        """Free every prepared segment and stop the thread (the one it is preparing is freed as it ends)."""
        with self._cond:
            self._closed = True
            self._free(self._ready)
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _target(self) -> int:
        return max(self._sizes) if self._seen >= self.settings.pool_after and self._sizes else 0

    def _job(self) -> int:
        """The size of the next segment to prepare, or 0 (full, over the bound, stalled or nothing seen);
        frees prepared segments the last batches no longer fit."""
        target = self._target()
        if not target or self._stalled:
            return 0
        self._free([r for r in self._ready if not fits(r.size, target)])
        held = sum(r.size for r in self._ready) + self._preparing
        if len(self._ready) + (self._preparing > 0) >= self.settings.pool_segments:
            return 0
        if held + target > self.settings.pool_max_bytes:
            return 0
        return target

    def _next(self) -> int:
        """``_job`` once a refill is wanted; 0 otherwise, and no refill is wanted once the pool is full."""
        size = self._job() if self._wanted else 0
        if not size and not self._preparing:
            self._wanted = False
        return size

    def _free(self, segments: list[Prepared]) -> None:
        for r in list(segments):
            self._ready.remove(r)
            r.close()

    def _run(self) -> None:
        with contextlib.suppress(OSError):  # background work: the batches' own threads come first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self._cond:
                size = self._cond.wait_for(lambda: -1 if self._closed else self._next())
                if self._closed:
                    return
                label = self._label
                self._preparing = size
            t0 = time.perf_counter()
            try:
                huge, reason = use_huge_pages(self.settings, size)
                fd, mm = new_segment(label, size, huge=huge)
            except OSError as exc:  # out of memory, say: make no more until the next batch asks
                log.warning("memfd pool: could not prepare a segment of %d bytes: %s", size, exc)
                with self._cond:
                    self._preparing, self._stalled = 0, True
                    self._cond.notify_all()
                continue
            with self._cond:
                self._preparing = 0
                self.huge_reason = reason
                segment = Prepared(fd, mm, label)
                if self._closed or label != self._label or not fits(segment.size, self._target()):
                    segment.close()
                else:
                    self._ready.append(segment)
                    self.stats.prepared += 1
                    self.stats.prepare_s.append(time.perf_counter() - t0)
                self._cond.notify_all()
