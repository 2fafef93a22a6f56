"""One active controller per namespace: a lease key with an expiry, and a fencing token.

The holder writes its owner token with ``SET NX PX`` and renews it with a Lua
compare-and-extend, so only the holder can extend or release it. A standby instance
retries the ``SET NX`` until the holder stops renewing (it died or hung) and the key
expires. Taking the lease increments the fencing counter (``<key>:fence``, never reset) in
the same script: ``token`` is this holder's number. The controller sends it with every
registry write (a Lua script refuses a token older than the counter) and every engine call
(the engine refuses a token older than the highest it has seen), so a leader that lost the
lease without knowing it can no longer change anything.

The counter must never go backwards for an engine, whatever Redis lost. Taking the lease also
records the owner that got the number (``<key>:fence:holder``), so a registry write of an equal
token from another owner is refused too. A leader that meets an engine whose highest token is
above its own (Redis restarted empty, or lost the tail of its log) calls ``raise_above``: while it
still holds the lease, the counter goes past every highest seen in one script, and the leader
takes that number (``controller.runner``). Taking the lease and raising the counter are followed by
``WAIT`` under Sentinel (``events.connection.durability``), as every durable write is: a failover
cannot hand a standby a counter older than a token an engine already saw, nor a lease nobody took.

Redis may also lose its last writes without losing everything: with AOF ``everysec`` a host crash loses
up to a second, and a takeover in that second with it, so the next standby would be handed the lost leader's
number again (the engines, which fence by number alone, would take both). So a number is never handed out
twice: the script that hands one out (``_NEXT_TOKEN``) records the run id of the server that did
(``<key>:fence:run``). On the same run it increments; on another (the server restarted or failed over since)
and from then on, the token is also at least the server's clock in microseconds, so every token is at least
the time it was handed out, and one a restarted server hands out is larger than any it gave before its crash.
This costs nothing measurable per takeover (an ``INFO server`` and a ``TIME`` inside the script, no extra round
trip, no fsync wait). It assumes the clock of the server that restarts does not step back by more than the
time the restart took (a restart takes seconds; NTP slews rather than steps), and that tokens stay below the
clock (only ``raise_above`` can put the counter past it, to a number an engine reported). Tokens stay below
``MAX_TOKEN`` until the year 2255.

Renewals get a short reconnect budget (a third of the lease): a leader that cannot renew
must notice in time to step down (``controller.runner``), not retry for a minute. A lease
whose holder was a process of this host that is gone (the owner token names host and pid)
is taken over at once instead of after it lapses: a supervised controller comes back in a
second, not a lease later.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

from rollout_bus.events import processes
from rollout_bus.events.connection import Guard, ReconnectPolicy, Redis, confirm_replicated, durability

log = logging.getLogger(__name__)

MAX_TOKEN = 2 ** 53 - 2
"""The largest fencing token a raise goes to: Lua numbers are doubles, exact up to 2**53."""

CLOCK_FLOOR = 10 ** 15
"""Tokens from here up are clock-folded (microseconds since the epoch: 10**15 is September 2001)."""

# The next token, given the counter's value and a floor (the highest an engine saw, 0 for none). A plain
# increment while this Redis process handed out every number since the counter began. Otherwise (the server
# restarted or failed over since the last handout: its last second of writes may be gone with tokens in it), and
# from then on, the larger of that and the server's clock in microseconds: a token handed out at time t is at
# least t, so any number a lost write held is below the clock of the restarted server. KEYS[4] holds the run id
# of the server that handed out the last number. INFO is not served in some test doubles' scripts: no run id.
_NEXT_TOKEN = """
local function next_token(current, floor)
  local info = redis.pcall('INFO', 'server')
  local run = ''
  if type(info) == 'string' then
    run = string.match(info, 'run_id:(%x+)') or ''
  end
  local last = redis.call('GET', KEYS[4])
  local token = math.max(current, floor) + 1
  if current >= CLOCK_FLOOR or (last and last ~= run) or (not last and current > 0) then
    local now = redis.call('TIME')
    token = math.max(token, tonumber(now[1]) * 1000000 + tonumber(now[2]))
  end
  redis.call('SET', KEYS[2], string.format('%d', token))
  redis.call('SET', KEYS[4], run)
  return token
end
""".replace("CLOCK_FLOOR", str(CLOCK_FLOOR))

# KEYS[1] lease, KEYS[2] fence counter, KEYS[3] fence holder, KEYS[4] the run id of the last handout; ARGV[1]
# owner, ARGV[2] ttl ms. Returns the new tenure's fencing token, 0 if held by someone else. Every acquisition is a
# new tenure with a new token, also one by the owner whose key has not lapsed yet (a leader that stepped down and
# takes the lease back): its engines have seen its old token, and an equal one would read as another holder's.
_ACQUIRE = _NEXT_TOKEN + """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) or redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  local token = next_token(tonumber(redis.call('GET', KEYS[2]) or '0'), 0)
  redis.call('SET', KEYS[3], ARGV[1])
  return token
end
return 0
"""

# KEYS as _ACQUIRE; ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] highest token seen. Only while ARGV[1] holds the lease:
# the counter goes past both its value and the highest seen. Returns the new token, 0 when the lease is not ours.
_RAISE = _NEXT_TOKEN + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local token = next_token(tonumber(redis.call('GET', KEYS[2]) or '0'), tonumber(ARGV[3]))
redis.call('SET', KEYS[3], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return token
"""

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
                 guard: Guard | None = None, fence_key: str | None = None) -> None:
        self.client = client
        self.key = key
        self.fence_key = fence_key or f"{key}:fence"
        self.holder_key = f"{self.fence_key}:holder"
        self.run_key = f"{self.fence_key}:run"
        d = durability(client)  # a lease write waits for its replicas no longer than a third of the lease: past
        self.durability = dataclasses.replace(d, wait_s=min(d.wait_s, ttl_s / 3))  # it, no controller leads
        self.owner = owner
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.guard = guard or Guard(client, ReconnectPolicy(max_wait_s=max(0.05, ttl_s / 3)), name=f"lease {key}")
        self.token: int | None = None
        """The fencing token of the current tenure; None before the lease was taken."""
        self._acquire = client.register_script(_ACQUIRE)
        self._raise = client.register_script(_RAISE)
        self._extend = client.register_script(_EXTEND)
        self._release = client.register_script(_RELEASE)

    @property
    def _fence_keys(self) -> list[str]:
        return [self.key, self.fence_key, self.holder_key, self.run_key]

    def _durable(self, what: str, script: Callable[..., Any], keys: list[str], args: list[Any]) -> Any:
        """Run ``script``, then (under Sentinel) ``WAIT`` for the replicas on the same connection."""
        d = self.durability
        if d.replicas == 0:
            return self.guard.call(lambda c: script(keys=keys, args=args, client=c))

        def attempt() -> tuple[Any, int]:
            def send(c: Any) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                script(keys=keys, args=args, client=pipe)
                pipe.execute_command("WAIT", d.replicas, d.timeout_ms)
                return list(pipe.execute())
            result, acks = self.guard.call(send)
            return result, int(acks)
        return confirm_replicated(d, f"{what} {self.key}", attempt)

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it, or its holder died on this host (or take it back if its key is
        still ours); ``token`` is then this new tenure's."""
        args = [self.owner, self.ttl_ms]
        token = int(self._durable("lease", self._acquire, self._fence_keys, args))
        if not token and self._drop_dead_holder():
            token = int(self._durable("lease", self._acquire, self._fence_keys, args))
        if not token:
            return False
        if token != self.token:
            log.info("lease %s acquired by %s (fencing token %d)", self.key, self.owner, token)
        self.token = token
        return True

    def raise_above(self, highest: int) -> int:
        """Only while we hold the lease: move the fencing counter past both its value and ``highest`` (a token
        an engine has seen) and take the new number; returns it, or 0 when the lease is not ours."""
        if not 0 <= highest <= MAX_TOKEN:
            raise ValueError(f"a fencing token must be within 0..{MAX_TOKEN}, got {highest}")
        token = int(self._durable("fence raise", self._raise, self._fence_keys, [self.owner, self.ttl_ms, highest]))
        if token:
            log.warning("lease %s: fencing counter raised past %d to %d for %s", self.key, highest, token,
                        self.owner)
            self.token = token
        return token

    def renew(self) -> bool:
        """Extend the lease only if we still hold it. Not waited for: a renewal a failover loses only shortens the
        lease, and the token it carries is already durable; a replica late to answer must not depose the leader."""
        return bool(self.guard.call(lambda c: self._extend(keys=[self.key], args=[self.owner, self.ttl_ms],
                                                           client=c)))

    def release(self) -> bool:
        released = bool(self.guard.call(lambda c: self._release(keys=[self.key], args=[self.owner], client=c)))
        if released:
            log.info("lease %s released by %s", self.key, self.owner)
        return released

    def _drop_dead_holder(self) -> bool:
        """Delete the lease if its holder (``owner_token``) ran on this host and its process is gone."""
        holder = self.holder()
        if holder is None:
            return False
        parts = holder.rsplit(":", 3)
        if len(parts) != 4 or parts[1] != socket.gethostname() or not parts[2].isdigit():
            return False
        pid = int(parts[2])
        if pid == os.getpid() or processes.alive(pid):
            return False
        if not self.guard.call(lambda c: self._release(keys=[self.key], args=[holder], client=c)):
            return False
        log.warning("lease %s was held by pid %d of this host, which is gone: taking it over", self.key, pid)
        return True

    def holder(self) -> str | None:
        value = self.guard.call(lambda c: c.get(self.key))
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)
