"""A private ``redis-server`` for runs and tests that are given no ``REDIS_URL``.

The server is started on a free loopback port, owned by this process (stopped by
pid, never by name) and can be killed and restarted on the same port and data
directory, which is what the fault tests need.
"""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollout_bus.events import processes

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_redis_server() -> str | None:
    """Path of the ``redis-server`` binary on ``PATH`` (``scripts/setup.sh`` installs one where it can)."""
    return shutil.which("redis-server")


@dataclass
class RedisServer:
    """One ``redis-server`` process on 127.0.0.1, owned by this process."""

    port: int = field(default_factory=free_port)
    data_dir: Path | None = None
    appendonly: bool = False
    appendfsync: str = "everysec"
    extra_args: list[str] = field(default_factory=list)
    binary: str | None = None
    death_signal: int | None = None
    """Set: the server gets this signal when the thread that started it ends (``processes.die_with_parent``); a
    run's private server gets SIGTERM, on which Redis writes its append-only file out and exits."""
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _own_dir: bool = field(default=False, init=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        binary = self.binary or find_redis_server()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed: run scripts/setup.sh (as root it installs "
                                    "it with apt), or apt-get install redis-server")
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="rollout-bus-redis-"))
            self._own_dir = True
        args = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
            "--save", "", "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning",
            "--logfile", str(self.data_dir / "redis.log"),
        ]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        else:
            args += ["--appendonly", "no"]
        args += self.extra_args
        preexec = None if self.death_signal is None else processes.die_with_parent(self.death_signal)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=preexec)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.kill()  # never leave a server behind that nobody holds (``__exit__`` does not run)
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.data_dir}/redis.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                    # any answer but LOADING means it serves: a server with a password says -NOAUTH
                    if reply and not reply.startswith(b"-LOADING"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"redis-server on port {self.port} not ready after {timeout_s}s")

    def kill(self) -> None:
        """SIGKILL the server (a crash: unsynced writes are lost)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def shutdown(self) -> None:
        """A clean SHUTDOWN (AOF flushed), waiting for the process to exit."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                s.sendall(b"SHUTDOWN\r\n")
                s.recv(64)
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self, timeout_s: float = 30.0) -> None:
        """Start again on the same port and data directory (after ``kill`` or ``shutdown``).

        The timeout covers replaying the append-only file: the server answers LOADING until done.
        """
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"redis-server on port {self.port} is still running; kill or shut it down first")
        self.start(timeout_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._own_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeTcpServer:
    """fakeredis' TCP server, the fallback where no redis-server binary can be had."""

    def __init__(self) -> None:
        from fakeredis import TcpFakeServer  # imported lazily: a dev-only fallback

        self.port = free_port()
        self._server = TcpFakeServer(("127.0.0.1", self.port), server_type="redis")
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> FakeTcpServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def private_redis(data_dir: Path | None = None, appendonly: bool = False) -> RedisServer | FakeTcpServer:
    """A private Redis for a run: a real server when one can be had, else fakeredis over TCP. The server stops
    when this process dies, however it dies (SIGTERM, so its last writes reach the append-only file first);
    call it from the main thread."""
    binary = find_redis_server()
    if binary is not None:
        return RedisServer(binary=binary, data_dir=data_dir, appendonly=appendonly,
                           death_signal=signal.SIGTERM).start()
    log.warning("no redis-server binary on PATH (scripts/setup.sh installs one where it can): falling back to "
                "fakeredis (slow)")
    return FakeTcpServer().start()
