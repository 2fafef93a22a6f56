"""One active controller per namespace: a lease key with an expiry.

The holder writes its owner token with ``SET NX PX`` and renews it with a Lua
compare-and-extend, so only the holder can extend or release it. A standby instance
retries the ``SET NX`` until the holder stops renewing (it died or hung) and the key
expires.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid

from rollout_bus.events.connection import Guard, Redis

log = logging.getLogger(__name__)

_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def owner_token(instance: str) -> str:
    return f"{instance}:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Lease:
    def __init__(self, client: Redis, key: str, owner: str, ttl_s: float,
                 guard: Guard | None = None) -> None:
        self.client = client
        self.key = key
        self.owner = owner
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.guard = guard or Guard(client, name=f"lease {key}")
        self._extend = client.register_script(_EXTEND)
        self._release = client.register_script(_RELEASE)

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it (or extend it if we do)."""
        if self.guard.call(lambda c: c.set(self.key, self.owner, nx=True, px=self.ttl_ms)):
            log.info("lease %s acquired by %s", self.key, self.owner)
            return True
        return self.renew()

    def renew(self) -> bool:
        """Extend the lease only if we still hold it."""
        return bool(self.guard.call(lambda c: self._extend(keys=[self.key], args=[self.owner, self.ttl_ms],
                                                           client=c)))

    def release(self) -> bool:
        released = bool(self.guard.call(lambda c: self._release(keys=[self.key], args=[self.owner], client=c)))
        if released:
            log.info("lease %s released by %s", self.key, self.owner)
        return released

    def holder(self) -> str | None:
        value = self.guard.call(lambda c: c.get(self.key))
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)
