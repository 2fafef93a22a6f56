"""A Sentinel deployment as local processes: a primary, its replicas and three sentinels.

Every process is a ``redis-server`` on a free loopback port, owned by the test and stopped by
pid. ``kill_primary`` SIGKILLs whichever server is the primary now; ``wait_failover`` waits until
the sentinels name another one; ``rejoin`` brings a killed server back on its port as a replica
of the new primary.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from rollout_bus.events.embedded import RedisServer, find_redis_server, free_port

MASTER = "mymaster"
SYNC_NOW = ["--repl-diskless-sync-delay", "0"]
"""A replica that (re)joins gets its full sync at once, not after the default 5 s gathering delay."""


@dataclass
class SentinelCluster:
    replicas: int = 1
    sentinels: int = 3
    down_after_ms: int = 1000
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rollout-bus-sentinel-")))
    servers: list[RedisServer] = field(default_factory=list)
    sentinel_ports: list[int] = field(default_factory=list)
    sentinel_procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{MASTER}/0"

    def start(self) -> SentinelCluster:
        try:
            for i in range(1 + self.replicas):
                (self.root / f"redis-{i}").mkdir()
                extra = [*SYNC_NOW, "--replicaof", "127.0.0.1", str(self.servers[0].port)] if i else [*SYNC_NOW]
                self.servers.append(RedisServer(data_dir=self.root / f"redis-{i}", extra_args=extra).start())
            self._wait(lambda: self.link_up(), "the replicas in sync", 15)
            binary = find_redis_server()
            assert binary is not None
            for i in range(self.sentinels):
                port = free_port()
                conf = self.root / f"sentinel-{i}.conf"
                conf.write_text(
                    f"port {port}\nbind 127.0.0.1\ndir {self.root}\nlogfile {self.root}/sentinel-{i}.log\n"
                    f"sentinel monitor {MASTER} 127.0.0.1 {self.servers[0].port} 2\n"
                    f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}\n"
                    f"sentinel failover-timeout {MASTER} 10000\nsentinel parallel-syncs {MASTER} 1\n")
                self.sentinel_procs.append(subprocess.Popen([binary, str(conf), "--sentinel"],
                                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                self.sentinel_ports.append(port)
            self._wait(self._sentinels_agree, "every sentinel to see the others and the replicas", 20)
        except BaseException:
            self.stop()
            raise
        return self

    def sentinel(self, i: int = 0) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[i], socket_timeout=2)

    def primary_port(self) -> int | None:
        """The port every reachable sentinel names as the primary (None while they disagree)."""
        named = set()
        for i in range(len(self.sentinel_ports)):
            try:
                host_port = self.sentinel(i).sentinel_get_master_addr_by_name(MASTER)
            except redis.RedisError:
                continue
            named.add(int(host_port[1]) if host_port else None)
        return named.pop() if len(named) == 1 else None

    def primary(self) -> RedisServer:
        port = self.primary_port()
        return next(s for s in self.servers if s.port == port)

    def link_up(self) -> bool:
        """Every live replica is connected to the primary and caught up with it."""
        try:
            primary = next(s for s in self.servers if _role(s) == "master")
        except StopIteration:
            return False
        info = redis.Redis(port=primary.port).info("replication")
        live = sum(1 for s in self.servers if s is not primary and s.proc is not None and s.proc.poll() is None)
        slaves = [info[k] for k in info if str(k).startswith("slave") and isinstance(info[k], dict)]
        return len(slaves) == live and all(s.get("state") == "online" for s in slaves)

    def kill_primary(self) -> RedisServer:
        """SIGKILL the current primary; returns it (shown dead: its exit status is -SIGKILL)."""
        victim = self.primary()
        victim.kill()
        assert victim.proc is not None and victim.proc.returncode == -signal.SIGKILL
        return victim

    def wait_failover(self, old_port: int, timeout_s: float = 30) -> int:
        self._wait(lambda: self.primary_port() not in (None, old_port), "the sentinels to promote a replica",
                   timeout_s)
        port = self.primary_port()
        assert port is not None
        return port

    def rejoin(self, server: RedisServer, primary_port: int) -> None:
        """Start a killed server again as a replica of ``primary_port``, as its supervisor would after a
        failover (left to the sentinels, a returning old primary is converted only after ~8 s)."""
        server.extra_args = [*SYNC_NOW, "--replicaof", "127.0.0.1", str(primary_port)]
        server.restart()

    def stop(self) -> None:
        for proc in self.sentinel_procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        for server in self.servers:
            server.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def _sentinels_agree(self) -> bool:
        try:
            for i in range(len(self.sentinel_ports)):
                state = self.sentinel(i).sentinel_master(MASTER)
                if int(state["num-other-sentinels"]) < len(self.sentinel_ports) - 1:
                    return False
                if int(state["num-slaves"]) < self.replicas:
                    return False
        except redis.RedisError:
            return False
        return True

    @staticmethod
    def _wait(cond: object, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise TimeoutError(f"sentinel cluster: timed out after {timeout_s}s waiting for {what}")
            time.sleep(0.05)

    def __enter__(self) -> SentinelCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _role(server: RedisServer) -> str | None:
    if server.proc is None or server.proc.poll() is not None:
        return None
    try:
        return str(redis.Redis(port=server.port, socket_timeout=1).info("replication")["role"])
    except redis.RedisError:
        return None
