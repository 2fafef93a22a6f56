"""Real CPU engine processes for tests: started with this interpreter, stopped and killed by pid.

``EngineProcess(model_path)`` starts ``python -m engine.server`` on a free port and returns once
``/health`` answers. ``make_weights_dir`` writes a seeded random model for it to serve. ``call``
is a tiny stdlib HTTP client returning ``(status, parsed body)`` for any status.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from rollout_bus.engine.init_weights import init_weights_dir
from rollout_bus.lm.model import ModelConfig

ROOT = Path(__file__).resolve().parents[1]


def make_weights_dir(directory: str | os.PathLike[str], seed: int = 0, config: ModelConfig | None = None) -> Path:
    """A directory with ``config.json`` and ``model.safetensors`` of a random TinyLM (tiny by default)."""
    return init_weights_dir(directory, config or ModelConfig(), seed)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def call(url: str, method: str = "GET", body: Any = None, timeout_s: float = 30.0, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One HTTP call; the status and the JSON-decoded body (text if not JSON, None if empty)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read()
    if not payload:
        return status, None
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode()


def wait_until(what: str, cond: Callable[[], bool], timeout_s: float = 20.0, every_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


def _temp_log() -> Path:
    fd, name = tempfile.mkstemp(prefix="engine-", suffix=".log")
    os.close(fd)
    return Path(name)


class EngineProcess:
    """One engine server subprocess; a context manager that stops it on exit."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        port: int | None = None,
        weight_version: str = "0",
        token_delay_ms: float = 0,
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        startup_timeout_s: float = 60.0,
        log_path: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.env = dict(env or {})
        """Extra environment variables of the engine process."""
        self.model_path = str(model_path)
        self.host = host
        self.port = port or free_port()
        self.weight_version = weight_version
        self.token_delay_ms = token_delay_ms
        self.extra_args = tuple(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self._owns_log = log_path is None
        self.log_path = Path(log_path) if log_path else _temp_log()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("engine not started")
        return self.proc.pid

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "rollout_bus.engine.server",
            "--host", self.host, "--port", str(self.port), "--model-path", self.model_path,
            "--weight-version", self.weight_version, "--token-delay-ms", str(self.token_delay_ms),
            *self.extra_args,
        ]

    def start(self) -> EngineProcess:
        """Start (or start again after ``kill``/``stop``) on the same port; return once /health is 200."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **self.env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if call(self.url + "/health", timeout_s=1.0)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"engine not healthy after {self.startup_timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL by pid, no cleanup: what a crash looks like."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM by pid, then SIGKILL if it has not exited within ``timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def get(self, path: str, timeout_s: float = 30.0) -> tuple[int, Any]:
        return call(self.url + path, "GET", timeout_s=timeout_s)

    def post(self, path: str, body: Any = None, timeout_s: float = 30.0) -> tuple[int, Any]:
        return call(self.url + path, "POST", body if body is not None else {}, timeout_s=timeout_s)

    def state(self) -> dict[str, Any]:
        """The scheduler's figures (``internal_states[0].cpu_engine`` of /server_info): running and queued
        counts, pause mode, released tags, steps, adapters."""
        status, info = self.get("/server_info")
        if status != 200:
            raise RuntimeError(f"/server_info answered {status}: {info}")
        return dict(info["internal_states"][0]["cpu_engine"])

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        if exc_type is None and self._owns_log:
            self.log_path.unlink(missing_ok=True)
