"""Separate "hosts" on one machine: a network namespace per host, joined by veth pairs to a bridge.

The bridge lives in a namespace of its own, so nothing is attached to the machine's own network:
traffic goes only among the namespaces made here, on a private /24 that exists only inside them.
A command runs on a host through ``prefix(host)``: ``ip netns exec`` into its namespace, then
``unshare --uts`` to give it the host's own hostname (so host-bound things, like the shm store,
see different hosts); both exec, so the pid started is the command's own. ``remove`` deletes every
namespace (their interfaces go with them).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass, field


def why_not() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (iproute2, util-linux)"
    probe = f"rbprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass
class Hosts:
    names: list[str]
    tag: str = field(default_factory=lambda: f"{random.randrange(16**4):04x}")
    subnet: str = field(default_factory=lambda: f"10.{random.randrange(100, 250)}.{random.randrange(256)}")
    made: list[str] = field(default_factory=list)

    def ns(self, host: str) -> str:
        return f"rb{self.tag}-{host}"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{self.names.index(host) + 1}"

    def hostname(self, host: str) -> str:
        return f"{host}-{self.tag}"

    def create(self) -> Hosts:
        try:
            switch = self.ns("switch")
            _ip("netns", "add", switch)
            self.made.append(switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for i, host in enumerate(self.names):
                ns = self.ns(host)
                _ip("netns", "add", ns)
                self.made.append(ns)
                port = f"v{self.tag}{i}"  # made in the switch namespace: no name clash with the machine's own
                _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", switch, "link", "set", port, "master", "br0")
                _ip("-n", switch, "link", "set", port, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def prefix(self, host: str) -> list[str]:
        """Runs the command that follows on ``host`` (its namespace and hostname)."""
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.hostname(host)]

    def run(self, host: str, *cmd: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.prefix(host), *cmd], capture_output=True, text=True, timeout=timeout_s)

    def remove(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()

    def __enter__(self) -> Hosts:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()
