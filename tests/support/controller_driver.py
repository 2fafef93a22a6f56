"""Helpers for driving a controller from tests, benchmarks and demos.

Writing a new weights version next to a model (a perturbed copy, written with
``safetensors.numpy`` so no torch is needed, as a version directory with its manifest),
publishing ``WeightsPublished`` the way a trainer does, and reading the controller's event
streams back.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from rollout_bus.events.connection import Redis, as_str
from rollout_bus.events.groups import parse_id
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import weight_streams
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import Event, Producer, WeightsPublished, decode
from rollout_bus.lm.files import CONFIG_FILE, WEIGHTS_FILE, write_weights_dir


def write_version(base_dir: Path, out_dir: Path, *, seed: int, scale: float = 0.05,
                  shape_change: bool = False) -> tuple[Path, str]:
    """A copy of the weights in ``base_dir`` with noise added; returns (directory, manifest sha256).

    ``out_dir`` is ``<root>/<policy>/v<version>``: the manifest names that policy and version.
    ``shape_change`` drops the last row of every 2-d tensor: weights that must be refused.
    """
    import numpy as np
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(base_dir / WEIGHTS_FILE))
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        noisy = value + rng.normal(0.0, scale, value.shape).astype(value.dtype)
        if shape_change and noisy.ndim == 2:
            noisy = noisy[:-1]
        out[name] = np.ascontiguousarray(noisy)

    def fill(tmp: Path) -> None:
        shutil.copyfile(base_dir / CONFIG_FILE, tmp / CONFIG_FILE)
        save_file(out, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})

    version = int(out_dir.name[1:]) if out_dir.name[1:].isdigit() else None
    return out_dir, write_weights_dir(out_dir, fill, replace=True, policy=out_dir.parent.name, version=version)


def publish_weights(client: Redis, keys: Keys, policy: str, version: int, uri: str, sha256: str,
                    trainer: str = "test", *, stream: str | None = None) -> WeightsPublished:
    """``WeightsPublished`` on ``stream`` (default: the policy's weight stream, where its trainer publishes)."""
    event = WeightsPublished(producer=Producer("trainer", trainer), policy=policy, version=version, uri=uri,
                             sha256=sha256)
    Publisher(client, keys, event.producer).publish(stream or keys.weight_stream(policy), event)
    return event


def read_events(client: Redis, stream: str) -> list[Event]:
    return [decode(fields) for _id, fields in client.xrange(stream) or []]


def weight_events(client: Redis, keys: Keys) -> list[Event]:
    """The events of every weight stream of ``keys`` (each policy's and the legacy one), in entry id order."""
    entries = [(parse_id(as_str(i)), f) for stream in weight_streams(client, keys) for i, f in client.xrange(stream)]
    return [decode(f) for _, f in sorted(entries, key=lambda e: e[0])]


def find(events: list[Event], cls: type[Event], **match: object) -> list[Event]:
    return [e for e in events if isinstance(e, cls) and all(getattr(e, k) == v for k, v in match.items())]


def wait_until(what: str, cond: Callable[[], object], timeout_s: float = 30.0, every_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


async def wait_until_async(what: str, cond: Callable[[], object], timeout_s: float = 30.0,
                           every_s: float = 0.05) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(every_s)
