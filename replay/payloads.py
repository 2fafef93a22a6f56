"""Payload bytes for export and import, through the namespace's payload stores (``events.payload``).

On export a ``BatchReady``'s reference is opened with ``BatchChannel.store_for`` (the
redis store, or shm on this host; a file store when the channel is made with it) and its
encoded bytes (``events.batch`` format) are copied into the log. On import the bytes are
decoded (checksums verified), re-encoded and put into the target namespace's store under
the same ref (``<policy>:<batch_id>[:<attempt>]``); the groups registered on the target batch stream
become the payload's readers and the ref is indexed, as ``BatchChannel.publish`` does, so
release and ``delete_expired`` treat an imported batch like a published one.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack

from rollout_bus.events.batch import DEFAULT_MAX_BYTES, decode, encode
from rollout_bus.events.batches import DEFAULT_PAYLOAD_TTL_S, BatchChannel
from rollout_bus.events.connection import Guard, Redis
from rollout_bus.events.errors import DecodeError, InvalidRequest, PayloadMissing, PayloadTooLarge
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import StoreSpec, make_store
from rollout_bus.events.payload.base import PayloadStore, check_ref
from rollout_bus.events.schema import BatchReady

log = logging.getLogger(__name__)
_READERS_GRACE_S = 3600


class StorePayloads:
    """``PayloadSource`` and ``PayloadSink`` over one namespace's payload stores."""

    def __init__(self, client: Redis, keys: Keys, *, store: str | StoreSpec = "redis",
                 ttl_s: int = DEFAULT_PAYLOAD_TTL_S, guard: Guard | None = None) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.guard = guard or Guard(client, name="log payloads")
        self.channel = BatchChannel(client, keys, make_store(store, client, keys), payload_ttl_s=ttl_s,
                                    guard=self.guard)

    def read(self, event: BatchReady) -> memoryview:
        try:
            buffer = self.channel.store_for(event.payload).get(event.payload)
        except DecodeError as exc:
            raise PayloadMissing(f"batch {event.batch_id}: {exc.reason}") from None
        except PayloadTooLarge as exc:  # a reference declaring more than a batch may hold: not exported
            raise PayloadMissing(f"batch {event.batch_id}: {exc}") from None
        return memoryview(buffer).cast("B")

    def write(self, event: BatchReady, data: bytes | memoryview) -> dict[str, Any]:
        try:
            store = self.channel.store_for(event.payload)
            ref = check_ref(event.payload.get("ref"))
        except DecodeError as exc:
            raise InvalidRequest(f"batch {event.batch_id}: {exc.reason}") from None
        batch = decode(data, verify=True)
        encoded = encode({**batch.tensors, **batch.ragged}, batch.meta,
                         max_bytes=max(DEFAULT_MAX_BYTES, batch.nbytes + (1 << 20)))
        reference = store.put(ref, encoded, self.ttl_s)
        self._track(event.policy, ref, store)
        return reference

    def _track(self, policy: str, ref: str, store: PayloadStore) -> None:
        """The stream's registered groups become the payload's readers; the ref goes into the payload index."""
        stream = self.keys.batch_stream(policy)
        readers = self.keys.payload_readers(ref)

        def run(c: Redis) -> None:
            groups = c.smembers(self.keys.registered_groups(stream))
            sec, usec = c.time()
            pipe = c.pipeline(transaction=True)
            if groups:
                pipe.sadd(readers, *groups)
                pipe.expire(readers, self.ttl_s + _READERS_GRACE_S)
            pipe.zadd(self.keys.payload_index, {ref: int(sec) * 1000 + int(usec) // 1000}, nx=True)
            pipe.hset(self.keys.payload_stores, ref, msgpack.packb(store.locator(), use_bin_type=True))
            pipe.execute()
        self.guard.call(run)

    def close(self) -> None:
        self.channel.close()


def payload_store(client: Redis, keys: Keys, *, store: str | StoreSpec = "redis",
                  ttl_s: int = DEFAULT_PAYLOAD_TTL_S) -> StorePayloads:
    """The payload stores of ``keys``' namespace, for ``export_log`` and ``import_log``."""
    return StorePayloads(client, keys, store=store, ttl_s=ttl_s)
