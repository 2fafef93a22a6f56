"""Claim-checked sample batches: payload in a store, a ``BatchReady`` event on the policy's stream.

Publishing writes the payload, then one Lua script appends the event (deduplicated by
batch id), records the groups that must read it (the stream's registered groups at that
moment) under ``keys.payload_readers(ref)`` and indexes the ref by time. Each group calls
``release`` after it has used (and acked) the batch; the last release deletes the payload
(atomically in the script for the redis store, right after it for file stores). ``delete_expired``
deletes payloads older than an age whatever their readers (a group that died, a crash
between ack and release), and redis payloads carry a TTL besides, so no orphan lives
forever. The index and ``delete_expired`` use the Redis server's clock, not the hosts'.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from typing import Any

import redis

from rollout_bus.events.batch import DEFAULT_MAX_BYTES, Batch, Ragged, decode, encode
from rollout_bus.events.connection import Guard, as_str
from rollout_bus.events.errors import DecodeError, PayloadMissing
from rollout_bus.events.names import Keys, check_name
from rollout_bus.events.payload import make_store
from rollout_bus.events.payload.base import PayloadStore, Reference, check_ref, make_ref
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import BatchReady, Producer
from rollout_bus.events.schema import encode as encode_event

log = logging.getLogger(__name__)

DEFAULT_PAYLOAD_TTL_S = 24 * 3600

# KEYS[1] dedupe key, KEYS[2] payload index; ARGV[1] ref.
# Returns the existing entry id of a batch published before, else reserves the ref in the index.
_RESERVE = """
local prev = redis.call('GET', KEYS[1])
if prev then return prev end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[2], 'NX', t[1] .. string.format('%06d', tonumber(t[2])):sub(1, 3), ARGV[1])
return false
"""

# KEYS[1] stream, KEYS[2] dedupe, KEYS[3] readers, KEYS[4] index, KEYS[5] registered groups;
# ARGV[1] dedupe ttl s, ARGV[2] readers ttl s, ARGV[3] maxlen (0 = none), ARGV[4] ref,
# ARGV[5..] field, value pairs. Returns {entry id, 1, 1} when appended, and on a repeat
# {existing id, 0, 1 if the ref is still indexed (its payload is meant to be alive) else 0}.
_PUBLISH = """
local prev = redis.call('GET', KEYS[2])
if prev then return {prev, 0, redis.call('ZSCORE', KEYS[4], ARGV[4]) and 1 or 0} end
local id
if tonumber(ARGV[3]) > 0 then
  id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 5))
else
  id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 5))
end
redis.call('SET', KEYS[2], id, 'EX', tonumber(ARGV[1]))
local groups = redis.call('SMEMBERS', KEYS[5])
if #groups > 0 then
  redis.call('SADD', KEYS[3], unpack(groups))
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[2]))
end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[4], 'NX', t[1] .. string.format('%06d', tonumber(t[2])):sub(1, 3), ARGV[4])
return {id, 1, 1}
"""

# KEYS[1] readers, KEYS[2] index, KEYS[3..] payload keys living in this Redis; ARGV[1] group,
# ARGV[2] ref. Returns 1 when no reader is left: the payload keys and the index entry are
# gone, or (with no payload keys) the caller deletes the payload and then the index entry.
_RELEASE = """
redis.call('SREM', KEYS[1], ARGV[1])
if redis.call('SCARD', KEYS[1]) > 0 then return 0 end
if #KEYS > 2 then
  redis.call('DEL', unpack(KEYS, 3))
  redis.call('ZREM', KEYS[2], ARGV[2])
end
return 1
"""


class BatchChannel:
    """Publishes, fetches and releases the claim-checked batches of every policy of one namespace."""

    def __init__(self, client: redis.Redis, keys: Keys, store: PayloadStore | None = None,
                 publisher: Publisher | None = None, *, payload_ttl_s: int = DEFAULT_PAYLOAD_TTL_S,
                 max_bytes: int = DEFAULT_MAX_BYTES, guard: Guard | None = None) -> None:
        """``store`` defaults to the redis store; ``publisher`` (only needed to publish) to one named
        after this host. Events whose payload sits in another kind of store are read through a
        store of that kind made on first use (``redis`` or ``shm`` at its default place)."""
        self.client = client
        self.keys = keys
        self.store = store or make_store("redis", client, keys)
        self.publisher = publisher or Publisher(client, keys, Producer("batches", socket.gethostname()))
        self.payload_ttl_s = payload_ttl_s
        self.max_bytes = max_bytes
        self.guard = guard or Guard(client, name=f"batches {self.publisher.producer}")
        self._stores: dict[str, PayloadStore] = {self.store.name: self.store}
        self._reserve = client.register_script(_RESERVE)
        self._publish = client.register_script(_PUBLISH)
        self._release = client.register_script(_RELEASE)

    # --- producing ---------------------------------------------------------------------
    def publish(self, policy: str, batch_id: str, tensors: Mapping[str, Any], meta: Mapping[str, Any] | None = None,
                *, rollout_id: int = 0, request_id: str = "", n_samples: int | None = None,
                min_weight_version: int = 0, max_weight_version: int = 0, maxlen: int = 0) -> str:
        """Store the batch and append its ``BatchReady``; returns the stream entry id.

        Idempotent by ``batch_id``: a repeat returns the first entry's id and leaves neither a
        second entry nor a second payload. ``n_samples`` defaults to the leading dimension of
        the first field (rows, for a ragged field).
        """
        ref = make_ref(policy, batch_id)
        stream = self.keys.batch_stream(policy)
        dedupe = self.keys.dedupe(stream, batch_id)
        # PayloadTooLarge before any I/O; the store hashes while it writes (see EncodedBatch.finish)
        encoded = encode(tensors, meta, max_bytes=self.max_bytes, defer_checksum=True)
        prev = self.guard.call(lambda c: self._reserve(keys=[dedupe, self.keys.payload_index], args=[ref], client=c))
        if prev:
            return as_str(prev)
        reference = self.store.put(ref, encoded, self.payload_ttl_s)
        event = BatchReady(producer=self.publisher.producer, policy=policy, batch_id=batch_id,
                           rollout_id=rollout_id, request_id=request_id,
                           n_samples=_n_samples(tensors) if n_samples is None else n_samples,
                           min_weight_version=min_weight_version, max_weight_version=max_weight_version,
                           bytes=encoded.nbytes, payload=reference)
        args: list[Any] = [self.publisher.dedupe_ttl_s, self.payload_ttl_s + 3600, maxlen, ref]
        for k, v in encode_event(event).items():
            args += [k, v]
        script_keys = [stream, dedupe, self.keys.payload_readers(ref), self.keys.payload_index,
                       self.keys.registered_groups(stream)]
        entry_id, appended, indexed = self.guard.call(
            lambda c: self._publish(keys=script_keys, args=args, client=c))
        if not appended and not indexed:
            # a concurrent publish of this batch won and was already fully released: ours is an orphan
            log.info("batch %s was published concurrently and already released; dropping the copy", ref)
            self.store.delete(reference)
            self.guard.call(lambda c: c.zrem(self.keys.payload_index, ref))
        return as_str(entry_id)

    # --- consuming ---------------------------------------------------------------------
    def fetch(self, event: BatchReady, *, verify: bool = True) -> Batch:
        """The batch an event points to; ``PayloadMissing`` when its payload is gone."""
        try:
            return decode(self.store_for(event.payload).get(event.payload), verify=verify)
        except PayloadMissing as exc:
            raise PayloadMissing(f"batch {event.batch_id} of policy {event.policy} "
                                 f"(rollout {event.rollout_id}): {exc}") from None

    def release(self, event: BatchReady | Reference, group: str) -> bool:
        """``group`` is done with the batch; returns True when this was the last reader and the payload is gone.

        Call it after acking the entry. Tensors already fetched stay valid; with the shm store,
        dropping them before the last release lets the segment be reused rather than unlinked.
        """
        reference = event.payload if isinstance(event, BatchReady) else event
        ref = check_ref(reference.get("ref"))
        check_name("group", group)
        store = self.store_for(reference)
        inline = store.redis_keys(reference)
        script_keys = [self.keys.payload_readers(ref), self.keys.payload_index, *inline]
        last = self.guard.call(lambda c: self._release(keys=script_keys, args=[group, ref], client=c))
        if not last:
            return False
        if not inline:
            store.delete(reference)
            self.guard.call(lambda c: c.zrem(self.keys.payload_index, ref))
        return True

    def store_for(self, reference: Reference) -> PayloadStore:
        """The store holding a payload: this channel's, or one of the kind the reference names."""
        kind = reference.get("store") if isinstance(reference, dict) else None
        store = self._stores.get(kind) if isinstance(kind, str) else None
        if store is not None:
            return store
        if kind not in ("redis", "shm"):
            raise DecodeError(f"payload reference names store {kind!r}, which this channel cannot open "
                              f"(it uses {self.store.name!r}; a file store needs its directory)")
        store = self._stores[kind] = make_store(kind, self.client, self.keys)
        return store

    def close(self) -> None:
        for store in self._stores.values():
            store.close()

    def readers(self, ref: str) -> set[str]:
        """Groups that have yet to release ``ref``."""
        members = self.guard.call(lambda c: c.smembers(self.keys.payload_readers(ref)))
        return {as_str(m) for m in members}

    # --- housekeeping ------------------------------------------------------------------
    def delete_expired(self, max_age_s: float, *, limit: int = 1000) -> int:
        """Delete payloads published more than ``max_age_s`` ago, read or not; returns how many."""
        sec, usec = self.guard.call(lambda c: c.time())
        cutoff_ms = int(sec) * 1000 + int(usec) // 1000 - int(max_age_s * 1000)
        removed = 0
        while True:
            refs = self.guard.call(lambda c: c.zrangebyscore(self.keys.payload_index, "-inf", cutoff_ms,
                                                              start=0, num=limit))
            for raw in refs:
                ref = as_str(raw)
                log.warning("deleting payload %s: not released by every group within %.0fs", ref, max_age_s)
                self.store.delete(self.store.locate(ref))

                def forget(c: redis.Redis, r: str = ref) -> None:
                    pipe = c.pipeline(transaction=True)
                    pipe.delete(self.keys.payload_readers(r))
                    pipe.zrem(self.keys.payload_index, r)
                    pipe.execute()
                self.guard.call(forget)
                removed += 1
            if len(refs) < limit:
                break
        removed += self.store.delete_expired(max_age_s)
        return removed


def _n_samples(tensors: Mapping[str, Any]) -> int:
    for value in tensors.values():
        if isinstance(value, Ragged):
            return len(value)
        shape: Any = getattr(value, "shape", ())
        return int(shape[0]) if len(shape) else 1
    return 0

