"""Reading back what the trainer's metric loggers wrote: JSONL lines, TensorBoard events, a W&B offline run.

TensorBoard files are read with ``tensorboard``'s own ``EventAccumulator``. wandb keeps no
Python reader of its run files any more, so ``wandb_history`` reads the ``.wandb`` file
(the LevelDB log format: 32 KiB blocks of chunks with a 7-byte header, after wandb's own
7-byte file header) and parses each record with wandb's protobuf ``Record``.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_WANDB_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)


def jsonl_steps(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tensorboard_run(directory: Path) -> Any:
    """An ``EventAccumulator`` with every scalar and histogram of the run loaded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def _wandb_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    if not data.startswith(_WANDB_HEADER):
        raise ValueError(f"{path}: not a wandb run file")
    records, parts, pos = [], [], len(_WANDB_HEADER)
    while pos + 7 <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < 7:  # the tail of a block too short for a header is padding
            pos += left_in_block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if (kind == 0 and length == 0) or pos + 7 + length > len(data):  # padding, or a chunk still being written
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            records.append(chunk)
        elif kind == _FIRST:
            parts = [chunk]
        elif kind == _MIDDLE:
            parts.append(chunk)
        elif kind == _LAST:
            records.append(b"".join([*parts, chunk]))
            parts = []
        else:
            raise ValueError(f"{path}: chunk type {kind} at byte {pos}")
    return records


def wandb_history(run_dir: Path, timeout_s: float = 10.0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run's (name, project, group, id) and its history rows (key -> value, ``_step`` included).

    wandb's service process writes the file; this waits (up to ``timeout_s``) for its
    closing ``exit`` record.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        records = []
        for raw in _wandb_records(path):
            record = pb.Record()
            record.ParseFromString(raw)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    run: dict[str, Any] = {}
    rows = []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = {"name": record.run.display_name, "project": record.run.project, "group": record.run.run_group,
                   "id": record.run.run_id}
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                *outer, last = [item.key] if item.key else list(item.nested_key)
                place = row
                for part in outer:  # a logged object (a histogram) comes as one item per field
                    place = place.setdefault(part, {})
                place[last] = json.loads(item.value_json)
            rows.append(row)
    return run, rows
