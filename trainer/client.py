"""The trainer's side of the bus: ask for rollouts, receive their batches, ack them after the step.

``RolloutClient.request(rollout_id)`` queues a rollout (an rq job plus ``RolloutRequested``)
under a deterministic request id, so asking again after a restart never makes a second
batch. ``get(rollout_id)`` hands over the batch of that rollout (miles' meaning of
``get``); ``next()`` hands over whichever batch came first. Batches are read from the
policy's batch stream through the trainer's own consumer group under a stable consumer
name, so a restarted trainer first re-reads the batches it held; batches held in the buffer
are touched (``Consumer.touch``) so that no claim takes them while they wait. ``ack`` comes
after the training step: ``BatchConsumed`` (once per group and batch), the payload's release,
then ``XACK`` last, so a crash anywhere before it only means the batch comes back.

A batch that fails any check on the way in (an event of another policy, a payload of another
batch or over ``max_batch_bytes``, undecodable bytes, train data with bad values or ids outside
the vocabulary) is dead-lettered with its reason and never buffered; ``refused()`` hands it to the
trainer, which asks for that rollout again. Only a payload that is gone keeps the old path (the
batch is buffered without data).

``start`` takes the policy's trainer lease (``trainer.lease``): a second trainer of the same
policy is refused unless it is a data-parallel rank of the same trainer. Every write of the
client is bound to that lease: ``TrainerJoined``, ``BatchConsumed``, the payload's release and the
``XACK`` each check it in the same script as the write; requests and reads ask the server first.
A trainer paused past its lease gets ``LeaseLost`` at its next write and writes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rollout_bus.events.batch import DEFAULT_MAX_BYTES
from rollout_bus.events.connection import Redis
from rollout_bus.events.consume import Consumer, ConsumerConfig, Message, stable_consumer_name
from rollout_bus.events.errors import DecodeError, InvalidRequest, LeaseLost, PayloadMissing, PayloadTooLarge
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.rollouts import MAX_REQUEST_ID, RolloutRequest, SamplingParams
from rollout_bus.events.schema import BatchConsumed, BatchReady, Event, Producer, TrainerJoined, encode
from rollout_bus.events.submit import RolloutSubmitter, SubmitConfig
from rollout_bus.events.train_data import TrainData
from rollout_bus.lm.tokenizer import EOS_ID
from rollout_bus.trainer.config import RolloutConfig
from rollout_bus.trainer.lease import PolicyLease
from rollout_bus.trainer.payloads import ChannelReader, PayloadReader

log = logging.getLogger(__name__)

MAX_REFUSED = 1024
"""Refused batches kept for ``refused`` (the oldest go first: a flood of forged events costs bounded memory)."""


@dataclass
class ClientConfig:
    policy: str
    trainer_id: str
    group: str
    consumer_index: int = 0
    """This client's data-parallel rank (its consumer name, and its rank in the policy lease)."""
    dp_size: int = 1
    start_id: str = "$"
    """Where a new group starts: ``$`` (batches from now on) or ``0`` (the whole retained stream)."""
    claim_idle_ms: int = 600_000
    """Entries another consumer of the group held this long are taken over (data-parallel ranks)."""
    block_ms: int = 200
    lease_ttl_s: float = 30.0
    """The policy lease (one trainer per policy) lapses this long after this trainer stops renewing it."""
    max_batch_bytes: int = DEFAULT_MAX_BYTES
    """The largest payload read; a batch declaring more is dead-lettered before anything is allocated."""
    vocab_size: int | None = None
    """The model's vocabulary: a batch with a token id outside it is dead-lettered (None: not checked)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class ReceivedBatch:
    """A batch handed to the trainer; ack it with ``RolloutClient.ack`` after the step."""

    message_id: str
    event: BatchReady
    data: TrainData | None
    """None when the payload could not be read (``error`` says why)."""
    deliveries: int
    received_at: float
    error: str = ""
    shard: int = 0
    """The Redis shard it came from (``trainer.redis_shards``); 0 with one Redis."""

    @property
    def batch_id(self) -> str:
        return self.event.batch_id

    @property
    def rollout_id(self) -> int:
        return self.event.rollout_id

    @property
    def request_id(self) -> str:
        return self.event.request_id


class Handing:
    """``get`` and ``next`` over a client's ``take`` and ``poll`` (one Redis, or several: ``trainer.redis_shards``)."""

    def take(self, predicate: Any = None) -> ReceivedBatch | None:
        raise NotImplementedError

    def poll(self, block_ms: int | None = None) -> int:
        raise NotImplementedError

    def get(self, rollout_id: int, timeout_s: float, request_id: str | None = None) -> ReceivedBatch:
        """The batch of ``rollout_id`` (of ``request_id`` when given); ``TimeoutError`` after ``timeout_s``."""
        def wanted(b: ReceivedBatch) -> bool:
            return b.rollout_id == rollout_id and (request_id is None or b.request_id == request_id)
        return self._wait(wanted, timeout_s, f"rollout {rollout_id}")

    def next(self, timeout_s: float) -> ReceivedBatch:
        """The first batch to arrive (buffered ones first)."""
        return self._wait(None, timeout_s, "any batch")

    def _wait(self, predicate: Any, timeout_s: float, what: str) -> ReceivedBatch:
        deadline = time.monotonic() + timeout_s
        while True:
            batch = self.take(predicate)
            if batch is not None:
                return batch
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no batch for {what} after {timeout_s:.1f}s")
            self.poll()


class RolloutClient(Handing):
    """Requests rollouts for one policy and receives their batches through one consumer group."""

    def __init__(self, client: Redis, keys: Keys, config: ClientConfig, producer: Producer, *,
                 payloads: PayloadReader | None = None, submit_config: SubmitConfig | None = None) -> None:
        self.client = client
        self.keys = keys
        self.config = config
        self.producer = producer
        self.publisher = Publisher(client, keys, producer)
        self.submitter = RolloutSubmitter(client, keys, submit_config, producer=producer)
        self.payloads = payloads or ChannelReader(client, keys, max_bytes=config.max_batch_bytes)
        self.consumer_name = stable_consumer_name(config.trainer_id, config.consumer_index)
        self.consumer = Consumer(client, keys, keys.batch_stream(config.policy), config.group,
                                 self.consumer_name,
                                 ConsumerConfig(block_ms=config.block_ms, auto_ack=False, start_id=config.start_id,
                                                claim_idle_ms=config.claim_idle_ms))
        self._buffer: OrderedDict[str, ReceivedBatch] = OrderedDict()
        self._refused: deque[ReceivedBatch] = deque(maxlen=MAX_REFUSED)
        self._touched = time.monotonic()
        self.lease = PolicyLease(client, keys, config.policy, config.trainer_id, rank=config.consumer_index,
                                 dp_size=config.dp_size, ttl_s=config.lease_ttl_s)
        self._prefix = request_prefix(config.trainer_id)

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Take the policy lease, create the consumer group (before the first request, so no batch is
        missed) and join."""
        self.lease.acquire()
        self.consumer.ensure_group()
        with self._deposed_on_refusal():
            self.publisher.publish(self.keys.trainer_stream, TrainerJoined(
                producer=self.producer, policy=self.config.policy, trainer_id=self.config.trainer_id,
                group=self.config.group), lease=self.lease.fence)

    def stop(self) -> None:
        self._buffer.clear()
        self.consumer.close()
        self.payloads.close()
        self.lease.release()

    # --- requests ------------------------------------------------------------------------
    def request_id(self, run_id: str, rollout_id: int, attempt: int = 1) -> str:
        """``<trainer>-<run>-r<rollout>[-a<attempt>]`` (rq job ids take no dots).

        The trainer part is the trainer id, or for a long one its head and a hash of it, the same
        for every rollout and attempt, so every id this trainer makes fits ``MAX_REQUEST_ID``.
        """
        suffix = f"-a{attempt}" if attempt > 1 else ""
        request_id = f"{self._prefix}-{run_id}-r{rollout_id}{suffix}"
        if len(request_id) > MAX_REQUEST_ID:
            raise InvalidRequest(f"request id {request_id!r} is longer than {MAX_REQUEST_ID} characters: "
                                 f"the run id {run_id!r} is too long")
        return request_id

    def request(self, rollout_id: int, request_id: str, *, timeout_s: float | None = None,
                returned: list[dict[str, Any]] | None = None) -> RolloutRequest:
        """Queue rollout ``rollout_id`` under ``request_id`` (a repeat is a no-op); ``returned`` gives
        data-source items back (see ``RolloutRequest.returned``)."""
        r = self.config.rollout
        request = RolloutRequest.create(
            self.config.policy, rollout_id, r.n_groups, r.n_samples_per_group,
            timeout_s=timeout_s if timeout_s is not None else r.timeout_s,
            sampling=SamplingParams(temperature=r.temperature, max_new_tokens=r.max_new_tokens,
                                    stop_token_ids=r.stop_token_ids or (EOS_ID,)),
            request_id=request_id, data=dict(r.data), std_normalise=r.std_normalise, returned=list(returned or []),
            over_sample_groups=r.over_sample_groups)
        self.lease.verify()  # a deposed trainer asks for nothing more (a repeat is a no-op anyway)
        self.submitter.submit(request)
        return request

    # --- receiving -----------------------------------------------------------------------
    def poll(self, block_ms: int | None = None) -> int:
        """Read what the group has for us into the buffer; returns how many batches came in.

        Batches waiting in the buffer are touched every third of ``claim_idle_ms``: a claim would
        hand them to another consumer, or back to this one with one more delivery counted, until
        ``max_deliveries`` dead-lettered a batch nothing is wrong with. The lease is asked first: a
        deposed trainer takes no entry of the group into its hands.
        """
        self.lease.verify()
        now = time.monotonic()
        if self._buffer and (now - self._touched) * 1000 >= self.config.claim_idle_ms / 3:
            self.consumer.touch(*self._buffer)
            self._touched = now
        messages = self.consumer.read(block_ms if block_ms is not None else self.config.block_ms)
        added = 0
        for msg in messages:
            if msg.id in self._buffer:
                continue
            batch = self._receive(msg)
            if batch is not None:
                self._buffer[msg.id] = batch
                added += 1
        return added

    def _receive(self, msg: Message) -> ReceivedBatch | None:
        event = msg.event
        if not isinstance(event, BatchReady):
            self.consumer.dead_letter(msg.id, msg.fields, f"expected BatchReady, got {event.type}", msg.deliveries)
            return None
        if event.policy != self.config.policy:
            self._refuse(msg.id, msg.fields, msg.deliveries, event,
                         f"a batch of policy {event.policy!r} on the stream of {self.config.policy!r}", release=False)
            return None
        try:
            data = self.payloads.fetch(event)
            if self.config.vocab_size is not None:
                data.check_vocab(self.config.vocab_size)
        except PayloadMissing as exc:
            log.warning("batch %s: payload unusable: %s", event.batch_id, exc)
            return ReceivedBatch(msg.id, event, None, msg.deliveries, time.monotonic(), str(exc))
        except (DecodeError, PayloadTooLarge) as exc:
            self._refuse(msg.id, msg.fields, msg.deliveries, event, f"batch {event.batch_id} refused: {exc}",
                         release=True)
            return None
        return ReceivedBatch(msg.id, event, data, msg.deliveries, time.monotonic())

    def _refuse(self, entry_id: str, fields: Any, deliveries: int, event: BatchReady, reason: str, *,
                release: bool, keep: bool = True) -> None:
        """Dead-letter a batch that failed a check (with ``reason``) and keep it for ``refused``; its payload
        is released when it is this batch's own (a reference to another batch's bytes is left alone). Both
        writes are bound to the lease, as every write of the trainer is."""
        fence = self.lease.fence
        with self._deposed_on_refusal():
            self.consumer.dead_letter(entry_id, fields, reason, deliveries, lease=fence)
            if release:
                try:
                    self.payloads.release(event, self.config.group, lease=fence)
                except (DecodeError, PayloadMissing, PayloadTooLarge) as exc:
                    log.info("batch %s: payload not released: %s", event.batch_id, exc)
        if keep:
            self._refused.append(ReceivedBatch(entry_id, event, None, deliveries, time.monotonic(), reason))

    def refuse(self, batch: ReceivedBatch, reason: str) -> None:
        """Dead-letter a batch taken from the buffer that the trainer cannot use (a step it refused)."""
        self._buffer.pop(batch.message_id, None)
        self._refuse(batch.message_id, encode(batch.event), batch.deliveries, batch.event, reason, release=True,
                     keep=False)

    def refused(self) -> list[ReceivedBatch]:
        """The batches dead-lettered by ``poll`` since the last call (their ``error`` says why)."""
        out = list(self._refused)
        self._refused.clear()
        return out

    def buffered(self) -> list[ReceivedBatch]:
        return list(self._buffer.values())

    def adopt_buffer(self, other: RolloutClient) -> None:
        """Take over the batches ``other`` (a client of the same group and consumer that is being replaced) read and
        holds, so that they are handed over without being read again (the same entry read again is skipped)."""
        for key, batch in other._buffer.items():
            self._buffer.setdefault(key, batch)
        other._buffer.clear()

    def take(self, predicate: Any = None) -> ReceivedBatch | None:
        """Remove and return the first buffered batch (that ``predicate`` accepts), if any."""
        for key, batch in self._buffer.items():
            if predicate is None or predicate(batch):
                del self._buffer[key]
                return batch
        return None

    def wait_for(self, rollout_id: int, timeout_s: float) -> bool:
        """Block until the batch of ``rollout_id`` is buffered (without taking it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if any(b.rollout_id == rollout_id for b in self._buffer.values()):
                return True
            if time.monotonic() >= deadline:
                return False
            self.poll()

    # --- acknowledging -------------------------------------------------------------------
    def ack(self, batch: ReceivedBatch, *, staleness: int, accepted: bool, reason: str = "") -> None:
        """After the step: announce ``BatchConsumed`` (once per group), release the payload, then XACK.

        Each step may run again without effect (the event is deduplicated by group and batch, a
        release by a group that released already changes nothing), and the XACK comes last: a
        crash anywhere before it means the entry is delivered again and the steps complete then.
        Each step runs only while the lease holds (``LeaseLost``, and nothing written, otherwise).
        """
        fence = self.lease.fence
        with self._deposed_on_refusal():
            self.publisher.publish(self.keys.trainer_stream, BatchConsumed(
                producer=self.producer, policy=self.config.policy, batch_id=batch.batch_id,
                trainer_id=self.config.trainer_id, staleness=staleness, accepted=accepted, reason=reason),
                idempotency_key=f"consumed.{self.config.group}.{batch.batch_id}", lease=fence)
            try:
                self.payloads.release(batch.event, self.config.group, lease=fence)
            except DecodeError as exc:  # a reference no store here can open: the janitor sweeps it by age
                log.warning("batch %s: payload not released: %s", batch.batch_id, exc.reason)
            self.consumer.ack(batch.message_id, lease=fence)

    def announce(self, stream: str, event: Event, idempotency_key: str) -> None:
        """Publish ``event`` on ``stream`` once (``idempotency_key``), bound to the lease."""
        with self._deposed_on_refusal():
            self.publisher.publish(stream, event, idempotency_key=idempotency_key, lease=self.lease.fence)

    @contextlib.contextmanager
    def _deposed_on_refusal(self) -> Iterator[None]:
        """A leased write refused: remember it, so every later check fails at once."""
        try:
            yield
        except LeaseLost:
            self.lease.lost.set()
            raise


def request_prefix(trainer_id: str, room: int = 24) -> str:
    """The trainer part of its request ids: the id (dots as '_'), or its head and 8 hex of its sha1."""
    plain = trainer_id.replace(".", "_")
    if len(plain) <= room:
        return plain
    return f"{plain[:room - 9]}-{hashlib.sha1(trainer_id.encode()).hexdigest()[:8]}"
