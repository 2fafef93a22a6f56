"""Claim-checked sample batches: payload in a store, a ``BatchReady`` event on the policy's stream.

Publishing writes the payload under a ref of its own attempt (``<policy>:<batch_id>:<attempt>``),
then one Lua script appends the event (deduplicated by batch id), records the groups that must
read it (the stream's registered groups at that moment) under ``keys.payload_readers(ref)``.
Two live attempts of one job (a reap by mistake, a retry racing a slow first try) therefore
never write the same bytes: the idempotent append picks the winner, and the loser deletes its
own copy. Each ref is indexed by time (``keys.payload_index``) and by where it lives
(``keys.payload_stores``: store kind, root, host) from before its bytes are written, so even a
producer that dies between payload and event leaves nothing that ``delete_expired`` cannot find.

Each group calls ``release`` after it has used the batch; the last release deletes the payload
(atomically in the script for the redis store, right after it for file stores).
``delete_expired`` deletes payloads older than an age whatever their readers (a group that died,
a crash between use and release), through a store of the kind the index names (redis, shm on
this host, or a file store under a root it is given), and redis payloads carry a TTL besides, so
no orphan lives forever. The index and ``delete_expired`` use the Redis server's clock.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import redis
from redis.exceptions import NoScriptError

from rollout_bus.events.batch import DEFAULT_MAX_BYTES, Batch, FieldSpec, Ragged, decode, encode, layout
from rollout_bus.events.connection import Durability, Guard, Redis, as_str, confirm_replicated
from rollout_bus.events.errors import DecodeError, InvalidRequest, PayloadMissing, PayloadTooLarge
from rollout_bus.events.leased import LeaseFence, guarded, leased
from rollout_bus.events.names import Keys, check_name
from rollout_bus.events.payload import make_store
from rollout_bus.events.payload.base import (
    BatchDraft,
    PayloadStore,
    Reference,
    check_owner,
    check_ref,
    make_ref,
)
from rollout_bus.events.payload.file import FileStore
from rollout_bus.events.payload.memfd import MemfdStore, check_server
from rollout_bus.events.payload.shm import DEFAULT_ROOT as SHM_ROOT
from rollout_bus.events.payload.shm import ShmStore
from rollout_bus.events.publish import SEQ_LUA, Publisher
from rollout_bus.events.schema import FIELD, BatchReady, Producer, seq_slot
from rollout_bus.events.schema import encode_bytes as encode_event_bytes

log = logging.getLogger(__name__)

DEFAULT_PAYLOAD_TTL_S = 24 * 3600
READER_HOSTS_TTL_S = 5.0
"""How long a shm channel trusts what it read of the hosts its batches' readers are on."""

# KEYS[1] dedupe key, KEYS[2] payload index, KEYS[3] payload stores; ARGV[1] ref, ARGV[2] locator.
# Returns the existing entry id of a batch published before, else indexes the ref (time, place).
_RESERVE = """
local prev = redis.call('GET', KEYS[1])
if prev then return prev end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[2], 'NX', t[1] .. string.format('%06d', tonumber(t[2])):sub(1, 3), ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
return false
"""

# KEYS[1] stream, KEYS[2] dedupe, KEYS[3] readers, KEYS[4] registered groups, KEYS[5] index,
# KEYS[6] payload stores, KEYS[7] producer sequences, KEYS[8..] this attempt's payload keys in this Redis
# (if any); ARGV[1] dedupe ttl s, ARGV[2] readers ttl s, ARGV[3] maxlen (0 = none), ARGV[4] ref,
# ARGV[5] seq slot in ARGV[8] (0 = none), ARGV[6] producer, ARGV[7..] field, value pairs (the event's
# sequence number is given out as it is appended, as by ``events.publish``). Returns {entry id, 1} when appended. On a repeat: {existing id, 0}
# when the existing entry is another attempt's, with this attempt's ref unindexed and its keys in
# Redis deleted (the caller deletes other bytes); {existing id, 2} when it is this attempt's own (the
# same call run again: a retried WAIT, a reply lost on the way back) or can no longer be read
# (trimmed): then nothing is deleted, since those bytes may be the ones the entry points to.
# An error when this attempt's payload keys are not all there (written to a primary that failed over
# before its replica had them): no event ever points at bytes that are gone.
_PUBLISH = SEQ_LUA + """
local prev = redis.call('GET', KEYS[2])
if prev then
  local entry = redis.call('XRANGE', KEYS[1], prev, prev)
  if #entry == 0 then return {prev, 2} end
  for _, v in ipairs(entry[1][2]) do
    if string.find(v, ARGV[4], 1, true) then return {prev, 2} end
  end
  redis.call('ZREM', KEYS[5], ARGV[4])
  redis.call('HDEL', KEYS[6], ARGV[4])
  if #KEYS > 7 then redis.call('DEL', unpack(KEYS, 8)) end
  return {prev, 0}
end
if #KEYS > 7 and redis.call('EXISTS', unpack(KEYS, 8)) < #KEYS - 7 then
  return redis.error_reply('PAYLOADLOST the payload of ' .. ARGV[4] .. ' is not in this Redis (a failover lost it)')
end
local fields = {unpack(ARGV, 7)}
local n = stamp_seq(fields, tonumber(ARGV[5]), KEYS[7], ARGV[6])
local id
if tonumber(ARGV[3]) > 0 then
  id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', unpack(fields))
else
  id = redis.call('XADD', KEYS[1], '*', unpack(fields))
end
if n then redis.call('HSET', KEYS[7], ARGV[6], n) end
redis.call('SET', KEYS[2], id, 'EX', tonumber(ARGV[1]))
local groups = redis.call('SMEMBERS', KEYS[4])
if #groups > 0 then
  redis.call('SADD', KEYS[3], unpack(groups))
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[2]))
end
return {id, 1}
"""

# KEYS[1] readers, KEYS[2] index, KEYS[3] payload stores, KEYS[4..] payload keys living in this Redis;
# ARGV[1] group, ARGV[2] ref. Returns 1 when no reader is left: the payload keys and the index entries
# are gone, or (with no payload keys) the caller deletes the payload and then the index entries.
_RELEASE = """
redis.call('SREM', KEYS[1], ARGV[1])
if redis.call('SCARD', KEYS[1]) > 0 then return 0 end
if #KEYS > 3 then
  redis.call('DEL', unpack(KEYS, 4))
  redis.call('ZREM', KEYS[2], ARGV[2])
  redis.call('HDEL', KEYS[3], ARGV[2])
end
return 1
"""


@dataclass
class Swept:
    """What ``delete_expired`` removed: payloads by store kind, leftovers (temp files, pooled segments),
    and refs it found but cannot reach from here (another host's shared memory, an unknown file root)."""

    payloads: dict[str, int] = field(default_factory=dict)
    leftovers: int = 0
    unreachable: int = 0

    @property
    def total(self) -> int:
        return sum(self.payloads.values()) + self.leftovers


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
        self.store.max_bytes = max_bytes
        self.publisher = publisher or Publisher(client, keys, Producer("batches", socket.gethostname()))
        self.payload_ttl_s = payload_ttl_s
        self.max_bytes = max_bytes
        self.guard = guard or Guard(client, name=f"batches {self.publisher.producer}")
        self._stores: dict[str, PayloadStore] = {self.store.name: self.store}
        self._reader_hosts: dict[str, tuple[float, dict[str, str]]] = {}
        self._reserve = client.register_script(_RESERVE)
        self._publish = client.register_script(_PUBLISH)
        self._release = client.register_script(_RELEASE)
        self._leased_release: Any = None  # the release bound to a lease (``release(lease=...)``), on first use

    # --- producing ---------------------------------------------------------------------
    def allocate(self, policy: str, fields: Mapping[str, FieldSpec], meta: Mapping[str, Any] | None = None
                 ) -> BatchDraft:
        """A draft of a batch of ``fields`` (``(shape, dtype)`` or ``RaggedSpec`` each) for ``policy``: fill
        its tensors, drop them, then ``publish(policy, batch_id, draft)``. With the memfd store the tensors
        are built in the segment readers will map, and publishing seals it: no copy, no checksum.
        ``PayloadTooLarge`` over the channel's maximum batch size."""
        plan = layout(fields, meta, max_bytes=self.max_bytes)
        return self._store_for(policy, self.keys.batch_stream(policy)).allocate(plan, dict(meta or {}))

    def publish(self, policy: str, batch_id: str, tensors: Mapping[str, Any] | BatchDraft,
                meta: Mapping[str, Any] | None = None,
                *, rollout_id: int = 0, request_id: str = "", n_samples: int | None = None,
                min_weight_version: int = 0, max_weight_version: int = 0, maxlen: int = 0) -> str:
        """Store the batch and append its ``BatchReady``; returns the stream entry id.

        Idempotent by ``batch_id``: a repeat returns the first entry's id and leaves neither a
        second entry nor a second payload, even when two attempts run at once (each writes under
        its own ref; the one whose event lands first wins). ``n_samples`` defaults to the leading
        dimension of the first field (rows, for a ragged field). ``tensors`` may be a draft from
        ``allocate`` (its meta was given there); publishing it uses the draft up.
        """
        ref = make_ref(policy, batch_id, os.urandom(6).hex())
        stream = self.keys.batch_stream(policy)
        dedupe = self.keys.dedupe(stream, batch_id)
        store = self._store_for(policy, stream)
        draft = tensors if isinstance(tensors, BatchDraft) else None
        in_place = draft is not None and draft.store is store
        fields = tensors.tensors if isinstance(tensors, BatchDraft) else tensors
        if draft is not None and meta is not None:
            raise InvalidRequest("a draft's meta is given to allocate, not to publish")
        # PayloadTooLarge before any I/O; the store hashes while it writes (see EncodedBatch.finish)
        encoded = None if in_place else encode(fields, draft.meta if draft is not None else meta,
                                               max_bytes=self.max_bytes, defer_checksum=True)
        n = _n_samples(fields) if n_samples is None else n_samples
        del fields  # a draft sealed in place must have no view of its tensors left
        locator = msgpack.packb(store.locator(), use_bin_type=True)
        prev = self.guard.call(lambda c: self._reserve(
            keys=[dedupe, self.keys.payload_index, self.keys.payload_stores], args=[ref, locator], client=c))
        if prev:
            if draft is not None:
                draft.discard()
            return as_str(prev)
        if draft is not None and in_place:
            reference = store.seal(ref, draft, self.payload_ttl_s)
            nbytes = draft.nbytes
        else:
            assert encoded is not None
            reference = store.put(ref, encoded, self.payload_ttl_s)
            nbytes = encoded.nbytes
            if draft is not None:
                draft.discard()
        event = BatchReady(producer=self.publisher.producer, policy=policy, batch_id=batch_id,
                           rollout_id=rollout_id, request_id=request_id, n_samples=n,
                           min_weight_version=min_weight_version, max_weight_version=max_weight_version,
                           bytes=nbytes, payload=reference)
        raw = encode_event_bytes(event)
        args: list[Any] = [self.publisher.dedupe_ttl_s, self.payload_ttl_s + 3600, maxlen, ref, seq_slot(raw),
                           str(event.producer), FIELD, raw]
        inline = store.redis_keys(reference)
        script_keys = [stream, dedupe, self.keys.payload_readers(ref), self.keys.registered_groups(stream),
                       self.keys.payload_index, self.keys.payload_stores, self.keys.producer_seqs, *inline]
        d = self.publisher.durability
        if d.replicas == 0:
            entry_id, outcome = self.guard.call(lambda c: self._publish(keys=script_keys, args=args, client=c))
        else:  # a BatchReady survives a failover: acknowledged only once the replicas have it
            def attempt() -> tuple[Any, int]:
                return self.guard.call(lambda c: self._publish_and_wait(c, script_keys, args, d))
            entry_id, outcome = confirm_replicated(d, f"BatchReady {policy}/{batch_id}", attempt,
                                                   self.publisher.durability_status)
        if outcome == 0:  # another attempt's entry won (1: appended now; 2: this attempt's own, appended before)
            log.info("batch %s of %s was published by another attempt first; dropping this attempt's copy",
                     batch_id, policy)
            if not inline:
                store.delete(reference)
        return as_str(entry_id)

    def _store_for(self, policy: str, stream: str) -> PayloadStore:
        """This channel's store, unless it serves one host (shm) and a reader of ``stream`` is on another:
        then the store's fallback (``shm?fallback=redis``), or ``InvalidRequest`` saying what to change."""
        store = self.store
        if not isinstance(store, ShmStore | MemfdStore):
            return store
        now = time.monotonic()
        cached = self._reader_hosts.get(stream)
        if cached is None or now - cached[0] > READER_HOSTS_TTL_S:
            def read(c: Redis) -> dict[str, str]:
                pipe = c.pipeline(transaction=False)
                pipe.smembers(self.keys.registered_groups(stream))
                pipe.hgetall(self.keys.group_hosts(stream))
                registered, hosts = pipe.execute()
                return {as_str(g): as_str(h) for g, h in hosts.items() if g in registered}
            cached = self._reader_hosts[stream] = (now, self.guard.call(read))
        away = {group: host for group, host in cached[1].items() if host != store.host}
        if not away:
            return store
        if store.fallback is not None:
            store.fallback.max_bytes = self.max_bytes
            self._stores.setdefault(store.fallback.name, store.fallback)
            return store.fallback
        raise InvalidRequest(
            f"{store.name} payload store on host {store.host!r}: {policy}'s batches are read on other hosts "
            f"({', '.join(f'group {g} on {h!r}' for g, h in sorted(away.items()))}); shared memory serves one "
            f"host: use the redis or file store, or {store.name}?fallback=redis to send such batches through Redis")

    def _publish_and_wait(self, c: Redis, script_keys: list[Any], args: list[Any], d: Durability) -> tuple[Any, int]:
        """The publish script and a ``WAIT`` behind it on one connection (WAIT counts what that one wrote)."""
        for _ in range(2):
            pipe = c.pipeline(transaction=False)
            pipe.execute_command("EVALSHA", self._publish.sha, len(script_keys), *script_keys, *args)
            pipe.execute_command("WAIT", d.replicas, d.timeout_ms)
            reply, acks = pipe.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError):  # e.g. a promoted replica: scripts are not replicated
                self._publish.sha = c.script_load(self._publish.script)
                continue
            for r in (reply, acks):
                if isinstance(r, Exception):
                    raise r
            return reply, int(acks)
        raise NoScriptError("the publish script is missing right after it was loaded")

    # --- consuming ---------------------------------------------------------------------
    def fetch(self, event: BatchReady, *, verify: bool = True) -> Batch:
        """The batch an event points to; ``PayloadMissing`` when its payload is gone.

        Checked before any byte is read: the reference must be a payload of the event's own policy
        and batch (``DecodeError`` otherwise), and the sizes the event and its reference declare must
        not exceed ``max_bytes`` (``PayloadTooLarge``): an event is untrusted input.
        """
        check_owner(event.payload.get("ref"), event.policy, event.batch_id)
        if event.bytes > self.max_bytes:
            raise PayloadTooLarge(f"batch {event.batch_id} of policy {event.policy} declares {event.bytes} bytes, "
                                  f"more than the maximum batch size of {self.max_bytes} bytes")
        try:
            buffer, sealed = self.store_for(event.payload).get_sealed(event.payload)
            # a sealed segment's bytes cannot have changed since the producer sealed them: no checksum pass
            return decode(buffer, verify=verify and not sealed)
        except PayloadMissing as exc:
            raise PayloadMissing(f"batch {event.batch_id} of policy {event.policy} "
                                 f"(rollout {event.rollout_id}): {exc}") from None

    def release(self, event: BatchReady | Reference, group: str, *, lease: LeaseFence | None = None) -> bool:
        """``group`` is done with the batch; returns True when this was the last reader and the payload is gone.

        Call it after acking the entry. Tensors already fetched stay valid; with the shm store,
        dropping them before the last release lets the segment be reused rather than unlinked.
        With ``lease``, only while that lease holds (checked in the same script; ``LeaseLost`` otherwise).
        """
        reference = event.payload if isinstance(event, BatchReady) else event
        ref = check_ref(reference.get("ref"))
        if isinstance(event, BatchReady):  # never release (and so delete) another batch's payload
            check_owner(ref, event.policy, event.batch_id)
        check_name("group", group)
        store = self.store_for(reference)
        inline = store.redis_keys(reference)
        script_keys = [self.keys.payload_readers(ref), self.keys.payload_index, self.keys.payload_stores, *inline]
        if lease is None:
            last = self.guard.call(lambda c: self._release(keys=script_keys, args=[group, ref], client=c))
        else:
            script = self._leased_release = self._leased_release or self.client.register_script(leased(_RELEASE))
            keys_, args_ = lease.keys(*script_keys), lease.args(group, ref)
            last = guarded(self.guard, lambda c: script(keys=keys_, args=args_, client=c))
        if not last:
            return False
        if not inline:
            store.delete(reference)
            self._forget(ref)
        return True

    def _forget(self, ref: str) -> None:
        """Drop ``ref`` from the payload index (time and place) and its reader set."""
        def run(c: redis.Redis) -> None:
            pipe = c.pipeline(transaction=True)
            pipe.delete(self.keys.payload_readers(ref))
            pipe.zrem(self.keys.payload_index, ref)
            pipe.hdel(self.keys.payload_stores, ref)
            pipe.execute()
        self.guard.call(run)

    def store_for(self, reference: Reference) -> PayloadStore:
        """The store holding a payload: this channel's, or one of the kind the reference names."""
        kind = reference.get("store") if isinstance(reference, dict) else None
        store = self._stores.get(kind) if isinstance(kind, str) else None
        if store is not None:
            return store
        if kind not in ("redis", "shm", "memfd"):
            raise DecodeError(f"payload reference names store {kind!r}, which this channel cannot open "
                              f"(it uses {self.store.name!r}; a file store needs its directory)")
        store = self._stores[kind] = make_store(kind, self.client, self.keys)
        store.max_bytes = self.max_bytes
        return store

    def close(self) -> None:
        for store in self._stores.values():
            store.close()

    def readers(self, ref: str) -> set[str]:
        """Groups that have yet to release ``ref``."""
        members = self.guard.call(lambda c: c.smembers(self.keys.payload_readers(ref)))
        return {as_str(m) for m in members}

    # --- housekeeping ------------------------------------------------------------------
    def delete_expired(self, max_age_s: float, *, roots: Iterable[str] = (), limit: int = 1000) -> int:
        """Delete payloads published more than ``max_age_s`` ago, read or not; returns how many
        (see ``sweep`` for the counts by kind)."""
        return self.sweep(max_age_s, roots=roots, limit=limit).total

    def sweep(self, max_age_s: float, *, roots: Iterable[str] = (), limit: int = 1000) -> Swept:
        """Delete payloads older than ``max_age_s`` of every store kind the index names.

        Each payload is deleted through a store of the kind it was written to: the redis store, the
        shared-memory store of this host (its default root or one of ``roots``), or a file store
        under one of ``roots``. Locations come from Redis, so only those are trusted: a ref whose
        store cannot be reached from here is left indexed and counted as unreachable. Leftovers of
        the reachable stores older than ``max_age_s`` (temp files, pooled segments) go too.
        """
        places = _Places(self, roots)
        sec, usec = self.guard.call(lambda c: c.time())
        cutoff_ms = int(sec) * 1000 + int(usec) // 1000 - int(max_age_s * 1000)
        out = Swept()
        start = 0
        while True:
            offset = start
            refs = [as_str(r) for r in self.guard.call(lambda c: c.zrangebyscore(  # noqa: B023
                self.keys.payload_index, "-inf", cutoff_ms, start=offset, num=limit))]  # noqa: B023
            if not refs:
                break
            kept = 0
            for kind in self._delete_located(refs, places, f"older than {max_age_s:.0f}s"):
                if kind is None:
                    out.unreachable += 1
                    kept += 1
                else:
                    out.payloads[kind] = out.payloads.get(kind, 0) + 1
            if len(refs) < limit:
                break
            start += kept  # refs that stay indexed are skipped on the next page
        for store in places.reachable():
            out.leftovers += store.delete_expired(max_age_s)
        if out.unreachable:
            log.warning("%d expired payload(s) live in stores this process cannot reach (another host's shared "
                        "memory, or a file root it was not given): left to a janitor that can", out.unreachable)
        return out

    def drop_reader(self, policy: str, group: str, *, roots: Iterable[str] = (), page_size: int = 1000) -> int:
        """Remove ``group`` from the readers of every payload of ``policy`` (a group that is gone); payloads
        left without a reader are deleted. Returns how many payloads it was a reader of."""
        check_name("group", group)
        prefix = f"{check_name('policy', policy)}:"
        places = _Places(self, roots)
        released = 0
        start = 0
        while True:
            offset = start
            refs = [as_str(r) for r in self.guard.call(lambda c: c.zrange(  # noqa: B023
                self.keys.payload_index, offset, offset + page_size - 1))]  # noqa: B023
            mine = [r for r in refs if r.startswith(prefix)]
            if mine:
                def srem(c: redis.Redis, rs: list[str] = mine) -> list[Any]:
                    pipe = c.pipeline(transaction=False)
                    for r in rs:
                        pipe.srem(self.keys.payload_readers(r), group)
                        pipe.scard(self.keys.payload_readers(r))
                    return pipe.execute()
                replies = self.guard.call(srem)
                removed = [r for i, r in enumerate(mine) if replies[2 * i]]
                released += len(removed)
                orphaned = [r for i, r in enumerate(mine) if replies[2 * i] and not replies[2 * i + 1]]
                gone = sum(kind is not None for kind in self._delete_located(orphaned, places, f"group {group} left"))
                start += page_size - gone
            else:
                start += page_size
            if len(refs) < page_size:
                break
        return released

    def _delete_located(self, refs: list[str], places: _Places, why: str) -> list[str | None]:
        """Delete each payload through the store its index entry names; the store kind of each, None
        where that store cannot be reached from here (the ref then stays indexed)."""
        if not refs:
            return []
        located = self.guard.call(lambda c: c.hmget(self.keys.payload_stores, refs))
        out: list[str | None] = []
        for ref, raw in zip(refs, located, strict=True):
            store = places.store(_locator(raw))
            if store is None:
                out.append(None)
                continue
            log.warning("deleting payload %s (%s store): %s", ref, store.name, why)
            try:
                store.delete(store.locate(ref))
            except DecodeError as exc:
                log.warning("payload %s: %s", ref, exc.reason)
            self._forget(ref)
            out.append(store.name)
        return out


class _Places:
    """Stores reachable from this process for recorded payload locations (see ``PayloadStore.locator``)."""

    def __init__(self, channel: BatchChannel, roots: Iterable[str]) -> None:
        self.channel = channel
        self.allowed = {str(Path(r).resolve()) for r in roots}
        self.opened: dict[tuple[str, str | None, str | None], PayloadStore | None] = {}

    def store(self, locator: Mapping[str, Any]) -> PayloadStore | None:
        key = (str(locator.get("store")), locator.get("root"), locator.get("host"))
        if key not in self.opened:
            self.opened[key] = self._open(locator)
        return self.opened[key]

    def reachable(self) -> list[PayloadStore]:
        stores = [self.channel.store, *(s for s in self.opened.values() if s is not None)]
        return list({id(s): s for s in stores}.values())

    def _open(self, locator: Mapping[str, Any]) -> PayloadStore | None:
        kind, root, host = locator.get("store"), locator.get("root"), locator.get("host")
        own = self.channel.store
        if kind is None:  # indexed before locations were recorded: the channel's own kind
            return own
        if kind == "memfd":  # root: the name of the producer's segment server (its segments die with it)
            if host != socket.gethostname():
                return None
            if isinstance(own, MemfdStore) and own.server_name == root:
                return own
            try:
                return MemfdStore(self.channel.keys, server=check_server(root))
            except DecodeError:
                return None
        # a memfd store's locator starts its segment server: a sweeping consumer has no use for one
        mine = own.locator() if not isinstance(own, MemfdStore) else {}
        if mine and (kind, root, host) == (mine["store"], mine["root"], mine["host"]):
            return own
        if kind == "redis":
            return self.channel.store_for({"store": "redis"})
        if not isinstance(root, str):
            return None
        resolved = str(Path(root).resolve())
        if kind == "shm" and host == socket.gethostname() and (
                resolved in self.allowed or resolved == str(Path(SHM_ROOT).resolve())):
            return ShmStore(self.channel.keys, resolved)
        if kind == "file" and resolved in self.allowed:
            return FileStore(resolved, self.channel.keys)
        return None


def _locator(raw: Any) -> dict[str, Any]:
    """A recorded payload location (see ``PayloadStore.locator``); {} when absent or unreadable."""
    if not raw:
        return {}
    try:
        value = msgpack.unpackb(raw, raw=False)
    except Exception:
        return {}
    return value if isinstance(value, dict) else {}


def _n_samples(tensors: Mapping[str, Any]) -> int:
    for value in tensors.values():
        if isinstance(value, Ragged):
            return len(value)
        shape: Any = getattr(value, "shape", ())
        return int(shape[0]) if len(shape) else 1
    return 0

