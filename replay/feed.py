"""Recorded batches for offline retraining, in the log's order, deterministically.

``feed_batches(path)`` yields ``(batch_id, fields, meta)`` for every ``BatchReady`` of the
log whose payload was exported, in stream order (the order the trainer's consumer group
read them), so two passes over one file give the same batches in the same order.
``fields`` are the batch's tensors and ragged fields by name and ``meta`` its metadata, as
``events.batch.decode`` gives them (``TrainData.from_tensors(fields, meta)`` rebuilds train
data); ``meta["batch_ready"]`` adds the event's fields and where its entry was.
``trained_batch_ids(path)`` lists the batches a trainer of the log accepted
(``BatchConsumed`` with ``accepted``), in the order it consumed them; pass them as ``only``
to feed just the batches the live run trained.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Generator
from pathlib import Path
from typing import Any

import torch

from rollout_bus.events.batch import Ragged, decode
from rollout_bus.events.schema import BatchConsumed, BatchReady
from rollout_bus.replay.logfile import LogEntry, LogReader, Payload, is_batch_ready

log = logging.getLogger(__name__)

Fields = dict[str, torch.Tensor | Ragged]


def _event_meta(event: BatchReady, entry: LogEntry) -> dict[str, Any]:
    return {"policy": event.policy, "batch_id": event.batch_id, "rollout_id": event.rollout_id,
            "request_id": event.request_id, "n_samples": event.n_samples,
            "min_weight_version": event.min_weight_version, "max_weight_version": event.max_weight_version,
            "event_id": event.event_id, "ts_ms": event.ts_ms, "stream": entry.stream, "entry_id": entry.id}


def feed_batches(path: str | Path, *, policy: str | None = None, verify: bool = True,
                 allow_truncated: bool = False,
                 only: Container[str] | None = None) -> Generator[tuple[str, Fields, dict[str, Any]], None, None]:
    """Every recorded batch of ``path`` (of ``policy`` when given; among ``only`` when given)
    as ``(batch_id, fields, meta)``."""
    with LogReader(path, allow_truncated=allow_truncated) as reader:
        pending: dict[tuple[str, str], Payload] = {}
        for record in reader:
            if isinstance(record, Payload):
                pending[(record.stream, record.entry_id)] = record
                continue
            payload = pending.pop((record.stream, record.id), None)
            event = is_batch_ready(record)
            if event is None or (policy is not None and event.policy != policy):
                continue
            if only is not None and event.batch_id not in only:
                continue
            if payload is None:
                log.warning("batch %s (%s %s) has no payload in the log: skipped", event.batch_id, record.stream,
                            record.id)
                continue
            batch = decode(bytearray(payload.data), verify=verify)
            fields: Fields = {**batch.tensors, **batch.ragged}
            yield event.batch_id, fields, {**batch.meta, "batch_ready": _event_meta(event, record)}


def trained_batch_ids(path: str | Path, *, policy: str | None = None, trainer_id: str | None = None,
                      allow_truncated: bool = False) -> list[str]:
    """Ids of the batches a trainer accepted (``BatchConsumed.accepted``), first consumption first, once each."""
    seen: dict[str, None] = {}
    with LogReader(path, allow_truncated=allow_truncated) as reader:
        for item in reader.events():
            ev = item.event
            if not isinstance(ev, BatchConsumed) or not ev.accepted:
                continue
            if (policy is not None and ev.policy != policy) or (trainer_id is not None and ev.trainer_id != trainer_id):
                continue
            seen.setdefault(ev.batch_id, None)
    return list(seen)
