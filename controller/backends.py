"""Engine backends and the one launch path they share.

A backend only builds a command line from a ``LaunchSpec``; ``launch`` runs it as a
process in its own session (so a signal to the controller's process group does not
take the engines down with it, and a new controller can adopt them), writing its
output to a log file. Stopping signals the engine's process group, so an engine that
forks workers (sglang's scheduler and detokenizer) goes down whole. ``ProcessHandle`` works both for a child (``Popen``) and for an
engine a previous controller started (known only by pid).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, ClassVar

from rollout_bus.events import processes
from rollout_bus.events.embedded import free_port

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class LaunchSpec:
    engine_id: str
    host: str
    port: int
    model_path: str
    weight_version: int
    python: str
    extra_args: tuple[str, ...] = ()
    token_delay_ms: float = 0.0
    seed: int | None = None
    api_key: str | None = None
    enable_lora: bool = False
    max_loras_per_batch: int = 8
    max_lora_rank: int = 64
    lora_target_modules: tuple[str, ...] = ("all",)
    tp_size: int = 1
    base_gpu_id: int = 0
    advertise_host: str = ""
    """The address the engine registers under (other hosts reach it there); "": ``host``."""
    weights_root: str = ""
    """Where published weights live: a CPU engine loads over HTTP only from there (``--weights-root``)."""
    dist_timeout_s: float = 0.0
    """A CPU engine's ``--dist-timeout`` (its weight-update groups' timeout); 0: the engine's default."""
    inner_port: int = 0
    """Where an engine behind a guard listens on loopback (0: a free port when the command is built)."""

    @property
    def url(self) -> str:
        return f"http://{self.advertise_host or self.host}:{self.port}"


class Backend:
    """Builds the command that starts one engine."""

    name: ClassVar[str] = ""

    def command(self, spec: LaunchSpec) -> list[str]:
        raise NotImplementedError

    def prepare(self, spec: LaunchSpec) -> LaunchSpec:
        """The spec as it will be launched (a backend may pick ports of its own)."""
        return spec

    def generate_url(self, spec: LaunchSpec) -> str:
        """Where executors send ``/generate`` to this engine; "": its url."""
        return ""


class CpuBackend(Backend):
    """The project's CPU engine (``engine.server``): a Hugging Face model or the tiny LM."""

    name = "cpu"

    def command(self, spec: LaunchSpec) -> list[str]:
        cmd = [spec.python, "-m", "rollout_bus.engine.server", "--host", spec.host, "--port", str(spec.port),
               "--model-path", spec.model_path, "--weight-version", str(spec.weight_version)]
        if spec.token_delay_ms:
            cmd += ["--token-delay-ms", f"{spec.token_delay_ms:g}"]
        if spec.seed is not None:
            cmd += ["--seed", str(spec.seed)]
        if spec.api_key:
            cmd += ["--api-key", spec.api_key]
        if spec.weights_root:
            cmd += ["--weights-root", spec.weights_root]
        if spec.dist_timeout_s:
            cmd += ["--dist-timeout", f"{spec.dist_timeout_s:g}"]
        if spec.enable_lora:
            cmd += ["--enable-lora", "--max-loras-per-batch", str(spec.max_loras_per_batch),
                    "--max-lora-rank", str(spec.max_lora_rank)]
        return cmd + list(spec.extra_args)


@dataclass
class SglangBackend(Backend):
    """``sglang.launch_server`` for GPU hosts: memory saver on so offload/onload work, GPUs placed per
    engine (``--base-gpu-id``, ``--tp-size``), LoRA on when adapter policies are served (SGLang needs
    ``--max-lora-rank`` and ``--lora-target-modules`` when no ``--lora-paths`` are given at launch).

    SGLang ignores the fencing header, so each engine runs behind a guard (``engine.guard``) that listens
    on the engine's port (its registry url, where every controller call goes) and refuses a deposed
    controller's control calls; SGLang itself is the guard's child on a port of its own (``inner_port``),
    where executors send ``/generate`` directly (``EngineRecord.generate_url``), so the guard costs the
    hot path nothing."""

    name: ClassVar[str] = "sglang"
    memory_saver: bool = True
    guard: bool = True

    def command(self, spec: LaunchSpec) -> list[str]:
        if not self.guard:
            return self.engine_command(spec)
        inner = spec.inner_port or free_port()
        reach = "127.0.0.1" if spec.host in ("0.0.0.0", "::") else spec.host  # where the guard finds SGLang
        cmd = [spec.python, "-m", "rollout_bus.engine.guard", "--host", spec.host, "--port", str(spec.port),
               "--upstream-host", reach, "--upstream-port", str(inner)]
        if spec.api_key:
            cmd += ["--api-key", spec.api_key]
        return [*cmd, "--", *self.engine_command(spec, port=inner)]

    def prepare(self, spec: LaunchSpec) -> LaunchSpec:
        return dataclasses.replace(spec, inner_port=spec.inner_port or free_port()) if self.guard else spec

    def generate_url(self, spec: LaunchSpec) -> str:
        return f"http://{spec.advertise_host or spec.host}:{spec.inner_port}" if self.guard else ""

    def engine_command(self, spec: LaunchSpec, *, host: str | None = None, port: int | None = None) -> list[str]:
        """SGLang's own command line (on ``host``:``port``, the spec's when not given)."""
        cmd = [spec.python, "-m", "sglang.launch_server", "--model-path", spec.model_path,
               "--host", host or spec.host, "--port", str(port or spec.port),
               "--weight-version", str(spec.weight_version),
               "--tp-size", str(spec.tp_size), "--base-gpu-id", str(spec.base_gpu_id)]
        if self.memory_saver and "--enable-memory-saver" not in spec.extra_args:
            cmd.append("--enable-memory-saver")
        if spec.api_key:
            cmd += ["--api-key", spec.api_key]
        if spec.enable_lora:
            cmd += ["--enable-lora", "--max-loras-per-batch", str(spec.max_loras_per_batch),
                    "--max-lora-rank", str(spec.max_lora_rank), "--lora-target-modules", *spec.lora_target_modules]
        return cmd + list(spec.extra_args)


def make_backend(name: str, *, memory_saver: bool = True) -> Backend:
    """The backend called ``name``; ``memory_saver`` False launches SGLang without ``--enable-memory-saver``."""
    if name == "sglang":
        return SglangBackend(memory_saver=memory_saver)
    backends: dict[str, type[Backend]] = {"cpu": CpuBackend}
    if name not in backends:
        raise ValueError(f"unknown backend {name!r}; known: {sorted([*backends, 'sglang'])}")
    return backends[name]()


@dataclass
class ProcessHandle:
    """An engine process: our child (``popen``) or one adopted by pid."""

    pid: int
    popen: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return pid_alive(self.pid)

    def signal(self, sig: int) -> None:
        """Signal the engine's whole process group (it leads one: sglang's workers go with it)."""
        if not self.alive():
            return
        try:
            if os.getpgid(self.pid) == self.pid:
                os.killpg(self.pid, sig)
            elif self.popen is not None:
                self.popen.send_signal(sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM (and SIGCONT, so a stopped one can act on it), SIGKILL after ``grace_s``; waits until gone."""
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)
        if not await self._wait(grace_s):
            log.warning("engine pid %d ignored SIGTERM for %.1fs: SIGKILL", self.pid, grace_s)
            self.signal(signal.SIGKILL)
            await self._wait(5.0)
        self.close_log()

    async def kill(self) -> None:
        self.signal(signal.SIGKILL)
        await self._wait(5.0)
        self.close_log()

    async def _wait(self, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.alive():
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, n_bytes: int = 2000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as f:
            f.seek(max(0, self.log_path.stat().st_size - n_bytes))
            return f.read().decode("utf-8", "replace")


def launch(backend: Backend, spec: LaunchSpec, log_dir: Path) -> ProcessHandle:
    """Start the engine described by ``spec``; its output goes to ``log_dir/<id>-<port>.log``."""
    cmd = backend.command(spec)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.engine_id}-{spec.port}.log"
    out = log_path.open("ab")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    log.info("launching %s: %s", spec.engine_id, " ".join(cmd))
    popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             cwd=str(PROJECT_ROOT), env=env, start_new_session=True)
    return ProcessHandle(pid=popen.pid, popen=popen, log_path=log_path, _log=out)


def pid_alive(pid: int, port: int | None = None) -> bool:
    """Whether ``pid`` runs (and is no zombie); with ``port``, whether its command line names that port.

    The port check guards against adopting an unrelated process that reused the pid.
    """
    return processes.alive(pid, cmdline_has=None if port is None else str(port))
