"""The default store: payload bytes in the bus's Redis, reachable from every host.

A payload is split into chunks of ``chunk_bytes`` (just under 1 MiB), each under
``keys.payload_chunk(ref, i)`` (chunk 0, with the header, is ``keys.payload(ref)``) with a TTL. Chunking is what makes this fast: Redis keeps
each SET argument as the value without copying, and jemalloc recycles chunk-sized
allocations, while one 64 MiB value is a fresh, page-faulting allocation on every SET and
GET. Writes go out as pipelined ``SET key chunk EX ttl`` commands whose chunk arguments
are memoryviews of the tensors (``resp.RespConnection``); reads keep ``window`` GETs in
flight and receive each chunk straight into its place in one buffer. A redis-py client
that is not a socket to a real server (fakeredis) gets the same layout through redis-py.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar

import numpy as np
import redis

from rollout_bus.events.batch import Buffer, EncodedBatch
from rollout_bus.events.connection import Guard, is_sentinel_client
from rollout_bus.events.errors import BusUnavailable, DecodeError, PayloadMissing, RedisCommandError
from rollout_bus.events.names import Keys
from rollout_bus.events.payload.base import PayloadBuffer, PayloadStore, Reference
from rollout_bus.events.payload.resp import (
    Address,
    Arg,
    RespConnection,
    RespError,
    RespProtocolError,
    pack_command,
)

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = (1 << 20) - 512  # with Redis' own headers, each chunk fills jemalloc's 1 MiB class
DEFAULT_WINDOW = 2
MIN_CHUNK_BYTES = 4096


def split_chunks(buffers: list[Buffer], chunk_bytes: int) -> list[list[memoryview]]:
    """The buffers cut at every ``chunk_bytes`` boundary of their concatenation (views, no copies)."""
    chunks: list[list[memoryview]] = [[]]
    room = chunk_bytes
    for buf in buffers:
        view = memoryview(buf).cast("B")
        while view.nbytes:
            if room == 0:
                chunks.append([])
                room = chunk_bytes
            take = min(room, view.nbytes)
            chunks[-1].append(view[:take])
            view = view[take:]
            room -= take
    return chunks


class RedisStore(PayloadStore):
    name: ClassVar[str] = "redis"

    def __init__(self, client: redis.Redis, keys: Keys, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 window: int = DEFAULT_WINDOW, raw: bool | None = None, address: Address | None = None) -> None:
        if chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be at least {MIN_CHUNK_BYTES}, got {chunk_bytes}")
        self.client = client
        self.keys = keys
        self.chunk_bytes = chunk_bytes
        self.window = max(1, window)
        if raw is None:  # a Sentinel client has no fixed address: its connections ask the sentinels
            raw = not type(client).__module__.startswith("fakeredis") and (address is not None
                                                                          or not is_sentinel_client(client))
        self._conn = RespConnection(address or Address.from_client(client)) if raw else None
        self._lock = threading.Lock()
        self._guard = Guard(client, name="redis payload store")

    # --- interface ---------------------------------------------------------------------
    def put(self, ref: str, batch: EncodedBatch, ttl_s: int) -> Reference:
        chunks = split_chunks(batch.buffers, self.chunk_bytes)
        names = [self.keys.payload_chunk(ref, i) for i in range(len(chunks))]
        if self._conn is None:
            batch.finish()
            values = [b"".join(parts) for parts in chunks]

            def write(c: redis.Redis) -> Any:  # a fresh pipeline per try: a failed execute empties it
                pipe = c.pipeline(transaction=False)
                for name, value in zip(names, values, strict=True):
                    pipe.set(name, value, ex=ttl_s)
                return pipe.execute()
            self._call(write)
        else:
            def frames(i: int) -> list[bytes | memoryview]:
                size = sum(p.nbytes for p in chunks[i])
                name = names[i].encode()
                return [b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, size), *chunks[i],
                        b"\r\n$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl_s)), ttl_s)]

            def send(conn: RespConnection) -> None:
                batch.start_checksum()  # hashing runs while the later chunks go out; chunk 0 (the header) last
                conn.send([f for i in range(1, len(chunks)) for f in frames(i)])
                batch.finish()
                conn.send(frames(0))
                self._check_replies(conn, len(chunks))
            self._raw(send)
        return {"store": self.name, "ref": ref, "nbytes": batch.nbytes, "chunks": len(chunks),
                "chunk_bytes": self.chunk_bytes}

    def _layout(self, reference: Reference) -> tuple[str, int, int, list[str]]:
        """ref, nbytes, chunk_bytes and chunk key names of a reference, checked for consistency and
        against ``max_bytes`` (so neither the buffer nor the list of chunk names can be made huge)."""
        ref = self._ref(reference)
        nbytes, chunks, chunk_bytes = (reference.get(k) for k in ("nbytes", "chunks", "chunk_bytes"))
        if not (type(nbytes) is int and type(chunks) is int and type(chunk_bytes) is int
                and nbytes > 0 and chunk_bytes >= MIN_CHUNK_BYTES
                and (nbytes + chunk_bytes - 1) // chunk_bytes == chunks):
            raise DecodeError(f"redis payload reference {reference!r}: nbytes, chunks and chunk_bytes do not agree")
        self._check_size(ref, nbytes)
        return ref, nbytes, chunk_bytes, [self.keys.payload_chunk(ref, i) for i in range(chunks)]

    def get(self, reference: Reference) -> PayloadBuffer:
        ref, nbytes, chunk_bytes, names = self._layout(reference)
        out = np.empty(nbytes, dtype=np.uint8)  # numpy asks for huge pages: cheap page faults
        view = out.data
        if self._conn is None:
            values = self._call(lambda c: c.mget(names))
            if any(v is None for v in values):
                raise self._missing(ref)
            pos = 0
            for v in values:
                view[pos:pos + len(v)] = v
                pos += len(v)
            if pos != nbytes:
                raise DecodeError(f"payload {ref} holds {pos} bytes, its reference says {nbytes}")
        elif not self._raw(lambda c: self._windowed_get(c, names, view, chunk_bytes)):
            raise self._missing(ref)
        return view

    def delete(self, reference: Reference) -> None:
        ref = self._ref(reference)
        if "chunks" in reference:
            names = self._layout(reference)[3]
            self._call(lambda c: c.delete(*names))
            return
        start = 0  # chunk count unknown (a reference rebuilt by ``delete_expired``): delete until one is missing
        while True:
            names = [self.keys.payload_chunk(ref, i) for i in range(start, start + 64)]
            def remove(c: redis.Redis, names: list[str] = names) -> Any:
                pipe = c.pipeline(transaction=False)
                for name in names:
                    pipe.delete(name)
                return pipe.execute()
            removed = self._call(remove)
            if not all(removed):
                return
            start += 64

    def redis_keys(self, reference: Reference) -> list[str]:
        return self._layout(reference)[3]

    def close(self) -> None:
        if self._conn is not None:
            with self._lock:
                self._conn.close()

    # --- raw protocol ------------------------------------------------------------------
    @staticmethod
    def _check_replies(conn: RespConnection, replies: int) -> None:
        error: RespError | None = None
        for _ in range(replies):  # read every reply, so the connection stays in step
            try:
                conn.read_reply()
            except RespError as exc:
                error = error or exc
        if error is not None:
            raise error

    def _windowed_get(self, conn: RespConnection, names: list[str], out: memoryview, chunk_bytes: int) -> bool:
        def request(i: int) -> list[bytes | memoryview]:
            args: list[Arg] = ["GET", names[i]]
            return pack_command(args)

        first = min(self.window, len(names))
        conn.send([f for i in range(first) for f in request(i)])
        found = True
        for i in range(len(names)):
            if i + first < len(names):
                conn.send(request(i + first))
            found = conn.read_bulk_into(out[i * chunk_bytes:(i + 1) * chunk_bytes]) and found
        return found

    def _raw(self, fn: Any) -> Any:
        """Run ``fn(conn)``; a dropped connection is reopened and the operation retried once."""
        assert self._conn is not None
        with self._lock:
            for attempt in (1, 2):
                try:
                    return fn(self._conn)
                except RespError as exc:
                    self._conn.close()
                    raise RedisCommandError(str(exc)) from None
                except RespProtocolError as exc:
                    self._conn.close()
                    raise DecodeError(f"redis payload store: {exc}") from None
                except (OSError, ConnectionError) as exc:
                    self._conn.close()
                    if attempt == 2:
                        raise BusUnavailable(f"redis payload store: {exc}") from None
                    log.warning("redis payload store: connection lost (%s); retrying once", exc)
            raise AssertionError("unreachable")

    def _call(self, fn: Any) -> Any:
        """``fn(client)`` through the guard: a lost connection (a restart, a Sentinel failover) is retried."""
        return self._guard.call(fn)

    @staticmethod
    def _missing(ref: str) -> PayloadMissing:
        return PayloadMissing(f"payload {ref} is gone from Redis (expired after its TTL, swept, or released "
                              f"by every group); its BatchReady event can no longer be served")
