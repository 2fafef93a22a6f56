"""The data source's position, shared by every executor through one Redis hash per source.

Prompts are *reserved per request*: the first attempt of request ``rid`` draws round
``k``'s prompts from the saved state and, in one transaction, stores the advanced state
and the reservation ``r:<rid>:<k>``. A retry of the request (another executor, after a
crash) finds the reservation and reuses exactly those prompts, so a dead executor never
makes the run skip or repeat a prompt. Just before the batch is published the executor
records which prompts it used (``u:<rid>``); after the publish, ``finalize`` drops the
reservations and returns unused prompts (over-sampling leftovers) to the pool. A request
that fails for good returns its prompts too (``release``), except when the prompts
themselves were the problem.

Fields of the hash ``keys.data_cursor(policy, source.name)``:
``state`` (msgpack of ``source.save()``), ``returned`` (msgpack list of items that go
out again first), ``r:<rid>:<round>`` (reserved items), ``u:<rid>`` (used item indices).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from typing import Any

import msgpack

from rollout_bus.events.connection import Guard, Redis
from rollout_bus.events.names import Keys
from rollout_bus.executor.errors import DataError
from rollout_bus.executor.plugins import DataSource

log = logging.getLogger(__name__)

STATE = "state"
RETURNED = "returned"

Item = dict[str, Any]


def _pack(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError) as exc:
        raise DataError(f"data source produced something that cannot be saved: {exc}") from None


def _unpack(raw: bytes | None, default: Any) -> Any:
    return default if raw is None else msgpack.unpackb(raw, raw=False)


class CursorStore:
    """Reservations and commits of data-source positions under one namespace."""

    def __init__(self, client: Redis, keys: Keys, guard: Guard | None = None) -> None:
        self.client = client
        self.keys = keys
        self.guard = guard or Guard(client, name="data cursor")
        self._lock = threading.Lock()  # a source object holds one state at a time

    def key(self, policy: str, source: DataSource) -> str:
        return self.keys.data_cursor(policy, source.name)

    def reserve(self, key: str, source: DataSource, rid: str, round_: int, n: int,
                returned: list[Item] | None = None) -> list[Item]:
        """The items of round ``round_`` of request ``rid``: drawn now, or the ones drawn before.

        ``returned`` (items the request gives back to the source) joins the source's returned
        items in the same transaction as round 0's reservation, so a retried request, which
        finds that reservation, never gives them back twice.
        """
        field = f"r:{rid}:{round_}"
        drawn: list[Item] = []

        def draw(pipe: Any) -> None:
            state_raw, returned_raw, reserved = pipe.hmget(key, [STATE, RETURNED, field])
            if reserved is not None:
                drawn[:] = _unpack(reserved, [])
                return
            source.load(_unpack(state_raw, None))
            back = _unpack(returned_raw, [])
            if round_ == 0 and returned:
                back = _merge(back, returned)
            if back:
                source.add_samples(back)
            items = list(source.get_samples(n))
            new_state = _pack(source.save())
            packed = _pack(items)
            pipe.multi()
            pipe.hset(key, mapping={STATE: new_state, field: packed})
            pipe.hdel(key, RETURNED)
            drawn[:] = items

        with self._lock:
            self.guard.call(lambda c: c.transaction(draw, key))
        return drawn

    def draw_fresh(self, source: DataSource, n: int) -> list[Item]:
        """The first ``n`` items of a fresh ``source`` (eval): no state read or written."""
        with self._lock:
            source.load(None)
            return list(source.get_samples(n))

    def mark_used(self, key: str, rid: str, indices: list[int]) -> None:
        self.guard.call(lambda c: c.hset(key, f"u:{rid}", _pack(sorted(indices))))

    def finalize(self, key: str, rid: str) -> int:
        """After the batch is out: drop ``rid``'s reservations, return the unused items; how many."""
        return self._settle(key, rid, used_only=True, drop=False)

    def release(self, key: str, rid: str, *, drop: bool | Collection[int] = False) -> int:
        """After ``rid`` failed for good: return its reserved items, except ``drop`` (True: all, or indices)."""
        return self._settle(key, rid, used_only=False, drop=drop)

    def reservations(self, key: str, rid: str) -> list[str]:
        return _reservation_fields(self.guard.call(lambda c: c.hkeys(key)), rid)

    def _settle(self, key: str, rid: str, *, used_only: bool, drop: bool | Collection[int]) -> int:
        returned_count = [0]
        used_field = f"u:{rid}"

        def settle(pipe: Any) -> None:
            fields = _reservation_fields(pipe.hkeys(key), rid)
            if not fields:
                returned_count[0] = 0
                pipe.multi()
                pipe.hdel(key, used_field)
                return
            values = pipe.hmget(key, [*fields, used_field, RETURNED])
            reserved: list[Item] = [item for raw in values[:len(fields)] for item in _unpack(raw, [])]
            keep_out = set(_unpack(values[len(fields)], [])) if used_only else set()
            if drop is True:
                back: list[Item] = []
            else:
                keep_out |= set(drop or ())
                back = [it for it in reserved if it.get("index") not in keep_out]
            returned_count[0] = len(back)
            pipe.multi()
            if back:
                pipe.hset(key, RETURNED, _pack(_merge(_unpack(values[-1], []), back)))
            pipe.hdel(key, *fields, used_field)

        self.guard.call(lambda c: c.transaction(settle, key))
        if returned_count[0]:
            log.info("request %s: %d prompt(s) go back to the data source", rid, returned_count[0])
        return returned_count[0]


def _reservation_fields(names: list[Any], rid: str) -> list[str]:
    prefix = f"r:{rid}:"
    decoded = (n.decode() if isinstance(n, bytes) else str(n) for n in names)
    return [n for n in decoded if n.startswith(prefix)]


def _merge(current: list[Item], items: list[Item]) -> list[Item]:
    have = {it.get("index") for it in current}
    return current + [it for it in items if it.get("index") not in have]
