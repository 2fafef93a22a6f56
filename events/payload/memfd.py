"""Payloads in sealed memfds, for a producer and consumers on one host.

A producer builds a batch in a fresh ``memfd`` (``allocate``: its tensors are views of the
segment), then ``seal`` unmaps its writable mapping and adds ``F_SEAL_WRITE | F_SEAL_SHRINK |
F_SEAL_GROW | F_SEAL_SEAL``: from then on no process, the producer included, can change, shrink
or grow those bytes. ``put`` (an already encoded batch) writes it into a fresh segment, unhashed,
and seals it the same way. The sealed segment's descriptor goes
(``SCM_RIGHTS``) to the producer's segment server (``segment_server.py``, a small process of its
own started on first use), which hands it to readers that ask over an abstract unix socket of
the producer's user.

A reader checks the seals (``F_GET_SEALS``) before it trusts the bytes: ``get_sealed`` says
whether they are there, and ``BatchChannel.fetch`` skips the checksum only then; a batch built in
place carries no checksum, so an unsealed segment of one is refused. The reader maps the segment
copy-on-write (its tensors may be written to without touching the segment) and closes the
descriptor: the mapping keeps the memory alive until the batch's last tensor is freed.

Lifetime is the kernel's: a segment's memory lives while the server or any reader holds a
descriptor or mapping of it, and is freed when the last holder lets go or dies. The last
``release`` of a batch tells the server to drop it (``delete``); the janitor's sweep does the same
by age, and the server drops segments whose ``ttl_s`` ran out by itself. A producer that exits or
is killed leaves its server serving what it holds until each is released or expires; the server
then exits. Segments are never reused (a sealed segment cannot be written again): each batch costs
fresh pages, where the ``shm`` store recycles files but must checksum every batch.

Fresh pages need not be paid for while a batch waits: ``allocate`` and ``put`` take a segment that
the store's ``SegmentPool`` prepared ahead of need when one fits (``memfd_segments.py``; settings
in ``MemfdSettings``), and make a fresh one otherwise. A prepared segment is a fresh memfd that no
other process has seen, sealed like any other: the guarantee is the same.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, ClassVar

from rollout_bus.events.batch import EncodedBatch, Layout
from rollout_bus.events.errors import DecodeError, PayloadMissing
from rollout_bus.events.names import Keys
from rollout_bus.events.payload.base import BatchDraft, PayloadBuffer, PayloadStore, Reference, check_ref
from rollout_bus.events.payload.file import write_all
from rollout_bus.events.payload.memfd_segments import (
    MemfdSettings,
    SegmentPool,
    new_memfd,
    new_segment,
    trim,
    use_huge_pages,
)
from rollout_bus.events.payload.segment_server import MAX_MESSAGE, address, peer_uid

log = logging.getLogger(__name__)

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
"""The seals a reader requires before it reads a segment without a checksum."""
SERVER_START_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 30.0
"""How long a request waits for a segment server's answer before the payload counts as missing."""
_SERVER_NAME_RE = re.compile(r"[0-9a-f]{8,32}")
_SERVER_SCRIPT = str(Path(__file__).with_name("segment_server.py"))


def check_server(name: Any) -> str:
    if not isinstance(name, str) or not _SERVER_NAME_RE.fullmatch(name):
        raise DecodeError(f"memfd segment server name {name!r} is not 8-32 hex digits")
    return name


def seal(fd: int) -> None:
    """Seal a segment against writes, shrinking, growing and further seal changes (no writable mapping may remain)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)


def is_sealed(fd: int) -> bool:
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS


class MemfdStore(PayloadStore):
    name: ClassVar[str] = "memfd"

    def __init__(self, keys: Keys, *, server: str | None = None, settings: MemfdSettings | None = None) -> None:
        """A store that starts a segment server of its own on its first write; with ``server``, a client
        of that (another process's) server, e.g. for a janitor deleting what the index says lives there."""
        self.keys = keys
        self.settings = settings or MemfdSettings()
        self.pool = SegmentPool(self.settings)
        """Segments prepared ahead of need (its thread starts once ``pool_after`` batches were written)."""
        self.host = socket.gethostname()
        self.fallback: PayloadStore | None = None
        """Where a batch goes when one of its readers is on another host (``memfd?fallback=redis``)."""
        self.server_name = None if server is None else check_server(server)
        self._owns_server = server is None
        self._control: socket.socket | None = None
        self._conns: dict[str, socket.socket] = {}
        self._lock = threading.RLock()

    def locator(self) -> dict[str, Any]:
        return {"store": self.name, "root": self._server(), "host": self.host}

    def locate(self, ref: str) -> Reference:
        return {"store": self.name, "ref": check_ref(ref), "host": self.host, "server": self._server()}

    # --- the segment server --------------------------------------------------------------
    def _server(self) -> str:
        """This store's server's name; its own server is started on first use."""
        with self._lock:
            if self.server_name is None or (self._owns_server and self._control is None):
                self._start_server()
            assert self.server_name is not None
            return self.server_name

    def _start_server(self) -> None:
        name = uuid.uuid4().hex[:16]
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen([sys.executable, _SERVER_SCRIPT, name, str(theirs.fileno())],
                                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True,
                                    close_fds=True)
        finally:
            theirs.close()
        # reaped when it exits, so that a server outliving its work leaves no zombie behind
        threading.Thread(target=proc.wait, name=f"memfd-server-{name}", daemon=True).start()
        mine.settimeout(SERVER_START_TIMEOUT_S)
        try:
            ready = mine.recv(16)
        except TimeoutError:
            ready = b""
        if ready != b"READY":
            mine.close()
            proc.kill()
            raise OSError(f"memfd segment server {name} did not start (exit status {proc.poll()})")
        mine.settimeout(REQUEST_TIMEOUT_S)  # an ADD waits at most this long for the server's answer
        self._control, self.server_name = mine, name

    def _request(self, server: str, message: bytes) -> tuple[bytes, list[int]]:
        """One request to ``server``, one reply; ``PayloadMissing`` when no such server is running (gone with
        its segments). Connections are kept, one per server."""
        with self._lock:
            for attempt in range(2):
                conn = self._conns.get(server)
                if conn is None:
                    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
                    conn.settimeout(REQUEST_TIMEOUT_S)
                    try:
                        conn.connect(address(server))
                    except (ConnectionRefusedError, FileNotFoundError):
                        conn.close()
                        raise PayloadMissing(f"memfd segment server {server} is gone, and its segments "
                                             "with it") from None
                    if peer_uid(conn) != os.getuid():
                        conn.close()
                        raise PayloadMissing(f"memfd segment server {server} runs as another user")
                    self._conns[server] = conn
                try:
                    conn.send(message)
                    reply, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
                except TimeoutError:
                    conn.close()
                    del self._conns[server]
                    raise PayloadMissing(f"memfd segment server {server} did not answer in "
                                         f"{REQUEST_TIMEOUT_S:.0f} s") from None
                except OSError as exc:
                    if exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                        raise
                    reply, fds = b"", []
                if reply:
                    return reply, fds
                conn.close()  # the server exited since the last request: connect again (refused if it is gone)
                del self._conns[server]
                if attempt:
                    break
            raise PayloadMissing(f"memfd segment server {server} is gone, and its segments with it")

    # --- writing -----------------------------------------------------------------------
    def allocate(self, layout: Layout, meta: dict[str, Any]) -> BatchDraft:
        """A draft in a prepared segment of the pool, or in a fresh one when none fits (pages faulted in now)."""
        server = self._server()
        prepared = self.pool.take(f"{server}:pool", layout.nbytes)
        if prepared is not None:
            fd, mm = prepared.fd, prepared.mm
        else:
            fd, mm = new_segment(f"{server}:draft", layout.nbytes, huge=use_huge_pages(self.settings, layout.nbytes)[0])
        mm[:len(layout.head)] = layout.head
        return BatchDraft(layout, meta, layout.tensors(mm), store=self, segment=(fd, mm))

    def put(self, ref: str, batch: EncodedBatch, ttl_s: int) -> Reference:
        """Write an encoded batch into a segment the pool prepared (through its mapping), or else into a
        fresh one with ``pwritev`` (no mapping to set up and tear down before sealing, no page zeroed
        before it is overwritten: half the kernel's work of a mapped copy into fresh pages here), and
        seal it. Not hashed: its header says so, and readers check the seals."""
        server = self._server()
        prepared = self.pool.take(f"{server}:pool", batch.nbytes)
        fd = new_memfd(f"{server}:{ref}") if prepared is None else prepared.fd
        try:
            if prepared is None:
                write_all(fd, [batch.unhashed_header(), *batch.buffers[1:]], 0)
            else:  # pages allocated and mapped already: copy through the mapping (a huge-page segment takes no write)
                with prepared.mm as mm:
                    offset = 0
                    for buffer in [batch.unhashed_header(), *batch.buffers[1:]]:
                        view = memoryview(buffer).cast("B")
                        mm[offset:offset + view.nbytes] = view
                        offset += view.nbytes
                trim(fd, batch.nbytes)
            seal(fd)
            reference = self._add(server, ref, fd, batch.nbytes, ttl_s)
        finally:
            os.close(fd)
        self.pool.refill()
        return reference

    def seal(self, ref: str, draft: BatchDraft, ttl_s: int) -> Reference:
        """Publish a draft this store allocated: unmap it and seal it, or, while a tensor of the draft is
        still alive (its mapping cannot go), copy it into a fresh segment and seal that."""
        server = self._server()
        fd, mm = draft.take_segment()
        try:
            try:
                mm.close()
            except BufferError:  # a view of the draft still exists: it keeps the writable mapping
                log.warning("batch %s: a tensor of its draft is still referenced; copied into a fresh segment "
                            "(drop the draft's tensors before publishing to seal it in place)", ref)
                fd2 = new_memfd(f"{server}:{ref}")
                try:
                    write_all(fd2, [memoryview(mm)[:draft.layout.nbytes]], 0)
                except BaseException:
                    os.close(fd2)
                    raise
                os.close(fd)
                fd = fd2
            trim(fd, draft.layout.nbytes)  # a pooled segment may be larger than its batch
            seal(fd)
            reference = self._add(server, ref, fd, draft.layout.nbytes, ttl_s)
        finally:
            os.close(fd)
        self.pool.refill()
        return reference

    def _add(self, server: str, ref: str, fd: int, nbytes: int, ttl_s: int) -> Reference:
        """Hand a sealed segment to this store's server (a fresh one if the last is gone: killed, say)."""
        with self._lock:
            for attempt in range(2):
                assert self._control is not None
                try:
                    socket.send_fds(self._control, [f"ADD {ref} {nbytes} {ttl_s}".encode()], [fd])
                    if self._control.recv(16) == b"OK":  # held: a reader that sees the event finds it
                        break
                    raise ConnectionResetError(errno.ECONNRESET, "segment server closed its control socket")
                except OSError as exc:
                    if attempt or exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ECONNREFUSED):
                        raise
                    log.warning("memfd segment server %s is gone; starting another", server)
                    self._control.close()
                    self._control = None
                    server = self._server()
        return {"store": self.name, "ref": ref, "nbytes": nbytes, "host": self.host, "server": server}

    # --- reading -----------------------------------------------------------------------
    def get(self, reference: Reference) -> PayloadBuffer:
        return self.get_sealed(reference)[0]

    def get_sealed(self, reference: Reference) -> tuple[PayloadBuffer, bool]:
        ref, nbytes = self._local_ref(reference, self.host, "a memfd")
        reply, fds = self._request(check_server(reference.get("server")), f"GET {ref}".encode())
        if not fds:
            raise PayloadMissing(f"payload {ref} is gone (released, expired or never sealed)")
        fd = fds[0]
        try:
            for extra in fds[1:]:
                os.close(extra)
            sealed = is_sealed(fd)
            size = os.fstat(fd).st_size
            if nbytes > size:
                raise DecodeError(f"memfd payload {ref}: reference says {nbytes} bytes, segment holds {size}")
            try:
                mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY)
            except OSError as exc:
                if exc.errno != errno.ENOMEM:
                    raise
                # a huge-page segment: a private mapping of it reserves as many free huge pages, and
                # there are not enough; read it through a shared read-only mapping into ordinary memory
                with mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ) as shared:
                    return bytearray(shared), sealed
        finally:
            os.close(fd)
        return memoryview(mm), sealed

    # --- releasing ---------------------------------------------------------------------
    def delete(self, reference: Reference) -> None:
        ref = self._ref(reference)
        with contextlib.suppress(PayloadMissing):  # its server is gone: so is the segment
            self._request(check_server(reference.get("server")), f"DROP {ref}".encode())

    def delete_expired(self, older_than_s: float) -> int:
        """Drop segments of this store's server added more than ``older_than_s`` ago."""
        if self.server_name is None:
            return 0
        try:
            reply, _ = self._request(self.server_name, f"EXPIRE {max(0.0, older_than_s)}".encode())
        except PayloadMissing:
            return 0
        words = reply.split()
        return int(words[1]) if len(words) == 2 and words[0] == b"OK" else 0

    def close(self) -> None:
        """Free the pool's prepared segments and close connections; the server keeps serving what it holds,
        and exits once it holds nothing."""
        self.pool.close()
        self.pool = SegmentPool(self.settings)  # this store may write again: its pool starts over
        with self._lock:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()
            if self._control is not None:
                self._control.close()
                self._control = None

