"""The process that holds a producer's sealed memfd segments and hands their descriptors to readers.

Run by ``events.payload.memfd.MemfdStore`` as ``python segment_server.py <name> <control-fd>``
(standard library only, so that it starts in a few tens of milliseconds). It listens on the
abstract unix socket ``rollout-bus-memfd/<uid>/<name>`` (``SOCK_SEQPACKET``: one request, one
reply); only processes of its own user may connect (``SO_PEERCRED``). Requests are ASCII words:

* from the producer, on the control socket it was started with: ``ADD <ref> <nbytes> <ttl_s>``
  with the sealed segment's descriptor (``SCM_RIGHTS``), answered ``OK`` once the segment is held
  (so that no reader can ask before it is there), and ``DROP <ref>``;
* from anyone of its user, on the listening socket: ``GET <ref>`` (answered ``OK <nbytes>`` with
  the descriptor, or ``MISSING``), ``DROP <ref>`` (the last reader released it) and ``EXPIRE <age_s>``
  (drop segments added more than ``age_s`` ago; answered ``OK <count>``).

A segment's memory belongs to the kernel: it lives while this process or any reader holds a
descriptor or mapping of it, and is freed when the last one goes, whoever dies first. This
process drops a segment on ``DROP``, on ``EXPIRE`` and once its ``ttl_s`` has passed. When the
producer's end of the control socket closes (the producer exited or was killed) it keeps serving
what it holds and exits as soon as it holds nothing.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import sys
import time

ADDRESS_PREFIX = "rollout-bus-memfd"
MAX_MESSAGE = 512
SWEEP_EVERY_S = 1.0


def address(name: str, uid: int | None = None) -> str:
    """The abstract socket address of server ``name`` for user ``uid`` (this process's by default)."""
    return f"\0{ADDRESS_PREFIX}/{os.getuid() if uid is None else uid}/{name}"


def peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(uid)


class Server:
    def __init__(self, name: str, control: socket.socket) -> None:
        self.control = control
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(address(name))
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(control, selectors.EVENT_READ)
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.segments: dict[str, tuple[int, int, float, float]] = {}  # ref -> fd, nbytes, added, expires
        self.producer_alive = True

    def run(self) -> None:
        self.control.send(b"READY")
        next_sweep = time.monotonic() + SWEEP_EVERY_S
        while self.producer_alive or self.segments:
            for key, _ in self.selector.select(max(0.0, next_sweep - time.monotonic())):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self.listener:
                    self._accept()
                else:
                    self._serve(sock)
            if time.monotonic() >= next_sweep:
                now = time.monotonic()
                for ref in [r for r, (_, _, _, expires) in self.segments.items() if expires <= now]:
                    self._drop(ref)
                next_sweep = now + SWEEP_EVERY_S

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        if peer_uid(conn) != os.getuid():
            conn.close()
            return
        self.selector.register(conn, selectors.EVENT_READ)

    def _serve(self, sock: socket.socket) -> None:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
        except OSError:
            msg, fds = b"", []
        if not msg:
            self.selector.unregister(sock)
            sock.close()
            for fd in fds:
                os.close(fd)
            if sock is self.control:
                self.producer_alive = False
            return
        words = msg.decode("ascii", "replace").split()
        try:
            self._dispatch(sock, words[0] if words else "", words[1:], fds)
        except ValueError:  # a malformed number
            if sock is not self.control:
                sock.send(b"BAD")

    def _dispatch(self, sock: socket.socket, verb: str, args: list[str], fds: list[int]) -> None:
        if verb == "ADD" and sock is self.control and len(fds) == 1 and len(args) == 3:
            nbytes, ttl_s = int(args[1]), float(args[2])
            self._drop(args[0])
            now = time.monotonic()
            self.segments[args[0]] = (fds[0], nbytes, now, now + ttl_s)
            sock.send(b"OK")
            return
        for fd in fds:  # a descriptor with any other request is not kept
            os.close(fd)
        if verb == "GET" and len(args) == 1:
            held = self.segments.get(args[0])
            if held is None:
                sock.send(b"MISSING")
            else:
                socket.send_fds(sock, [f"OK {held[1]}".encode()], [held[0]])
        elif verb == "DROP" and len(args) == 1:
            self._drop(args[0])
            if sock is not self.control:
                sock.send(b"OK")
        elif verb == "EXPIRE" and len(args) == 1 and sock is not self.control:
            cutoff = time.monotonic() - float(args[0])
            old = [r for r, (_, _, added, _) in self.segments.items() if added < cutoff]
            for ref in old:
                self._drop(ref)
            sock.send(f"OK {len(old)}".encode())
        elif sock is not self.control:
            sock.send(b"BAD")

    def _drop(self, ref: str) -> None:
        held = self.segments.pop(ref, None)
        if held is not None:
            os.close(held[0])


def main(argv: list[str]) -> None:
    name, control_fd = argv[0], int(argv[1])
    Server(name, socket.socket(fileno=control_fd)).run()


if __name__ == "__main__":
    main(sys.argv[1:])
