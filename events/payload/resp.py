"""A minimal RESP2 connection for bulk payloads: scatter-gather writes, reads into one buffer.

redis-py joins large arguments into its command buffer and copies bulk replies several
times; for tens of MB that dominates a claim-check hand-off. This connection sends
commands with ``socket.sendmsg`` over the caller's memoryviews (no joining) and reads bulk
replies with ``recv_into`` straight into the caller's buffer. It is built from the same
``REDIS_URL`` (or redis-py client) as the rest of the bus: TCP or unix socket, AUTH with
username/password, SELECT db, TLS for ``rediss://``. It speaks RESP2 and only what the
payload store needs.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.connection import SSLConnection, UnixDomainSocketConnection, parse_url

from rollout_bus.events.payload.base import write_vectored

Arg = bytes | bytearray | memoryview | str | int
Reply = bytes | int | None | list[Any]

BIG_ARG = 64 << 10
_READ_SIZE = 64 << 10
_LINE_READ = 64
"""Bytes read at a time around a bulk reply received in place: its length line and closing CRLF. Small, so
that the reply's bytes go from the socket straight into the caller's buffer instead of through ours."""


class RespError(Exception):
    """Redis answered with an error reply."""


class RespProtocolError(Exception):
    """The reply did not look like RESP or did not match what was asked; drop the connection."""


@dataclass(frozen=True)
class Address:
    """Where and how to connect; mirrors the redis-py connection options the bus uses."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    ssl_cert_reqs: str = "required"
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True
    connect_timeout_s: float = 5.0
    timeout_s: float | None = 30.0

    @classmethod
    def from_url(cls, url: str) -> Address:
        kwargs: dict[str, Any] = dict(parse_url(url))
        return cls._from_kwargs(kwargs, kwargs.pop("connection_class", None))

    @classmethod
    def from_client(cls, client: redis.Redis) -> Address:
        pool = client.connection_pool
        return cls._from_kwargs(dict(pool.connection_kwargs), pool.connection_class)

    @classmethod
    def _from_kwargs(cls, kw: dict[str, Any], connection_class: Any) -> Address:
        is_ssl = isinstance(connection_class, type) and issubclass(connection_class, SSLConnection)
        is_unix = isinstance(connection_class, type) and issubclass(connection_class, UnixDomainSocketConnection)
        reqs = kw.get("ssl_cert_reqs", "required")
        reqs_name = {ssl.CERT_NONE: "none", ssl.CERT_OPTIONAL: "optional", ssl.CERT_REQUIRED: "required"}.get(
            reqs, str(reqs).lower())
        timeout = kw.get("socket_timeout", 30.0)
        return cls(
            host=str(kw.get("host") or "127.0.0.1"), port=int(kw.get("port") or 6379),
            path=str(kw["path"]) if is_unix and kw.get("path") else None, db=int(kw.get("db") or 0),
            username=kw.get("username"), password=kw.get("password"), ssl=is_ssl, ssl_cert_reqs=reqs_name,
            ssl_ca_certs=kw.get("ssl_ca_certs"), ssl_certfile=kw.get("ssl_certfile"),
            ssl_keyfile=kw.get("ssl_keyfile"), ssl_check_hostname=bool(kw.get("ssl_check_hostname", True)),
            connect_timeout_s=float(kw.get("socket_connect_timeout") or 5.0),
            timeout_s=float(timeout) if timeout is not None else None)


def pack_command(args: Sequence[Arg]) -> list[bytes | memoryview]:
    """RESP frames of one command: small parts joined, large arguments kept as their own views."""
    out: list[bytes | memoryview] = []
    small = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        view = memoryview(arg).cast("B") if not isinstance(arg, bytes) else arg
        n = len(view)
        small.append(b"$%d\r\n" % n)
        if n >= BIG_ARG:
            out.append(b"".join(small))
            out.append(view)
            small = [b"\r\n"]
        else:
            small.append(bytes(view))
            small.append(b"\r\n")
    out.append(b"".join(small))
    return out


class RespConnection:
    """One lazily opened socket to Redis; not thread-safe (the store holds a lock)."""

    def __init__(self, address: Address) -> None:
        self.address = address
        self._sock: socket.socket | None = None
        self._pid = 0
        self._rbuf = bytearray()
        self._rpos = 0

    # --- lifecycle -----------------------------------------------------------------------
    def connect(self) -> None:
        a = self.address
        sock: socket.socket
        if a.path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(a.connect_timeout_s)
            sock.connect(a.path)
        else:
            sock = socket.create_connection((a.host, a.port), timeout=a.connect_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if a.ssl:
            ctx = ssl.create_default_context(cafile=a.ssl_ca_certs)
            ctx.check_hostname = a.ssl_check_hostname and a.ssl_cert_reqs != "none"
            ctx.verify_mode = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL}.get(
                a.ssl_cert_reqs, ssl.CERT_REQUIRED)
            if a.ssl_certfile:
                ctx.load_cert_chain(a.ssl_certfile, a.ssl_keyfile)
            sock = ctx.wrap_socket(sock, server_hostname=a.host)
        sock.settimeout(a.timeout_s)
        self._sock, self._pid = sock, os.getpid()
        self._rbuf, self._rpos = bytearray(), 0
        try:
            if a.password is not None:
                self.execute(*(["AUTH", a.username, a.password] if a.username else ["AUTH", a.password]))
            if a.db:
                self.execute("SELECT", a.db)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None and self._pid == os.getpid():
            with contextlib.suppress(OSError):
                sock.close()

    @property
    def connected(self) -> bool:
        return self._sock is not None and self._pid == os.getpid()

    def _socket(self) -> socket.socket:
        if not self.connected:
            self._sock = None  # inherited across fork: never share it with the parent
            self.connect()
        assert self._sock is not None
        return self._sock

    # --- writing -------------------------------------------------------------------------
    def send(self, frames: Sequence[bytes | memoryview]) -> None:
        """Write frames in order; plain sockets use scatter-gather ``sendmsg`` without joining."""
        sock = self._socket()
        if isinstance(sock, ssl.SSLSocket):
            for frame in frames:
                sock.sendall(frame)
            return
        write_vectored(lambda views, _done: sock.sendmsg(views), frames)

    def execute(self, *args: Arg) -> Reply:
        self.send(pack_command(args))
        return self.read_reply()

    # --- reading -------------------------------------------------------------------------
    def _fill(self, size: int = _READ_SIZE) -> None:
        sock = self._socket()
        if self._rpos:
            del self._rbuf[:self._rpos]
            self._rpos = 0
        chunk = sock.recv(size)
        if not chunk:
            raise ConnectionError("Redis closed the connection")
        self._rbuf += chunk

    def _line(self, read_size: int = _READ_SIZE) -> bytes:
        while True:
            end = self._rbuf.find(b"\r\n", self._rpos)
            if end >= 0:
                line = bytes(self._rbuf[self._rpos:end])
                self._rpos = end + 2
                return line
            self._fill(read_size)

    def _skip(self, n: int, read_size: int = _READ_SIZE) -> None:
        while len(self._rbuf) - self._rpos < n:
            self._fill(read_size)
        if self._rbuf[self._rpos:self._rpos + n] != b"\r\n"[:n]:
            raise RespProtocolError("bulk reply not terminated by CRLF")
        self._rpos += n

    def read_reply(self) -> Reply:
        line = self._line()
        if not line:
            raise RespProtocolError("empty reply line")
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            raise RespError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            buf = bytearray(n)
            self._read_exact(memoryview(buf))
            self._skip(2)
            return bytes(buf)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read_reply() for _ in range(n)]
        raise RespProtocolError(f"unexpected reply {line[:40]!r}")

    def read_bulk_into(self, out: memoryview) -> bool:
        """Read one bulk reply into ``out``, which must be exactly its size; False for nil. The bytes go
        from the socket into ``out`` (only what a small read of the length line took comes through here)."""
        line = self._line(_LINE_READ)
        if line[:1] == b"-":
            raise RespError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise RespProtocolError(f"expected a bulk reply, got {line[:40]!r}")
        n = int(line[1:])
        if n < 0:
            return False
        if n != out.nbytes:
            raise RespProtocolError(f"bulk reply of {n} bytes where {out.nbytes} were expected")
        self._read_exact(out)
        self._skip(2, _LINE_READ)
        return True

    def _read_exact(self, out: memoryview) -> None:
        have = min(len(self._rbuf) - self._rpos, out.nbytes)
        if have:
            out[:have] = memoryview(self._rbuf)[self._rpos:self._rpos + have]
            self._rpos += have
        sock = self._socket()
        got, n = have, out.nbytes
        while got < n:
            k = sock.recv_into(out[got:], n - got)
            if not k:
                raise ConnectionError("Redis closed the connection mid-reply")
            got += k
