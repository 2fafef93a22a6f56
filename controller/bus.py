"""The controller's side of Redis: ordered announcements and its two command inputs.

``events`` is synchronous (redis-py); the controller is asyncio. Every write (registry
record, then event) runs on one dedicated thread, so writes leave in the order the
controller made them and the event loop never blocks on Redis. Records are copied
on the loop before they cross threads. Announcing writes the registry first, then the
event: a reader that reacts to an event finds the registry already saying so.

Blocking reads (``WeightsPublished`` and offload/onload commands) use their own
threads through ``asyncio.to_thread`` with a short block, so stopping is prompt.

Each policy has a weight stream of its own (``Keys.weight_stream``): the controller group reads every one
(``WeightStreams``), found by SCAN when it starts and again every ``DISCOVER_EVERY_S``, so a policy whose
trainer joins after the controller started is read from its first entry; and the legacy single stream, for
the ``WeightsPublished`` an event log from before holds (for one release). A weights entry is handed to the
updater as ``"<stream> <entry id>"``: ids of two streams may be equal. The controller's outcomes for a policy
go on that policy's stream; those about no policy (a check request's close) on the base policy's.

Registry writes carry the controller's fencing token (``fence``) and its lease owner
(``holder``): a write refused because another controller took the lease raises ``Fenced`` and
sets ``fenced``, which the leader runner takes as the signal to check the lease again. So does
an engine's fenced reply (``controller.core``). Once ``fenced`` is set this bus writes nothing
more (registry, events, acks): what the refusal means is the runner's to decide, and until it
has, nothing this instance would write can be trusted.

At takeover (``take_over``) the new leader claims every entry still pending in the controller
group on the weights and commands streams, whoever's consumer holds it (XAUTOCLAIM, min idle 0):
a leader that died after reading ``WeightsPublished`` and before acting leaves it there, and the
trainer waits for that version. Within one tenure, a redelivered entry of its own that is still
in flight is skipped by id.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from rollout_bus.events.connection import Guard, Redis
from rollout_bus.events.consume import Consumer, ConsumerConfig, Message, stable_consumer_name
from rollout_bus.events.errors import Fenced, RedisCommandError
from rollout_bus.events.names import Keys, publication_key, weight_stream_policy
from rollout_bus.events.paging import page, weight_streams
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import EngineRecord, PolicyRecord, Registry, fenced_error
from rollout_bus.events.schema import Event, Producer, decode

log = logging.getLogger(__name__)
T = TypeVar("T")

GROUP = "controller"
DISCOVER_EVERY_S = 1.0
"""How often the controller looks for weight streams it does not read yet (a policy's trainer that joined)."""


class WeightStreams:
    """The controller group's consumers on every weight stream (one ``Consumer`` each), read as one."""

    def __init__(self, client: Redis, keys: Keys, name: str, config: ConsumerConfig, *,
                 discover_every_s: float = DISCOVER_EVERY_S) -> None:
        self.client = client
        self.keys = keys
        self.name = name
        self.config = config
        self.discover_every_s = discover_every_s
        self.consumers: dict[str, Consumer] = {}
        self.guard = Guard(client, name=f"consumer {GROUP}/{name} weights")
        self._next_discovery = 0.0

    def discover(self) -> list[str]:
        """Start reading the weight streams that appeared since the last look; the new ones."""
        self._next_discovery = time.monotonic() + self.discover_every_s
        new = [s for s in weight_streams(self.client, self.keys, guard=self.guard) if s not in self.consumers]
        for stream in new:
            self.consumers[stream] = Consumer(self.client, self.keys, stream, GROUP, self.name, self.config)
            log.info("reading weight stream %s", stream)
        return new

    def read(self) -> list[Message]:
        """What any weight stream holds for this consumer (each id made ``"<stream> <id>"``); with nothing,
        waits up to ``block_ms`` for a new entry on any of them."""
        if time.monotonic() >= self._next_discovery:
            self.discover()
        out = [dataclasses.replace(m, id=handle(stream, m.id))
               for stream, consumer in list(self.consumers.items()) for m in consumer.read(block_ms=0)]
        block_ms = self.config.block_ms
        if out or not block_ms:
            return out
        if not self.consumers:
            time.sleep(block_ms / 1000)
            return out
        # a wake-up alone: what came is read through the group next time (an entry missed here waits one block)
        self.guard.call(lambda c: c.xread({s: "$" for s in self.consumers}, block=block_ms, count=1))
        return out

    def misplaced(self, message: Message) -> str | None:
        """Why ``message`` (a ``WeightsPublished``) is not on the stream it belongs to, or None: on a policy's
        stream, a publication of another policy is refused whoever sent it (only that policy's trainer may
        write there, and none may announce for another)."""
        stream, _ = split_handle(message.id)
        home = weight_stream_policy(self.keys, stream)
        policy = getattr(message.event, "policy", None)
        if home is None or policy == home:
            return None
        return f"a publication of policy {policy!r} on the weight stream of policy {home!r}: refused"

    def dead_letter(self, message: Message, reason: str) -> None:
        stream, entry_id = split_handle(message.id)
        self.consumers[stream].dead_letter(entry_id, message.fields, reason, message.deliveries)

    def ack(self, *handles: str) -> None:
        by_stream: dict[str, list[str]] = {}
        for h in handles:
            stream, entry_id = split_handle(h)
            by_stream.setdefault(stream, []).append(entry_id)
        for stream, ids in by_stream.items():
            self.consumers[stream].ack(*ids)


def handle(stream: str, entry_id: str) -> str:
    """How the controller names a weights entry: its stream and its id (no stream name holds a space)."""
    return f"{stream} {entry_id}"


def split_handle(value: str) -> tuple[str, str]:
    stream, _, entry_id = value.rpartition(" ")
    return stream, entry_id


class ControllerBus:
    def __init__(self, client: Redis, keys: Keys, producer: Producer, instance: str, *,
                 fence: int | None = None, holder: str | None = None, base_policy: str = "default") -> None:
        self.client = client
        self.keys = keys
        self.base_policy = base_policy
        self.producer = producer
        self.registry = Registry(client, keys, fence=fence, holder=holder)
        self.fenced = asyncio.Event()
        self.publisher = Publisher(client, keys, producer)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="controller-redis")
        # A long claim idle: entries of a predecessor are claimed at takeover (``take_over``), not by idling
        config = ConsumerConfig(block_ms=200, count=16, claim_idle_ms=600_000, auto_ack=False)
        name = stable_consumer_name(f"controller-{instance}")
        self.weights = WeightStreams(client, keys, name, config)
        self.commands = Consumer(client, keys, keys.command_stream, GROUP, name, config)
        self.may_read: Callable[[], bool] | None = None
        """Whether this instance's lease is still good by its own clock (set by the runner). A read into the
        group makes the entries this consumer's pending ones, which a successor claims only at its takeover: a
        leader woken from a pause past its lease must not read a version published after that takeover."""

    # --- writes, in order, off the loop -----------------------------------------------------
    async def call(self, fn: Callable[[], T]) -> T:
        if self.fenced.is_set():
            raise Fenced("this controller was fenced: it writes nothing until its lease is checked again")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._writer, fn)
        except (RedisCommandError, Fenced) as exc:
            fenced = fenced_error(exc)
            if fenced is None:
                raise
            self.fenced.set()
            raise fenced from None

    async def announce(self, stream: str, event: Event | None, record: EngineRecord | None = None, *,
                       durable: bool = False) -> None:
        snapshot = copy.deepcopy(record) if record is not None else None

        def write() -> None:
            if snapshot is not None:
                self.registry.put_engine(snapshot)
            elif event is not None:  # an event alone: the fence is checked first, so a deposed leader adds none
                self.registry.check_fence()
            if event is not None:
                self.publisher.publish(stream, event, durable=durable)
        await self.call(write)

    async def engine(self, event: Event | None, record: EngineRecord | None = None) -> None:
        """An engine event on the engine stream, with the engine's record written first."""
        await self.announce(self.keys.engine_stream, event, record)

    async def weights_event(self, event: Event, record: EngineRecord | None = None, *, durable: bool = False) -> None:
        """An event on its policy's weight stream (about no policy: the base policy's); ``durable`` ones
        (``WeightVersionServing``) wait for the replicas."""
        policy = getattr(event, "policy", "") or self.base_policy
        await self.announce(self.keys.weight_stream(policy), event, record, durable=durable)

    async def put_engines(self, records: Iterable[EngineRecord]) -> None:
        """Several engine records (no events) in one command: a health round's loads cost one write,
        not one per engine."""
        snapshots = [copy.deepcopy(r) for r in records]
        if not snapshots:
            return
        await self.call(lambda: self.registry.put_engines(snapshots))

    async def put_policy(self, record: PolicyRecord) -> None:
        snapshot = copy.deepcopy(record)
        await self.call(lambda: self.registry.put_policy(snapshot))

    async def remove_engine(self, engine_id: str) -> None:
        await self.call(lambda: self.registry.remove_engine(engine_id))

    async def forget_publication(self, policy: str, version: int) -> None:
        """A refused version may be announced again: its publisher's dedupe key goes (before the refusal is
        published, so a trainer reacting to it is not deduplicated)."""
        await self.call(lambda: self.publisher.forget(self.keys.weight_stream(policy), publication_key(policy, version)))

    # --- reads ----------------------------------------------------------------------------
    async def trainer_lease_owner(self, policy: str) -> str | None:
        return await asyncio.to_thread(self.registry.trainer_lease_owner, policy)

    async def read_weights(self) -> list[Message]:
        return await asyncio.to_thread(self._gated, self.weights.read)

    async def read_commands(self) -> list[Message]:
        return await asyncio.to_thread(self._gated, self.commands.read)

    def _gated(self, read: Callable[[], list[Message]]) -> list[Message]:
        """``read()``, unless the lease is not good any more by this instance's clock (``may_read``): then nothing
        is read (the runner is about to step down), after the usual wait of an empty read."""
        if self.may_read is not None and not self.may_read():
            time.sleep(self.weights.config.block_ms / 1000)
            return []
        return read()

    async def ack_weights(self, *ids: str) -> None:
        await self.call(lambda: self.weights.ack(*ids))

    async def dead_letter_weights(self, message: Message, reason: str) -> None:
        """A weights entry that must not be acted on goes to the dead letters (and is acked), with ``reason``."""
        await self.call(lambda: self.weights.dead_letter(message, reason))

    async def ack_commands(self, *ids: str) -> None:
        await self.call(lambda: self.commands.ack(*ids))

    async def take_over(self) -> int:
        """Claim every entry pending in the controller group on the weight streams and the commands stream (a
        predecessor's included) for this instance's consumers, before their first read; how many."""
        def claim() -> int:
            self.weights.discover()
            return sum(_claim_all(consumer) for consumer in (*self.weights.consumers.values(), self.commands))
        return await self.call(claim)

    async def snapshot(self) -> tuple[list[Event], dict[str, EngineRecord], dict[str, PolicyRecord]]:
        """The engine event log, the engine records and the policy records, as they are now."""
        def read() -> tuple[list[Event], dict[str, EngineRecord], dict[str, PolicyRecord]]:
            log_events: list[Event] = []
            for entry_id, fields in page(self.client, self.keys.engine_stream):
                try:
                    log_events.append(decode(fields))
                except Exception as exc:
                    log.warning("skipping undecodable engine event %s: %s", entry_id, exc)
            return log_events, self.registry.engines(), self.registry.policies()
        return await self.call(read)

    def close(self, *, wait: bool = True) -> None:
        """Stop the writer thread; ``wait`` False leaves a write stuck on an unreachable Redis behind."""
        self._writer.shutdown(wait=wait, cancel_futures=not wait)


def _claim_all(consumer: Consumer) -> int:
    """XAUTOCLAIM with min idle 0 over the whole pending list of ``consumer``'s group, to ``consumer``: the entries
    are then its own pending ones, which its first read hands out. Entries trimmed meanwhile are acked."""
    claimed, start = 0, "0-0"
    consumer.ensure_group()
    while True:
        reply = consumer.guard.call(lambda c, s=start: c.xautoclaim(  # type: ignore[misc]
            consumer.stream, consumer.group, consumer.name, min_idle_time=0, start_id=s, count=100))
        if not reply:
            return claimed
        start = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        claimed += len(reply[1])
        deleted = list(reply[2]) if len(reply) > 2 else []
        if deleted:
            consumer.guard.call(lambda c, d=deleted: c.xack(consumer.stream, consumer.group, *d))  # type: ignore[misc]
        if start == "0-0":
            if claimed:
                log.info("took over %d pending entries of %s (group %s)", claimed, consumer.stream, consumer.group)
            return claimed
