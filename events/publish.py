"""Idempotent publishing: the dedupe key and the XADD in one Lua script.

Dedupe keys expire. One keyed by the event id only guards against the guard's own re-send
after a lost reply, so it lives ``RETRY_DEDUPE_TTL_S``; one keyed by a business key (request,
batch, step) guards against a retried job or a restarted role publishing again, possibly much
later, so it lives ``dedupe_ttl_s`` (7 days unless ``ROLLOUT_BUS_DEDUPE_TTL_S`` says otherwise:
a deployment that keeps Redis memory tight trades that window for memory, about 1 KB per
training step at the default).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import redis
from hiredis import pack_command
from redis.exceptions import NoScriptError

from rollout_bus.events.connection import (
    Durability,
    Guard,
    Lane,
    as_str,
    confirm_replicated,
    durability,
    pack,
    raise_errors,
    status_hook,
)
from rollout_bus.events.errors import RedisCommandError
from rollout_bus.events.leased import LeaseFence, lease_lost, leased
from rollout_bus.events.names import Keys
from rollout_bus.events.schema import FIELD, Event, Producer, encode_bytes, seq_slot
from rollout_bus.events.settings import env_int

log = logging.getLogger(__name__)

SEQ_LUA = """
local function next_seq(seqs, producer)
  return tonumber(redis.call('HGET', seqs, producer) or 0) + 1
end
local function with_seq(raw, slot, n, width)  -- width: bytes at the slot now (1: the 0)
  local v
  if n < 128 then
    v = string.char(n)
  elseif n < 65536 then
    v = string.char(205, math.floor(n / 256), n % 256)
  elseif n < 4294967296 then
    v = string.char(206, math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
                    math.floor(n / 256) % 256, n % 256)
  else  -- uint 64 (numbers stay exact in Lua's doubles up to 2**53)
    local hi, lo = math.floor(n / 4294967296), n % 4294967296
    v = string.char(207, math.floor(hi / 16777216) % 256, math.floor(hi / 65536) % 256,
                    math.floor(hi / 256) % 256, hi % 256, math.floor(lo / 16777216) % 256,
                    math.floor(lo / 65536) % 256, math.floor(lo / 256) % 256, lo % 256)
  end
  return string.sub(raw, 1, slot - 1) .. v .. string.sub(raw, slot + (width or 1))
end
local function seq_width(n)  -- bytes with_seq writes for n
  if n < 128 then return 1 elseif n < 65536 then return 3 elseif n < 4294967296 then return 5 end
  return 9
end
local function stamp_seq(fields, slot, seqs, producer)
  if slot == 0 then return nil end
  local n = next_seq(seqs, producer)
  fields[2] = with_seq(fields[2], slot, n)
  return n
end
"""
"""Lua shared by the publish scripts: ``stamp_seq`` writes a producer's next sequence number into the
encoded event (``fields[2]``) at its ``seq`` slot (``schema.seq_slot``: one byte, 0, replaced by the
number as msgpack) and returns it (nil for slot 0: no number). The script sets the counter only after
its XADD succeeded: a publish that fails or is deduplicated takes no number."""

# KEYS[1] stream, KEYS[2] producer sequences, KEYS[3] dedupe key (absent for none); ARGV[1] dedupe ttl s,
# ARGV[2] maxlen (0 = none), ARGV[3] seq slot in ARGV[6] (0 = none), ARGV[4] producer, ARGV[5..] field,
# value pairs. Returns the id of the entry, the existing one on a repeat.
PUBLISH_BODY = """
if KEYS[3] then
  local prev = redis.call('GET', KEYS[3])
  if prev then return prev end
end
local fields = {unpack(ARGV, 5)}
local n = stamp_seq(fields, tonumber(ARGV[3]), KEYS[2], ARGV[4])
local id
if tonumber(ARGV[2]) > 0 then
  id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(fields))
else
  id = redis.call('XADD', KEYS[1], '*', unpack(fields))
end
if n then redis.call('HSET', KEYS[2], ARGV[4], n) end
if KEYS[3] then
  redis.call('SET', KEYS[3], id, 'EX', tonumber(ARGV[1]))
end
return id
"""
"""The per-event publish script's body (``SEQ_LUA`` before it): ``Publisher.publish_fields``'s, and for a script
that appends an event in the same step as its own write (``Publisher.prepared`` gives its keys and arguments)."""
_PUBLISH = SEQ_LUA + PUBLISH_BODY

# KEYS[1] stream, KEYS[2] producer sequences, KEYS[3] dedupe key; ARGV[1] maxlen (0 = none), ARGV[2] field,
# ARGV[3] dedupe ttl s, ARGV[4] producer, ARGV[5] its last number as the caller believes it (-1 for unknown),
# ARGV[6] seq slot (0 = none), ARGV[7] the encoded event, with the number the caller believes it gets at the slot
# (a 0 while unknown). Returns the entry's id (the existing one on a repeat) and the producer's number given to
# it (-1 for none).
ONE_BODY = """
local prev = redis.call('GET', KEYS[3])
if prev then return {prev, -1} end
local raw, slot, n = ARGV[7], tonumber(ARGV[6]), nil
if slot > 0 then
  n = tonumber(redis.call('HGET', KEYS[2], ARGV[4]) or 0) + 1
  local told = tonumber(ARGV[5])
  if told < 0 then
    raw = with_seq(raw, slot, n, 1)
  elseif n ~= told + 1 then
    raw = with_seq(raw, slot, n, seq_width(told + 1))
  end
end
local id
if tonumber(ARGV[1]) > 0 then
  id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', ARGV[2], raw)
else
  id = redis.call('XADD', KEYS[1], '*', ARGV[2], raw)
end
if n then redis.call('HSET', KEYS[2], ARGV[4], n) end
redis.call('SET', KEYS[3], id, 'EX', ARGV[3])
return {id, n or -1}
"""
"""One event as ``BATCH_BODY`` publishes it, without a batch's tables: ``Publisher.publish``'s script."""
_ONE = SEQ_LUA + ONE_BODY

# KEYS[1] stream, KEYS[2] producer sequences, KEYS[3..] one dedupe key per event; ARGV[1] maxlen (0 = none),
# ARGV[2] field, ARGV[3] the dedupe ttl s of an event id, ARGV[4] that of an idempotency key, ARGV[5] producers P,
# then P pairs (producer, its last number as the caller believes it: -1 for unknown), then 2 per event: (its
# producer's index * 2 + 1 for an idempotency key) * 64 + its seq slot (0 = none), and the encoded event, with
# the number the caller believes it gets at the slot (a 0 while unknown). Returns the entry ids (an error in
# place of an event whose XADD failed), then each producer's last number.
BATCH_BODY = """
local stream, seqs, field = KEYS[1], KEYS[2], ARGV[2]
local maxlen, ttls, np = tonumber(ARGV[1]), {[0] = ARGV[3], [1] = ARGV[4]}, tonumber(ARGV[5])
local names, last, told, base, guessed = {}, {}, {}, {}, {}
for p = 1, np do
  names[p] = ARGV[4 + 2 * p]
  last[p] = tonumber(redis.call('HGET', seqs, names[p]) or 0)
  base[p] = last[p]
  told[p] = tonumber(ARGV[5 + 2 * p])
  guessed[p] = told[p] >= 0
end
local ne = #KEYS - 2
local prev = redis.call('MGET', unpack(KEYS, 3))
local out, made, at = {}, {}, 6 + 2 * np
local function append()
  for i = 1, ne do
    local key, m = KEYS[2 + i], tonumber(ARGV[at])
    local slot = m % 64
    local business = math.floor(m / 64) % 2
    local p = math.floor(m / 128)
    if slot > 0 then told[p] = told[p] + 1 end  -- the number the caller wrote at the slot
    local id = prev[i] or made[key]
    if id then
      out[i] = id
    else
      local raw, n = ARGV[at + 1], nil
      if slot > 0 then
        n = last[p] + 1
        if not guessed[p] then
          raw = with_seq(raw, slot, n, 1)
        elseif n ~= told[p] then
          raw = with_seq(raw, slot, n, seq_width(told[p]))
        end
      end
      if maxlen > 0 then
        id = redis.pcall('XADD', stream, 'MAXLEN', '~', maxlen, '*', field, raw)
      else
        id = redis.pcall('XADD', stream, '*', field, raw)
      end
      out[i] = id
      if type(id) ~= 'table' then
        if n then last[p] = n end
        made[key] = id
        redis.call('SET', key, id, 'EX', ttls[business])
      end
    end
    at = at + 2
  end
end
local ok, err = pcall(append)
for p = 1, np do
  if last[p] ~= base[p] then redis.call('HSET', seqs, names[p], last[p]) end
  out[ne + p] = last[p]
end
if not ok then
  if type(err) == 'table' then return err end
  return redis.error_reply(tostring(err))
end
return out
"""
"""The batch publish: every event of one chunk in one script, each deduplicated, numbered and appended as
``PUBLISH_BODY`` appends one (a deduplicated or failed append takes no number; an error stops no other
event). The caller may write the number it expects at the slot itself: the script checks it against the
counter and rewrites the event only when it is wrong, so the caller's guess never decides a number."""
_BATCH = SEQ_LUA + BATCH_BODY

_Call = tuple[Sequence[Any], Sequence[Any]]  # (script keys, script args) of one EVALSHA

BATCH_EVENTS = 128
"""Events per script call of ``publish_many`` at most (a call's events are one step of the server)."""
BATCH_BYTES = 1 << 20
"""Encoded bytes per script call of ``publish_many`` at most (a larger event goes alone)."""

DEFAULT_DEDUPE_TTL_S = 7 * 86400
RETRY_DEDUPE_TTL_S = 600
"""An event-id dedupe key outlives any re-send of ``Guard`` (60 s budget by default) by far."""


def seq_bytes(n: int) -> bytes:
    """``n`` (>= 1) as ``SEQ_LUA``'s ``with_seq`` writes it at an event's seq slot (msgpack, the same bytes)."""
    if n < 128:
        return bytes((n,))
    if n < 65536:
        return b"\xcd" + n.to_bytes(2, "big")
    if n < 4294967296:
        return b"\xce" + n.to_bytes(4, "big")
    return b"\xcf" + n.to_bytes(8, "big")


def dedupe_ttl_from_env() -> int:
    """``ROLLOUT_BUS_DEDUPE_TTL_S`` (seconds a business-key dedupe key lives, at least ``RETRY_DEDUPE_TTL_S``),
    else 7 days."""
    return env_int("ROLLOUT_BUS_DEDUPE_TTL_S", DEFAULT_DEDUPE_TTL_S, minimum=RETRY_DEDUPE_TTL_S)


class Publisher:
    """Appends events to streams; a repeated idempotency key never adds a second entry.

    One round trip per event (``publish``: ``ONE_BODY``) or per batch of events (``publish_many``:
    ``BATCH_BODY``, one ``EVALSHA`` per ``BATCH_EVENTS``): each script loaded again if the server lost
    its script cache (e.g. after a restart). The commands go out already packed on a connection the
    publisher keeps (``events.connection.Lane``); ``close`` gives it back to the pool. The publisher
    writes each event's sequence number itself, as it last saw its producer's counter, and the
    script rewrites it only when the counter says otherwise (another publisher of the same name).

    A ``durable`` publish is acknowledged only once ``WAIT`` says enough replicas have it
    (``events.connection.durability``: 1 with Sentinel, none with a single Redis): the ``WAIT``
    goes out on the same connection, packed behind the ``EVALSHA``, so it costs no extra round trip.
    """

    def __init__(self, client: redis.Redis, keys: Keys, producer: Producer, *,
                 dedupe_ttl_s: int | None = None, guard: Guard | None = None) -> None:
        self.client = client
        self.keys = keys
        self.producer = producer
        self.dedupe_ttl_s = dedupe_ttl_from_env() if dedupe_ttl_s is None else dedupe_ttl_s
        """Lifetime of a dedupe key given as an idempotency key (see the module docstring)."""
        self.retry_ttl_s = min(RETRY_DEDUPE_TTL_S, self.dedupe_ttl_s)
        self.guard = guard or Guard(client, name=f"publisher {producer}")
        self._script = client.register_script(_PUBLISH)
        self._lane = Lane(client)
        self._dedupe_prefix: dict[str, str] = {}
        self._producer_names: dict[Producer, str] = {}
        self.durability = durability(client)
        self._one = client.register_script(_ONE)
        self._batch = client.register_script(_BATCH)
        self._leased_batch: Any = None
        self._last_seq: dict[str, int] = {}
        """Each producer's last number as the batch script last returned it: ``publish_many`` writes the next
        ones into its events itself, which spares the script rewriting them (it checks each one)."""
        self.durability_status = status_hook(client, keys.durability_status, str(producer))

    def publish(self, stream: str, event: Event, *, idempotency_key: str | None = None,
                maxlen: int = 0, durable: bool = False, lease: LeaseFence | None = None) -> str:
        """Append ``event``; the idempotency key defaults to the event id, so a retry is safe.

        ``durable``: return only once the replicas acknowledged it (``ReplicationTimeout`` if they do not).
        ``lease``: append only while that lease holds, checked in the same script (``LeaseLost`` otherwise).
        ``ONE_BODY`` on the hot path, else ``publish_many`` of the one event.
        """
        if lease is not None or not self._lane.direct or (durable and self.durability.replicas):
            return self.publish_many(stream, [event], idempotency_keys=[idempotency_key], maxlen=maxlen,
                                     durable=durable, lease=lease)[0]
        if not isinstance(maxlen, int):
            raise TypeError(f"maxlen must be an int, got {type(maxlen).__name__}")
        # the hot path: one packed EVALSHA on the kept connection, no per-call lists or closures
        raw = encode_bytes(event)
        name = self._producer_name(event.producer)
        known = self._last_seq.get(name)
        slot = seq_slot(raw)
        if slot and known is not None:
            raw = raw[:slot - 1] + seq_bytes(known + 1) + raw[slot:]
        args = (3, stream, self.keys.producer_seqs, self._dedupe_key(stream, idempotency_key or event.event_id),
                maxlen, FIELD, self.dedupe_ttl_s if idempotency_key else self.retry_ttl_s, name,
                -1 if known is None else known, slot, raw)
        lane, script = self._lane, self._one
        packed = pack_command(("EVALSHA", script.sha, *args))  # type: ignore[arg-type]  # (hiredis' stub: a 1-tuple)

        def send(c: redis.Redis) -> Any:
            reply = lane.execute(packed)[0]
            if isinstance(reply, NoScriptError):  # a restarted or flushed server: empty cache
                script.sha = c.script_load(script.script)
                reply = lane.execute(pack_command(("EVALSHA", script.sha, *args)))[0]  # type: ignore[arg-type]
            if isinstance(reply, redis.ResponseError):
                raise reply
            return reply
        entry, n = self.guard.call(send)
        if n != -1:
            self._last_seq[name] = n
        return as_str(entry)

    def prepared(self, stream: str, event: Event) -> tuple[list[Any], list[Any]]:
        """The keys and arguments of ``PUBLISH_BODY`` that append ``event`` as ``publish`` does (deduplicated
        by its event id), for a script that appends it in one step with a write of its own."""
        raw = encode_bytes(event)
        return ([stream, self.keys.producer_seqs, self._dedupe_key(stream, event.event_id)],
                [self.retry_ttl_s, 0, seq_slot(raw), self._producer_name(event.producer), FIELD, raw])

    def publish_many(self, stream: str, events: Iterable[Event], *,
                     idempotency_keys: Sequence[str | None] | None = None, maxlen: int = 0,
                     durable: bool = False, lease: LeaseFence | None = None) -> list[str]:
        """Append ``events`` in order, in one round trip; each is deduplicated as by ``publish``.

        Returns the entry ids in the order of ``events`` (an event whose key was seen before
        gets the existing entry's id). The publishes are independent, not a transaction: after
        an error some may have been appended, and calling again with the same events (or keys)
        appends only the rest. ``lease``: append only while that lease holds (``LeaseLost`` otherwise).

        One ``EVALSHA`` per ``BATCH_EVENTS`` events (``BATCH_BODY``), all sent at once: one dedupe read
        and one counter read and write for the chunk, one ``XADD`` and one dedupe key per new event.
        """
        events = list(events)
        if idempotency_keys is not None and len(idempotency_keys) != len(events):
            raise ValueError(f"{len(idempotency_keys)} idempotency keys for {len(events)} events")
        if not isinstance(maxlen, int):
            raise TypeError(f"maxlen must be an int, got {type(maxlen).__name__}")
        if not events:
            return []
        calls, sizes, names = self._batch_calls(stream, events, idempotency_keys, maxlen)
        script = self._batch
        if lease is not None:
            if self._leased_batch is None:
                self._leased_batch = self.client.register_script(leased(_BATCH))
            script = self._leased_batch
            calls = [(lease.keys(*k), lease.args(*a)) for k, a in calls]
        try:
            replies = self._run(calls, durable, script)
        except RedisCommandError as exc:
            raise (lease_lost(exc) or exc) if lease is not None else exc from None
        ids: list[Any] = []
        for reply, n, chunk_names in zip(replies, sizes, names, strict=True):
            for name, last in zip(chunk_names, reply[n:], strict=True):
                self._last_seq[name] = int(last)
            ids += reply[:n]
        for r in ids:
            if isinstance(r, redis.ResponseError):
                raise RedisCommandError(str(r))
        return [as_str(r) for r in ids]

    def _batch_calls(self, stream: str, events: list[Event], idempotency_keys: Sequence[str | None] | None,
                     maxlen: int) -> tuple[list[_Call], list[int], list[list[str]]]:
        """The ``BATCH_BODY`` calls that publish ``events`` (at most ``BATCH_EVENTS`` events or ``BATCH_BYTES`` a
        call), with the events of each call and its producers. Each event carries the number its producer's
        counter should give it as this publisher last saw the counter (none while it has not seen it)."""
        calls: list[_Call] = []
        sizes: list[int] = []
        names: list[list[str]] = []
        head = [stream, self.keys.producer_seqs]
        prefix = self._dedupe_key(stream, "")
        told: dict[str, int | None] = {}  # each producer's last number written into an event (None: unknown)
        keys: list[Any] = []
        args: list[Any] = []
        believed: dict[str, int] = {}  # this call's producers, in order: the last number before it (-1: unknown)
        order: dict[str, int] = {}  # producer -> its index in this call (from 1)
        size = 0

        def close() -> None:
            producers: list[Any] = [maxlen, FIELD, self.retry_ttl_s, self.dedupe_ttl_s, len(believed)]
            for name, last in believed.items():
                producers += [name, last]
            calls.append((head + keys, producers + args))
            sizes.append(len(keys))
            names.append(list(believed))

        producer: Producer | None = None
        name = ""
        for i, event in enumerate(events):
            raw = encode_bytes(event)
            if keys and (len(keys) >= BATCH_EVENTS or size + len(raw) > BATCH_BYTES):
                close()
                keys, args, believed, order, size = [], [], {}, {}, 0
            if event.producer is not producer:
                producer = event.producer
                name = self._producer_name(producer)
            if name not in order:
                if name not in told:
                    told[name] = self._last_seq.get(name)
                known = told[name]
                believed[name] = -1 if known is None else known
                order[name] = len(order) + 1
            slot = seq_slot(raw)
            if slot:
                n = told[name]
                if n is not None:
                    told[name] = n = n + 1
                    raw = raw[:slot - 1] + seq_bytes(n) + raw[slot:]
            key = idempotency_keys[i] if idempotency_keys is not None else None
            keys.append(prefix + (key or event.event_id))
            args += [(order[name] * 2 + (1 if key else 0)) * 64 + slot, raw]
            size += len(raw)
        close()
        return calls, sizes, names

    def publish_fields(self, stream: str, fields: dict[bytes, bytes], *, idempotency_key: str | None = None,
                       maxlen: int = 0, durable: bool = False) -> str:
        # no empty key name when there is no dedupe key: every key a script names must hash to one slot
        seqs = self.keys.producer_seqs
        script_keys = [stream, seqs, self._dedupe_key(stream, idempotency_key)] if idempotency_key else [stream, seqs]
        args: list[Any] = [self.dedupe_ttl_s, maxlen, 0, ""]  # raw fields: no event, no sequence number
        for k, v in fields.items():
            args += [k, v]
        return self._run([(script_keys, args)], durable)[0]

    def entry_for(self, stream: str, idempotency_key: str) -> str | None:
        """The entry an earlier publish under ``idempotency_key`` made (while its dedupe key lives), else None."""
        found = self.guard.call(lambda c: c.get(self._dedupe_key(stream, idempotency_key)))
        return as_str(found) if found is not None else None

    def forget(self, stream: str, idempotency_key: str) -> None:
        """Let a publish under ``idempotency_key`` add an entry again (its dedupe key goes)."""
        key = self._dedupe_key(stream, idempotency_key)
        self.guard.call(lambda c: c.delete(key))

    def close(self) -> None:
        """Give the publisher's connection back to the client's pool (a later publish takes one again)."""
        self._lane.close()

    def _producer_name(self, producer: Producer) -> str:
        name = self._producer_names.get(producer)
        if name is None:
            name = self._producer_names[producer] = str(producer)
        return name

    def _dedupe_key(self, stream: str, key: str) -> str:
        prefix = self._dedupe_prefix.get(stream)
        if prefix is None:
            prefix = self._dedupe_prefix[stream] = self.keys.dedupe(stream, "")
        return prefix + key

    def _run(self, calls: list[_Call], durable: bool = False, script: Any = None) -> list[Any]:
        """The replies of ``calls`` to ``script`` (the publish script by default; ids as text for it), once
        the replicas have them if ``durable``."""
        script = script or self._script
        convert = script is self._script
        d = self.durability
        if not durable or d.replicas == 0:
            replies = self.guard.call(lambda c: self._evalsha(c, calls, None, script))
        else:
            def attempt() -> tuple[list[Any], int]:
                replies = self.guard.call(lambda c: self._evalsha(c, calls, d, script))
                return replies[:-1], int(replies[-1])
            stream = as_str(calls[0][0][0])
            replies = confirm_replicated(d, f"publish to {stream}", attempt, self.durability_status)
        return [as_str(r) for r in replies] if convert else replies

    def _evalsha(self, c: redis.Redis, calls: list[_Call], wait: Durability | None, script: Any) -> list[Any]:
        """The replies of ``calls``, and with ``wait`` the replicas that acknowledged them last."""
        if not self._lane.direct:  # e.g. a single-connection client: its own commands, one by one
            replies = [self._evalsha_client(c, script, script_keys, args) for script_keys, args in calls]
            return replies + [c.execute_command("WAIT", wait.replicas, wait.timeout_ms)] if wait else replies
        replies = self._send(calls, wait, script)
        acks = replies.pop() if wait else None
        if any(isinstance(r, NoScriptError) for r in replies):  # a restarted or flushed server: empty cache
            script.sha = c.script_load(script.script)
            redo = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
            again = self._send([calls[i] for i in redo], wait, script)
            acks = again.pop() if wait else None  # the WAIT behind the redo covers everything before it
            for i, reply in zip(redo, again, strict=True):
                replies[i] = reply
        raise_errors(replies)
        if wait:
            raise_errors([acks])
            replies.append(acks)
        return replies

    def _send(self, calls: list[_Call], wait: Durability | None, script: Any) -> list[Any]:
        sha = script.sha
        packed = b"".join(pack("EVALSHA", sha, len(script_keys), *script_keys, *args) for script_keys, args in calls)
        if wait is not None:  # on the same connection, behind the writes: WAIT counts the replicas that have them
            return self._lane.execute(packed + pack("WAIT", wait.replicas, wait.timeout_ms), len(calls) + 1)
        return self._lane.execute(packed, len(calls))

    @staticmethod
    def _evalsha_client(c: redis.Redis, script: Any, script_keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            return c.execute_command("EVALSHA", script.sha, len(script_keys), *script_keys, *args)
        except NoScriptError:
            script.sha = c.script_load(script.script)
            return c.execute_command("EVALSHA", script.sha, len(script_keys), *script_keys, *args)
