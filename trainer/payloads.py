"""Reading a batch's claim-checked payload as ``TrainData`` (zero-copy torch tensors).

A thin layer over ``events.batches.BatchChannel``: ``fetch`` decodes the payload the
``BatchReady`` points to (tensors share the fetched buffer), ``release`` tells the
channel this consumer group is done with it (while ``lease`` holds, when given), and the last
group to release deletes it.
"""

from __future__ import annotations

from typing import Protocol

from rollout_bus.events.batch import DEFAULT_MAX_BYTES
from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.connection import Redis
from rollout_bus.events.leased import LeaseFence
from rollout_bus.events.names import Keys
from rollout_bus.events.schema import BatchReady
from rollout_bus.events.train_data import TrainData


class PayloadReader(Protocol):
    def fetch(self, event: BatchReady) -> TrainData: ...

    def release(self, event: BatchReady, group: str, *, lease: LeaseFence | None = None) -> None: ...

    def close(self) -> None: ...


class ChannelReader:
    """``PayloadReader`` over a ``BatchChannel``."""

    def __init__(self, client: Redis, keys: Keys, channel: BatchChannel | None = None, *,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.channel = channel or BatchChannel(client, keys, max_bytes=max_bytes)

    def fetch(self, event: BatchReady) -> TrainData:
        return TrainData.from_batch(self.channel.fetch(event))

    def release(self, event: BatchReady, group: str, *, lease: LeaseFence | None = None) -> None:
        self.channel.release(event, group, lease=lease)

    def close(self) -> None:
        self.channel.close()
