"""Writes bound to a lease: the lease check and the write in one Lua script.

A lease is a hash field ``<token>|<until_ms>|<anything>`` that its holder renews (the trainer's
policy lease, ``trainer.lease``). ``leased(script)`` turns any write script into one that first
checks, on the server's clock, that the field still carries the holder's token and has not
lapsed, and refuses with ``LEASE_LOST`` otherwise; the check and the write are one atomic step,
so a holder paused past its lease (SIGSTOP, a long GC, a cut network) cannot write after it
wakes, whatever it believes. The wrapped script sees its own ``KEYS`` and ``ARGV``: the lease's
key and arguments go first and are stripped before it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rollout_bus.events.connection import Guard
from rollout_bus.events.errors import LeaseLost, RedisCommandError

T = TypeVar("T")

LEASE_LOST = "LEASE_LOST"

# KEYS[1] lease hash; ARGV[1] the holder's field, ARGV[2] its token.
_CHECK = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
local token, untl = nil, nil
if held then token, untl = string.match(held, '^([^|]*)|(%d+)|') end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
if token ~= ARGV[2] then
  return redis.error_reply('LEASE_LOST ' .. KEYS[1] .. ' ' .. ARGV[1] .. ': '
    .. (held and ('held by another holder (' .. string.gsub(string.sub(held, 1, 80), '[^%w%.%-_:|]', '?') .. ')')
        or 'lapsed, no holder'))
end
if tonumber(untl) <= now then
  return redis.error_reply('LEASE_LOST ' .. KEYS[1] .. ' ' .. ARGV[1] .. ': lapsed ' .. (now - tonumber(untl))
    .. ' ms ago')
end
"""

CHECK_ONLY = _CHECK + "return 1\n"
"""The check alone: for a write outside Redis (a file renamed in), checked right before it."""


def leased(script: str) -> str:
    """``script`` run only while the lease holds: its keys and arguments follow the lease's
    (``KEYS[1]`` the lease hash, ``ARGV[1..2]`` the holder's field and token)."""
    return (f"{_CHECK}local function write(KEYS, ARGV)\n{script}\nend\n"
            "return write({unpack(KEYS, 2)}, {unpack(ARGV, 3)})\n")


@dataclass(frozen=True)
class LeaseFence:
    """Who must still hold which lease for a write to go through."""

    key: str
    field: str
    token: str

    def keys(self, *rest: Any) -> list[Any]:
        return [self.key, *rest]

    def args(self, *rest: Any) -> list[Any]:
        return [self.field, self.token, *rest]


def lease_lost(exc: BaseException) -> LeaseLost | None:
    """``exc`` as ``LeaseLost`` when it is a leased write's refusal, else None."""
    if isinstance(exc, LeaseLost):
        return exc
    if LEASE_LOST in str(exc):
        return LeaseLost(f"lease lost: {str(exc).split(LEASE_LOST, 1)[1].strip()}")
    return None


def guarded(guard: Guard, fn: Callable[[Any], T]) -> T:
    """``guard.call(fn)``, with a leased write's refusal raised as ``LeaseLost``."""
    try:
        return guard.call(fn)
    except RedisCommandError as exc:
        raise lease_lost(exc) or exc from None
