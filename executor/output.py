"""Where a rollout's train data goes: one claim-checked batch per request on the policy's stream.

The batch id comes from the request id and ``BatchChannel`` publishes ``BatchReady`` with it
as the idempotency key, so a retried or duplicated job never yields a second batch.
"""

from __future__ import annotations

import logging

from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.connection import Guard, Redis
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import make_store
from rollout_bus.events.publish import Publisher
from rollout_bus.events.rollouts import RolloutRequest
from rollout_bus.events.schema import BatchReady
from rollout_bus.events.train_data import TrainData

log = logging.getLogger(__name__)


class BatchSink:
    """Publishes each request's batch through a ``BatchChannel`` on the configured payload store."""

    def __init__(self, client: Redis, keys: Keys, publisher: Publisher, *, store: str = "redis") -> None:
        self.keys = keys
        self.guard = Guard(client, name="batch sink")
        self.channel = BatchChannel(client, keys, make_store(store, client, keys), publisher, guard=self.guard)

    def published(self, request: RolloutRequest) -> bool:
        """Whether the request's batch is already out (an earlier attempt published it)."""
        dedupe = self.keys.dedupe(self.keys.batch_stream(request.policy), request.batch_id)
        return bool(self.guard.call(lambda c: c.exists(dedupe)))

    def publish(self, request: RolloutRequest, data: TrainData) -> str:
        """Publish the request's one batch (idempotent by batch id); returns the batch id."""
        fields, meta = data.to_tensors()
        n = len(data)
        self.channel.publish(
            request.policy, request.batch_id, fields, meta, rollout_id=request.rollout_id,
            request_id=request.request_id, n_samples=n,
            min_weight_version=int(data.weight_versions.min()) if n else -1,
            max_weight_version=int(data.weight_versions_max.max()) if n else -1)
        return request.batch_id

    def close(self) -> None:
        self.channel.close()


def read_batch(client: Redis, keys: Keys, event: BatchReady) -> TrainData:
    """The train data a ``BatchReady`` points to (for tools and tests; trainers use their channel)."""
    channel = BatchChannel(client, keys)
    try:
        return TrainData.from_batch(channel.fetch(event))
    finally:
        channel.close()
