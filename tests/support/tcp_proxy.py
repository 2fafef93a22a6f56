"""A small TCP proxy in front of a real redis-server, for faults on the real connection path.

Every client connection gets its own upstream connection and two pump threads. Faults:

- ``drop_next_reply(marker)``: the next command containing ``marker`` reaches Redis (which acts
  on it), but its reply is thrown away and the client's connection is cut, as when a network
  drops a connection while the reply is on its way;
- ``cut()``: every connection is closed and new ones are refused (accepted, then closed) until
  ``heal()``, as when the network between a client and Redis is gone.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field

from rollout_bus.events.embedded import free_port


@dataclass
class _Pair:
    client: socket.socket
    upstream: socket.socket
    drop_reply: bool = False
    closed: threading.Event = field(default_factory=threading.Event)

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class TcpProxy:
    """Listens on a free loopback port and forwards to ``127.0.0.1:<upstream_port>``."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = free_port()
        self.dropped = 0
        self.refused = 0
        self._marker: bytes | None = None
        self._cut = False
        self._pairs: list[_Pair] = []
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", self.port))
        self._listener.listen(64)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="tcp-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> TcpProxy:
        self._thread.start()
        return self

    # --- faults ------------------------------------------------------------------------------
    def drop_next_reply(self, marker: bytes) -> None:
        """Lose the reply to the next command whose bytes contain ``marker`` (once)."""
        with self._lock:
            self._marker = marker

    def cut(self) -> None:
        """Close every connection and refuse new ones until ``heal``."""
        with self._lock:
            self._cut = True
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            pair.close()

    def heal(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut()

    # --- pumping -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refuse = self._cut
            if refuse:
                self.refused += 1
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            pair = _Pair(client, upstream)
            with self._lock:
                self._pairs.append(pair)
            threading.Thread(target=self._to_server, args=(pair,), daemon=True).start()
            threading.Thread(target=self._to_client, args=(pair,), daemon=True).start()

    def _to_server(self, pair: _Pair) -> None:
        try:
            while not pair.closed.is_set():
                data = pair.client.recv(65536)
                if not data:
                    break
                with self._lock:
                    if self._marker is not None and self._marker in data:
                        self._marker = None
                        pair.drop_reply = True  # set before Redis can answer
                pair.upstream.sendall(data)
        except OSError:
            pass
        pair.close()

    def _to_client(self, pair: _Pair) -> None:
        try:
            while not pair.closed.is_set():
                data = pair.upstream.recv(65536)
                if not data:
                    break
                if pair.drop_reply:
                    self.dropped += 1
                    break  # the reply is lost with the connection
                pair.client.sendall(data)
        except OSError:
            pass
        pair.close()
