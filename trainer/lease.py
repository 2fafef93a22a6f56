"""One active trainer per policy: a lease held by the ranks of one trainer.

Two trainers of one policy would corrupt each other without a word: the same weight paths,
each acking the other's batches as foreign, and each one's ``wait_serving`` satisfied by the
other's version. So a trainer takes ``keys.trainer_lease(policy)`` before it joins: a hash whose
``owner`` is ``<trainer_id>/<dp_size>`` and whose ``r<rank>`` fields are the ranks holding it
(``token|until_ms|host:pid``, renewed every third of the ttl by a thread). Ranks of the same
trainer and data-parallel size join; anyone else is refused with a message that names the
holder. A holder that died on this host (its pid is gone) is replaced at once; one on another
host is waited for until its lease lapses (``wait_s``), then the newcomer is refused.

A lease that lapsed is lost for good: renewal extends only a rank field that still carries this
holder's token and has not lapsed, so a trainer paused past its ttl never takes the policy back
behind the back of one that took it meanwhile (or released it since). Every write of the trainer is
bound to the lease (``fence``, ``events.leased``): its events, acks and payload releases check the
token in the same script as the write, and its files (weight versions, checkpoints) are renamed in
only after ``verify`` asked the server. A deposed trainer gets ``LeaseLost`` and stops.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from rollout_bus.events import processes
from rollout_bus.events.connection import Guard, ReconnectPolicy, Redis, as_str
from rollout_bus.events.errors import BusError, InvalidRequest, LeaseLost
from rollout_bus.events.leased import CHECK_ONLY, LeaseFence, guarded
from rollout_bus.events.names import Keys

log = logging.getLogger(__name__)

# KEYS[1] lease hash; ARGV[1] owner, ARGV[2] rank, ARGV[3] token, ARGV[4] ttl ms, ARGV[5] holder, ARGV[6] '1' to
# renew only (a rank field of this token that has not lapsed), '0' to take.
# Returns {1, owner, ''} when held (taken or renewed), else {0, the owner holding it, the rank's value}.
_TAKE = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local owner = redis.call('HGET', KEYS[1], 'owner')
local all = redis.call('HGETALL', KEYS[1])
local alive = 0
local mine = nil
for i = 1, #all, 2 do
  local rank = string.match(all[i], '^r(%d+)$')
  if rank then
    local untl = tonumber(string.match(all[i + 1], '^[^|]*|(%d+)|'))
    if untl == nil or untl <= now then
      redis.call('HDEL', KEYS[1], all[i])
    else
      alive = alive + 1
      if rank == ARGV[2] then mine = all[i + 1] end
    end
  end
end
if alive > 0 and owner ~= ARGV[1] then return {0, owner or '', ''} end
if ARGV[6] == '1' and not mine then return {0, owner or '', ''} end
if mine and string.match(mine, '^([^|]*)|') ~= ARGV[3] then return {0, owner or '', mine} end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'r' .. ARGV[2], ARGV[3] .. '|' .. (now + tonumber(ARGV[4])) .. '|' .. ARGV[5])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]))
return {1, ARGV[1], ''}
"""

# KEYS[1] lease hash; ARGV[1] field, ARGV[2] the value it must still have. Removes the key when no rank is left.
_DROP = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
local left = 0
for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
  if string.match(name, '^r%d+$') then left = left + 1 end
end
if left == 0 then redis.call('DEL', KEYS[1]) end
return 1
"""


class PolicyTaken(InvalidRequest):
    """Another trainer holds the policy; the message says which and what to do."""


__all__ = ["Holder", "LeaseLost", "PolicyLease", "PolicyTaken"]


@dataclass(frozen=True)
class Holder:
    token: str
    until_ms: int
    host: str
    pid: int

    @classmethod
    def parse(cls, value: str) -> Holder | None:
        token, _, rest = value.partition("|")
        until, _, where = rest.partition("|")
        host, _, pid = where.rpartition(":")
        try:
            return cls(token, int(until), host, int(pid))
        except ValueError:
            return None


class PolicyLease:
    """The lease of one rank of one trainer on ``policy``; ``acquire``, a renewal thread, ``release``."""

    def __init__(self, client: Redis, keys: Keys, policy: str, trainer_id: str, *, rank: int = 0,
                 dp_size: int = 1, ttl_s: float = 30.0, wait_s: float | None = None) -> None:
        self.client = client
        self.key = keys.trainer_lease(policy)
        self.policy = policy
        self.owner = f"{trainer_id}/{dp_size}"
        self.rank = rank
        self.ttl_ms = max(100, int(ttl_s * 1000))
        self.wait_s = ttl_s + 1.0 if wait_s is None else wait_s
        self.token = uuid.uuid4().hex[:16]
        self.host = socket.gethostname()
        self.guard = Guard(client, ReconnectPolicy(max_wait_s=max(1.0, ttl_s / 3)), name=f"trainer lease {policy}")
        self._take = client.register_script(_TAKE)
        self._drop = client.register_script(_DROP)
        self._check = client.register_script(CHECK_ONLY)
        self._check_guard = Guard(client, name=f"trainer lease check {policy}")
        """The default reconnect budget, as the writes it stands in front of have (not the renewal's short one)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = threading.Event()

    @property
    def fence(self) -> LeaseFence:
        """What a write bound to this lease carries (``events.leased``)."""
        return LeaseFence(self.key, f"r{self.rank}", self.token)

    def _try(self, *, renew: bool = False) -> tuple[bool, str, str]:
        args: list[str | int] = [self.owner, self.rank, self.token, self.ttl_ms, f"{self.host}:{os.getpid()}",
                                 int(renew)]
        held, owner, value = self.guard.call(lambda c: self._take(keys=[self.key], args=args, client=c))
        return bool(held), as_str(owner), as_str(value)

    def acquire(self) -> None:
        """Take the lease (waiting up to ``wait_s`` for a lapsing one) and start renewing it."""
        deadline = time.monotonic() + self.wait_s
        while True:
            held, owner, value = self._try()
            if held:
                break
            if self._replace_dead_holders():
                continue
            if time.monotonic() >= deadline:
                raise PolicyTaken(self._refusal(owner, value))
            self._stop.wait(min(0.5, self.ttl_ms / 4000))
        log.info("trainer lease on policy %s: rank %d of %s", self.policy, self.rank, self.owner)
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease-{self.policy}", daemon=True)
        self._thread.start()

    def _refusal(self, owner: str, value: str) -> str:
        holder = Holder.parse(value) if value else None
        where = f" (rank {self.rank} held by {holder.host} pid {holder.pid})" if holder else ""
        trainer, _, size = owner.partition("/")
        return (f"policy {self.policy!r} is already trained by {trainer!r} with {size or '?'} data-parallel "
                f"rank(s){where}: a second trainer of one policy would overwrite its weight versions and ack "
                f"its batches. Stop the other trainer, train another policy, or join as one of its ranks "
                f"(the same trainer id with --dp-rank and --dp-size)")

    def _replace_dead_holders(self) -> bool:
        """Drop ranks held by processes of this host that are gone (or by an earlier client in this process)."""
        fields: dict[bytes, bytes] = self.guard.call(lambda c: c.hgetall(self.key))
        dropped = False
        for name, raw in fields.items():
            if not as_str(name).startswith("r"):
                continue
            holder = Holder.parse(as_str(raw))
            if holder is None or holder.host != self.host or holder.token == self.token:
                continue
            ours_before = holder.pid == os.getpid() and as_str(name) == f"r{self.rank}" and (
                as_str(fields.get(b"owner", b"")) == self.owner)
            if ours_before or not processes.alive(holder.pid):
                log.warning("policy %s: %s was held by pid %d, which is gone; taking it over", self.policy,
                            as_str(name), holder.pid)
                args = [name, raw]
                dropped = bool(self.guard.call(lambda c: self._drop(keys=[self.key], args=args,  # noqa: B023
                                                                    client=c))) or dropped
        return dropped

    def _renew_loop(self) -> None:
        period = self.ttl_ms / 3000
        while not self._stop.wait(period):
            try:
                held, owner, _ = self._try(renew=True)
            except BusError as exc:
                log.warning("renewing the trainer lease of %s failed: %s", self.policy, exc)
                continue
            if not held:
                log.error("the trainer lease of policy %s lapsed (%s): this trainer is deposed and must stop",
                          self.policy, f"now held by {owner}" if owner else "no holder now")
                self.lost.set()
                return

    def check(self) -> None:
        """``LeaseLost`` when the renewal thread found the lease lapsed (no round trip)."""
        if self.lost.is_set():
            raise LeaseLost(f"its lease on policy {self.policy!r} lapsed while it was paused or cut off longer than "
                            f"its ttl ({self.ttl_ms / 1000:g}s)")

    def verify(self) -> None:
        """Ask the server whether this holder's lease still holds (its token, not lapsed); ``LeaseLost`` if not.

        For writes outside Redis (a file renamed in): checked right before them."""
        self.check()
        try:
            guarded(self._check_guard, lambda c: self._check(keys=self.fence.keys(), args=self.fence.args(),
                                                             client=c))
        except LeaseLost:
            self.lost.set()
            raise

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        try:
            fields: dict[bytes, bytes] = self.guard.call(lambda c: c.hgetall(self.key))
            raw = fields.get(f"r{self.rank}".encode())
            if raw is not None and as_str(raw).startswith(self.token + "|"):
                self.guard.call(lambda c: self._drop(keys=[self.key], args=[f"r{self.rank}", raw], client=c))
        except BusError as exc:  # it lapses by itself
            log.warning("releasing the trainer lease of %s failed: %s", self.policy, exc)

