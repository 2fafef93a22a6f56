"""The trainer's side of the bus: ask for rollouts, receive their batches, ack them after the step.

``RolloutClient.request(rollout_id)`` queues a rollout (an rq job plus ``RolloutRequested``)
under a deterministic request id, so asking again after a restart never makes a second
batch. ``get(rollout_id)`` hands over the batch of that rollout (miles' meaning of
``get``); ``next()`` hands over whichever batch came first. Batches are read from the
policy's batch stream through the trainer's own consumer group under a stable consumer
name, so a restarted trainer first re-reads the batches it held. ``ack`` comes after the
training step: ``XACK``, ``BatchConsumed`` (once per group and batch) and the payload's
release.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rollout_bus.events.connection import Redis
from rollout_bus.events.consume import Consumer, ConsumerConfig, Message, stable_consumer_name
from rollout_bus.events.errors import DecodeError, PayloadMissing
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.rollouts import RolloutRequest, SamplingParams
from rollout_bus.events.schema import BatchConsumed, BatchReady, Producer, TrainerJoined
from rollout_bus.events.submit import RolloutSubmitter, SubmitConfig
from rollout_bus.events.train_data import TrainData
from rollout_bus.lm.tokenizer import EOS_ID
from rollout_bus.trainer.config import RolloutConfig
from rollout_bus.trainer.payloads import ChannelReader, PayloadReader

log = logging.getLogger(__name__)


@dataclass
class ClientConfig:
    policy: str
    trainer_id: str
    group: str
    consumer_index: int = 0
    start_id: str = "$"
    """Where a new group starts: ``$`` (batches from now on) or ``0`` (the whole retained stream)."""
    claim_idle_ms: int = 600_000
    """Entries another consumer of the group held this long are taken over (data-parallel ranks)."""
    block_ms: int = 200
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

    @property
    def batch_id(self) -> str:
        return self.event.batch_id

    @property
    def rollout_id(self) -> int:
        return self.event.rollout_id

    @property
    def request_id(self) -> str:
        return self.event.request_id


class RolloutClient:
    """Requests rollouts for one policy and receives their batches through one consumer group."""

    def __init__(self, client: Redis, keys: Keys, config: ClientConfig, producer: Producer, *,
                 payloads: PayloadReader | None = None, submit_config: SubmitConfig | None = None) -> None:
        self.client = client
        self.keys = keys
        self.config = config
        self.producer = producer
        self.publisher = Publisher(client, keys, producer)
        self.submitter = RolloutSubmitter(client, keys, submit_config, producer=producer)
        self.payloads = payloads or ChannelReader(client, keys)
        self.consumer_name = stable_consumer_name(config.trainer_id, config.consumer_index)
        self.consumer = Consumer(client, keys, keys.batch_stream(config.policy), config.group,
                                 self.consumer_name,
                                 ConsumerConfig(block_ms=config.block_ms, auto_ack=False, start_id=config.start_id,
                                                claim_idle_ms=config.claim_idle_ms))
        self._buffer: OrderedDict[str, ReceivedBatch] = OrderedDict()

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Create the consumer group (before the first request, so no batch is missed) and join."""
        self.consumer.ensure_group()
        self.publisher.publish(self.keys.trainer_stream, TrainerJoined(
            producer=self.producer, policy=self.config.policy, trainer_id=self.config.trainer_id,
            group=self.config.group))

    def stop(self) -> None:
        self._buffer.clear()
        self.payloads.close()

    # --- requests ------------------------------------------------------------------------
    def request_id(self, run_id: str, rollout_id: int, attempt: int = 1) -> str:
        """``<trainer>-<run>-r<rollout>[-a<attempt>]`` (rq job ids take no dots)."""
        suffix = f"-a{attempt}" if attempt > 1 else ""
        return f"{self.config.trainer_id.replace('.', '_')}-{run_id}-r{rollout_id}{suffix}"

    def request(self, rollout_id: int, request_id: str, *, timeout_s: float | None = None,
                returned: list[dict[str, Any]] | None = None) -> RolloutRequest:
        """Queue rollout ``rollout_id`` under ``request_id`` (a repeat is a no-op); ``returned`` gives
        data-source items back (see ``RolloutRequest.returned``)."""
        r = self.config.rollout
        request = RolloutRequest.create(
            self.config.policy, rollout_id, r.n_groups, r.n_samples_per_group,
            timeout_s=timeout_s if timeout_s is not None else r.timeout_s,
            sampling=SamplingParams(temperature=r.temperature, max_new_tokens=r.max_new_tokens,
                                    stop_token_ids=(EOS_ID,)),
            request_id=request_id, data=dict(r.data), std_normalise=r.std_normalise, returned=list(returned or []))
        self.submitter.submit(request)
        return request

    # --- receiving -----------------------------------------------------------------------
    def poll(self, block_ms: int | None = None) -> int:
        """Read what the group has for us into the buffer; returns how many batches came in."""
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
        try:
            data: TrainData | None = self.payloads.fetch(event)
            error = ""
        except (PayloadMissing, DecodeError) as exc:
            log.warning("batch %s: payload unusable: %s", event.batch_id, exc)
            data, error = None, str(exc)
        return ReceivedBatch(msg.id, event, data, msg.deliveries, time.monotonic(), error)

    def buffered(self) -> list[ReceivedBatch]:
        return list(self._buffer.values())

    def take(self, predicate: Any = None) -> ReceivedBatch | None:
        """Remove and return the first buffered batch (that ``predicate`` accepts), if any."""
        for key, batch in self._buffer.items():
            if predicate is None or predicate(batch):
                del self._buffer[key]
                return batch
        return None

    def get(self, rollout_id: int, timeout_s: float, request_id: str | None = None) -> ReceivedBatch:
        """The batch of ``rollout_id`` (of ``request_id`` when given); ``TimeoutError`` after ``timeout_s``."""
        def wanted(b: ReceivedBatch) -> bool:
            return b.rollout_id == rollout_id and (request_id is None or b.request_id == request_id)
        return self._wait(wanted, timeout_s, f"rollout {rollout_id}")

    def next(self, timeout_s: float) -> ReceivedBatch:
        """The first batch to arrive (buffered ones first)."""
        return self._wait(None, timeout_s, "any batch")

    def wait_for(self, rollout_id: int, timeout_s: float) -> bool:
        """Block until the batch of ``rollout_id`` is buffered (without taking it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if any(b.rollout_id == rollout_id for b in self._buffer.values()):
                return True
            if time.monotonic() >= deadline:
                return False
            self.poll()

    def _wait(self, predicate: Any, timeout_s: float, what: str) -> ReceivedBatch:
        deadline = time.monotonic() + timeout_s
        while True:
            batch = self.take(predicate)
            if batch is not None:
                return batch
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no batch for {what} after {timeout_s:.1f}s")
            self.poll()

    # --- acknowledging -------------------------------------------------------------------
    def ack(self, batch: ReceivedBatch, *, staleness: int, accepted: bool) -> None:
        """After the step: ack the entry, announce ``BatchConsumed`` (once per group), release the payload."""
        self.consumer.ack(batch.message_id)
        self.publisher.publish(self.keys.trainer_stream, BatchConsumed(
            producer=self.producer, policy=self.config.policy, batch_id=batch.batch_id,
            trainer_id=self.config.trainer_id, staleness=staleness, accepted=accepted),
            idempotency_key=f"consumed.{self.config.group}.{batch.batch_id}")
        try:
            self.payloads.release(batch.event, self.config.group)
        except Exception as exc:  # ``delete_expired`` removes what is never released
            log.warning("batch %s: payload release failed: %s", batch.batch_id, exc)
