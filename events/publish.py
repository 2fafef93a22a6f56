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
from rollout_bus.events.leased import LeaseFence, guarded, leased
from rollout_bus.events.names import Keys
from rollout_bus.events.schema import FIELD, Event, Producer, encode_bytes, seq_slot
from rollout_bus.events.settings import env_int

log = logging.getLogger(__name__)

SEQ_LUA = """
local function next_seq(seqs, producer)
  return tonumber(redis.call('HGET', seqs, producer) or 0) + 1
end
local function with_seq(raw, slot, n)
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
  return string.sub(raw, 1, slot - 1) .. v .. string.sub(raw, slot + 1)
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
"""The publish script's body (``SEQ_LUA`` before it), for a script that appends an event in the same step as
its own write (``Publisher.prepared`` gives its keys and arguments)."""
_PUBLISH = SEQ_LUA + PUBLISH_BODY

_Call = tuple[Sequence[Any], Sequence[Any]]  # (script keys, script args) of one EVALSHA

DEFAULT_DEDUPE_TTL_S = 7 * 86400
RETRY_DEDUPE_TTL_S = 600
"""An event-id dedupe key outlives any re-send of ``Guard`` (60 s budget by default) by far."""


def dedupe_ttl_from_env() -> int:
    """``ROLLOUT_BUS_DEDUPE_TTL_S`` (seconds a business-key dedupe key lives, at least ``RETRY_DEDUPE_TTL_S``),
    else 7 days."""
    return env_int("ROLLOUT_BUS_DEDUPE_TTL_S", DEFAULT_DEDUPE_TTL_S, minimum=RETRY_DEDUPE_TTL_S)


class Publisher:
    """Appends events to streams; a repeated idempotency key never adds a second entry.

    One round trip per event (``publish``) or per batch of events (``publish_many``):
    ``EVALSHA`` of the publish script, loaded again if the server lost its script cache
    (e.g. after a restart). The commands go out already packed on a connection the
    publisher keeps (``events.connection.Lane``); ``close`` gives it back to the pool.

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
        self._leased: Any = None  # the publish script bound to a lease, registered on first use
        self.durability_status = status_hook(client, keys.durability_status, str(producer))

    def publish(self, stream: str, event: Event, *, idempotency_key: str | None = None,
                maxlen: int = 0, durable: bool = False, lease: LeaseFence | None = None) -> str:
        """Append ``event``; the idempotency key defaults to the event id, so a retry is safe.

        ``durable``: return only once the replicas acknowledged it (``ReplicationTimeout`` if they do not).
        ``lease``: append only while that lease holds, checked in the same script (``LeaseLost`` otherwise).
        """
        raw = encode_bytes(event)
        dedupe_key = self._dedupe_key(stream, idempotency_key or event.event_id)
        ttl_s = self.dedupe_ttl_s if idempotency_key else self.retry_ttl_s
        slot, producer, seqs = seq_slot(raw), self._producer_name(event.producer), self.keys.producer_seqs
        if lease is not None:
            return self._publish_leased(lease, (stream, seqs, dedupe_key),
                                        (ttl_s, maxlen, slot, producer, FIELD, raw), durable)
        if not self._lane.direct or (durable and self.durability.replicas):
            return self._run([((stream, seqs, dedupe_key), (ttl_s, maxlen, slot, producer, FIELD, raw))], durable)[0]
        # the hot path: one packed EVALSHA on the kept connection, no per-call lists or closures
        lane = self._lane
        script = self._script
        packed = pack_command(("EVALSHA", script.sha, 3, stream, seqs, dedupe_key,  # type: ignore[arg-type]
                               ttl_s, maxlen, slot, producer, FIELD, raw))  # (hiredis' stub: a 1-tuple)

        def send(c: redis.Redis) -> Any:
            reply = lane.execute(packed)[0]
            if isinstance(reply, NoScriptError):  # a restarted or flushed server: empty cache
                script.sha = c.script_load(script.script)
                reply = lane.execute(pack_command(("EVALSHA", script.sha, 3, stream, seqs,  # type: ignore[arg-type]
                                                   dedupe_key, ttl_s, maxlen, slot, producer, FIELD, raw)))[0]
            if isinstance(reply, redis.ResponseError):
                raise reply
            return reply
        reply = self.guard.call(send)
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    def prepared(self, stream: str, event: Event) -> tuple[list[Any], list[Any]]:
        """The keys and arguments of ``PUBLISH_BODY`` that append ``event`` as ``publish`` does (deduplicated
        by its event id), for a script that appends it in one step with a write of its own."""
        raw = encode_bytes(event)
        return ([stream, self.keys.producer_seqs, self._dedupe_key(stream, event.event_id)],
                [self.retry_ttl_s, 0, seq_slot(raw), self._producer_name(event.producer), FIELD, raw])

    def publish_many(self, stream: str, events: Iterable[Event], *,
                     idempotency_keys: Sequence[str | None] | None = None, maxlen: int = 0,
                     durable: bool = False) -> list[str]:
        """Append ``events`` in order, in one round trip; each is deduplicated as by ``publish``.

        Returns the entry ids in the order of ``events`` (an event whose key was seen before
        gets the existing entry's id). The publishes are independent, not a transaction: after
        an error some may have been appended, and calling again with the same events (or keys)
        appends only the rest.
        """
        events = list(events)
        if idempotency_keys is not None and len(idempotency_keys) != len(events):
            raise ValueError(f"{len(idempotency_keys)} idempotency keys for {len(events)} events")
        calls: list[_Call] = []
        seqs = self.keys.producer_seqs
        for i, event in enumerate(events):
            key = idempotency_keys[i] if idempotency_keys is not None else None
            raw = encode_bytes(event)
            calls.append(((stream, seqs, self._dedupe_key(stream, key or event.event_id)),
                          (self.dedupe_ttl_s if key else self.retry_ttl_s, maxlen, seq_slot(raw),
                           self._producer_name(event.producer), FIELD, raw)))
        return self._run(calls, durable) if calls else []

    def publish_fields(self, stream: str, fields: dict[bytes, bytes], *, idempotency_key: str | None = None,
                       maxlen: int = 0, durable: bool = False) -> str:
        # no empty key name when there is no dedupe key: every key a script names must hash to one slot
        seqs = self.keys.producer_seqs
        script_keys = [stream, seqs, self._dedupe_key(stream, idempotency_key)] if idempotency_key else [stream, seqs]
        args: list[Any] = [self.dedupe_ttl_s, maxlen, 0, ""]  # raw fields: no event, no sequence number
        for k, v in fields.items():
            args += [k, v]
        return self._run([(script_keys, args)], durable)[0]

    def _publish_leased(self, lease: LeaseFence, keys: tuple[str, ...], args: tuple[Any, ...],
                        durable: bool) -> str:
        """One publish bound to ``lease`` (``events.leased``): the lease check, the dedupe and the XADD in one
        script; refused with ``LeaseLost`` once the lease lapsed, whoever holds it now."""
        if self._leased is None:
            self._leased = self.client.register_script(leased(_PUBLISH))
        script, d = self._leased, self.durability
        script_keys, script_args = lease.keys(*keys), lease.args(*args)
        if not (durable and d.replicas):
            return as_str(guarded(self.guard, lambda c: script(keys=script_keys, args=script_args, client=c)))

        def attempt() -> tuple[Any, int]:
            def both(c: redis.Redis) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                script(keys=script_keys, args=script_args, client=pipe)
                pipe.execute_command("WAIT", d.replicas, d.timeout_ms)
                return pipe.execute()  # type: ignore[no-any-return]
            reply, acks = guarded(self.guard, both)
            return reply, int(acks)
        return as_str(confirm_replicated(d, f"publish to {keys[0]}", attempt, self.durability_status))

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

    def _run(self, calls: list[_Call], durable: bool = False) -> list[str]:
        d = self.durability
        if not durable or d.replicas == 0:
            return [as_str(r) for r in self.guard.call(lambda c: self._evalsha(c, calls, None))]

        def attempt() -> tuple[list[Any], int]:
            replies = self.guard.call(lambda c: self._evalsha(c, calls, d))
            return replies[:-1], int(replies[-1])
        stream = as_str(calls[0][0][0])
        return [as_str(r) for r in confirm_replicated(d, f"publish to {stream}", attempt, self.durability_status)]

    def _evalsha(self, c: redis.Redis, calls: list[_Call], wait: Durability | None) -> list[Any]:
        """The replies of ``calls``, and with ``wait`` the replicas that acknowledged them last."""
        if not self._lane.direct:  # e.g. a single-connection client: its own commands, one by one
            replies = [self._evalsha_client(c, script_keys, args) for script_keys, args in calls]
            return replies + [c.execute_command("WAIT", wait.replicas, wait.timeout_ms)] if wait else replies
        replies = self._send(calls, wait)
        acks = replies.pop() if wait else None
        if any(isinstance(r, NoScriptError) for r in replies):  # a restarted or flushed server: empty cache
            self._script.sha = c.script_load(self._script.script)
            redo = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
            again = self._send([calls[i] for i in redo], wait)
            acks = again.pop() if wait else None  # the WAIT behind the redo covers everything before it
            for i, reply in zip(redo, again, strict=True):
                replies[i] = reply
        raise_errors(replies)
        if wait:
            raise_errors([acks])
            replies.append(acks)
        return replies

    def _send(self, calls: list[_Call], wait: Durability | None = None) -> list[Any]:
        sha = self._script.sha
        packed = b"".join(pack("EVALSHA", sha, len(script_keys), *script_keys, *args) for script_keys, args in calls)
        if wait is not None:  # on the same connection, behind the writes: WAIT counts the replicas that have them
            return self._lane.execute(packed + pack("WAIT", wait.replicas, wait.timeout_ms), len(calls) + 1)
        return self._lane.execute(packed, len(calls))

    def _evalsha_client(self, c: redis.Redis, script_keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            return c.execute_command("EVALSHA", self._script.sha, len(script_keys), *script_keys, *args)
        except NoScriptError:
            self._script.sha = c.script_load(self._script.script)
            return c.execute_command("EVALSHA", self._script.sha, len(script_keys), *script_keys, *args)
