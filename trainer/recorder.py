"""A passive subscriber: reads one policy's batches in a consumer group of its own and records them.

It sits beside the policy's trainer and never affects it: its group sees every batch
(fan-out), and the trainer's acks do not touch it. Each batch goes to
``<out>/<batch_id>.safetensors`` (the wire tensors, with the ``BatchReady`` event and the
batch metadata as JSON in the safetensors metadata) and one line of ``<out>/index.jsonl``,
written before the ack, so a restarted recorder never loses a batch (a batch recorded
twice is the same file, and ``read_recording`` returns each id once).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rollout_bus.events.batch import Ragged
from rollout_bus.events.connection import Redis
from rollout_bus.events.consume import Consumer, ConsumerConfig, Message, stable_consumer_name
from rollout_bus.events.errors import DecodeError, PayloadMissing, PayloadTooLarge
from rollout_bus.events.names import Keys
from rollout_bus.events.schema import BatchReady
from rollout_bus.events.train_data import TrainData
from rollout_bus.trainer.payloads import ChannelReader, PayloadReader

log = logging.getLogger(__name__)

INDEX_FILE = "index.jsonl"


@dataclass
class RecorderConfig:
    policy: str
    out_dir: str
    name: str = "recorder"
    """The consumer group (and consumer name prefix)."""
    start_id: str = "0"
    """A new group starts at the oldest retained batch (``0``) or at new ones only (``$``)."""
    block_ms: int = 500


class Recorder:
    """Writes every batch of ``policy`` to ``out_dir``; explicit ``start`` / ``run`` / ``stop``."""

    def __init__(self, client: Redis, keys: Keys, config: RecorderConfig,
                 payloads: PayloadReader | None = None) -> None:
        self.config = config
        self.keys = keys
        self.out = Path(config.out_dir)
        self.payloads = payloads or ChannelReader(client, keys)
        self.consumer = Consumer(client, keys, keys.batch_stream(config.policy), config.name,
                                 stable_consumer_name(config.name),
                                 ConsumerConfig(block_ms=config.block_ms, start_id=config.start_id,
                                                auto_ack=True))
        self.recorded = 0
        self._stop = threading.Event()

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.consumer.ensure_group()

    def run(self, max_batches: int | None = None) -> int:
        """Record until ``stop`` (or ``max_batches`` recorded); returns how many were recorded."""
        while not self._stop.is_set() and (max_batches is None or self.recorded < max_batches):
            self.consumer.process(self.record)
        return self.recorded

    def drain(self) -> int:
        """Record what is there now and return (tests, offline export)."""
        self.consumer.run_until_idle(self.record)
        return self.recorded

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.payloads.close()

    def record(self, msg: Message) -> None:
        event = msg.event
        if not isinstance(event, BatchReady):
            log.warning("%s is a %s, not a batch: skipped", msg.id, event.type)
            return
        try:
            data = self.payloads.fetch(event)
        except (PayloadMissing, DecodeError, PayloadTooLarge) as exc:
            log.warning("batch %s not recorded: %s", event.batch_id, exc)
            self._append_index({"batch_id": event.batch_id, "entry_id": msg.id, "error": str(exc)})
            return
        fields, meta = data.to_tensors()
        tensors: dict[str, torch.Tensor] = {}
        for name, value in fields.items():
            if isinstance(value, Ragged):
                tensors[f"{name}.values"] = value.values.contiguous()
                tensors[f"{name}.offsets"] = value.offsets.contiguous()
            else:
                tensors[name] = value.contiguous()
        path = self.out / f"{event.batch_id}.safetensors"
        if not event.batch_id or path.resolve().parent != self.out.resolve():  # decode checks ids; never trust twice
            log.warning("batch id %r cannot name a file in %s: not recorded", event.batch_id, self.out)
            return
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp),
                  metadata={"event": json.dumps(event.to_dict()), "meta": json.dumps(meta, default=str)})
        os.replace(tmp, path)
        self._append_index({"batch_id": event.batch_id, "entry_id": msg.id, "rollout_id": event.rollout_id,
                            "request_id": event.request_id, "n_samples": event.n_samples,
                            "file": path.name})
        self.payloads.release(event, self.config.name)
        self.recorded += 1

    def _append_index(self, row: dict[str, Any]) -> None:
        with (self.out / INDEX_FILE).open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_recording(out_dir: str | os.PathLike[str]) -> Iterator[tuple[dict[str, Any], TrainData]]:
    """Every recorded batch once, in recording order: (BatchReady as a dict, its TrainData)."""
    out = Path(out_dir)
    index = out / INDEX_FILE
    if not index.is_file():
        return
    seen: set[str] = set()
    for line in index.read_text().splitlines():
        row = json.loads(line)
        if "file" not in row or row["batch_id"] in seen:
            continue
        seen.add(row["batch_id"])
        path = out / row["file"]
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        fields: dict[str, torch.Tensor | Ragged] = {}
        for name, t in tensors.items():
            if name.endswith(".values"):
                base = name.removesuffix(".values")
                fields[base] = Ragged(t, tensors[base + ".offsets"])
            elif not name.endswith(".offsets"):
                fields[name] = t
        yield json.loads(metadata.get("event", "{}")), TrainData.from_tensors(
            fields, json.loads(metadata.get("meta", "{}")))
