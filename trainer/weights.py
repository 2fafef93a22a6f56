"""Publishing new weights: a version directory with its manifest, then ``WeightsPublished``.

A version is ``<weights_root>/<policy>/v<version:06d>/`` in the format of ``lm.files``: the
tiny LM's ``config.json`` + ``model.safetensors``; a Hugging Face model's ``save_pretrained``
output (sharded with an index past ``max_shard_size``, the tokenizer beside it when given); or
a ``PeftModel``'s LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``: the
controller serves that policy as an adapter on the base pool). ``manifest.json`` lists every
file's size and sha256; the event's ``sha256`` is the manifest's. The directory is written
under a temporary name and renamed, so a partial version is never visible. A published version
is immutable: the rename never replaces a directory (``lm.files.rename_noreplace``); saving it
again with the same bytes changes nothing, with other bytes is an error. With the trainer's
``lease`` the rename happens only after the server confirmed the lease, and the event is
bound to it (``events.leased``). A directory of a version never announced (its writer crashed,
or was deposed, between the rename and ``WeightsPublished``) is moved aside by the lease holder
before it writes its own. The event's
idempotency key is ``weights.<policy>.<version>``, so publishing a version again after a
restart never adds a second event, unless the controller refused it for good (it then drops the key,
and the version may be announced again once the cause is fixed). ``wait_serving`` then waits until the controller
announces ``WeightVersionServing`` for that version or a newer one (or the registry says
so), up to a timeout.

Old versions are deleted only once the controller is done with them: a version older
than the one it announced serving (``WeightVersionServing``, or the policy record), or one
it gave up on (``WeightUpdateFailed`` for every engine: refused, stale or superseded). A
version it may still be verifying or pushing stays on disk whatever ``keep_versions`` says,
so a push never fails for a file the trainer deleted.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from rollout_bus.events.connection import Guard, Redis
from rollout_bus.events.names import Keys, publication_key
from rollout_bus.events.paging import stream_entries
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import Registry
from rollout_bus.events.schema import (
    Producer,
    WeightsPublished,
    WeightUpdateFailed,
    WeightVersionServing,
    decode,
)
from rollout_bus.lm.files import read_manifest, rename_noreplace, version_dir, write_weights_dir
from rollout_bus.lm.hf import save_pretrained
from rollout_bus.lm.model import TinyLM, save_weights
from rollout_bus.trainer.broadcast import WeightSender
from rollout_bus.trainer.lease import PolicyLease

log = logging.getLogger(__name__)


@dataclass
class Published:
    version: int
    uri: str
    sha256: str
    entry_id: str
    save_ms: float


class ServingTimeout(TimeoutError):
    """The engines did not serve a published version in time."""


class WeightPublisher:
    """Saves and announces the weight versions of one policy."""

    def __init__(self, client: Redis, keys: Keys, policy: str, weights_root: str | Path, producer: Producer,
                 *, keep_versions: int = 4, lease: PolicyLease | None = None,
                 sender: WeightSender | None = None) -> None:
        self.client = client
        self.sender = sender
        """With ``--weight-sync broadcast``: every saved version of full weights is also offered by collective."""
        self.lease = lease
        """The trainer's policy lease: every version directory and ``WeightsPublished`` is bound to it."""
        self.keys = keys
        self.policy = policy
        self.root = Path(weights_root)
        self.keep_versions = keep_versions
        self.publisher = Publisher(client, keys, producer)
        self.registry = Registry(client, keys)
        self.guard = Guard(client, name=f"weights {policy}")
        self._published: list[int] = []
        self._saved: tuple[int, str] | None = None
        """The version this process last saved and its sha256, so announcing it does not hash the file again."""
        self._settled_cursor = "0"
        self._served = -1
        self._given_up: set[int] = set()

    def adopt(self, current: int) -> None:
        """Take over the versions on disk up to ``current`` (after a restart), so pruning goes on."""
        directory = self.root / self.policy
        found = sorted(int(p.name[1:]) for p in directory.glob("v[0-9]*") if p.name[1:].isdigit()) \
            if directory.is_dir() else []
        self._published = [v for v in found if v <= current]
        self._prune()

    def save(self, model: Any, version: int, *, tokenizer: Any = None,
             max_shard_size: str | int | None = None) -> tuple[Path, str]:
        """Write version ``version`` of ``model`` (a ``TinyLM``, a Hugging Face model, or a ``PeftModel``
        whose adapter is written); return its directory and the sha256 of its manifest."""
        if isinstance(model, TinyLM):
            saved = self.save_dir(version, lambda tmp: save_weights(model, tmp))
        else:
            saved = self.save_dir(version, lambda tmp: save_pretrained(tmp, model, tokenizer,
                                                                       max_shard_size=max_shard_size))
        if self.sender is not None:
            self.sender.offer(version, model, saved[0])
        return saved

    def save_dir(self, version: int, fill: Callable[[Path], object]) -> tuple[Path, str]:
        """Write version ``version`` with ``fill(tmp)`` (any layout of ``lm.files``), atomically, with its
        manifest; return the directory and the manifest's sha256.

        Renamed in only while the lease holds, never over an existing directory: saving a version again
        with the same bytes is a no-op, with other bytes ``FileExistsError`` (a deposed writer); a
        directory of a version never announced is moved aside first (see the module docstring)."""
        directory = version_dir(self.root, self.policy, version)
        if directory.exists() and not self._announced(version):
            self._set_aside(directory)
        digest = write_weights_dir(directory, fill, same_ok=True, before_rename=self._verify_lease,
                                   policy=self.policy, version=version)
        self._saved = (version, digest)
        return directory, digest

    def _verify_lease(self) -> None:
        if self.lease is not None:
            self.lease.verify()

    def _announced(self, version: int) -> bool:
        """Whether ``version`` was announced: its ``WeightsPublished`` dedupe key, or the controller's record."""
        if self.publisher.entry_for(self.keys.weight_stream(self.policy), self._publish_key(version)) is not None:
            return True
        return self.published_version() >= version

    def _set_aside(self, directory: Path) -> None:
        """Move away the directory of a version nobody announced (only the lease holder may announce it)."""
        self._verify_lease()
        aside = directory.with_name(f".{directory.name}.{uuid.uuid4().hex[:8]}.unannounced")
        log.warning("%s was never announced (its writer stopped before WeightsPublished): moved aside to write "
                    "this version again", directory)
        rename_noreplace(directory, aside)
        shutil.rmtree(aside, ignore_errors=True)

    def _publish_key(self, version: int) -> str:
        return publication_key(self.policy, version)

    def publish(self, model: Any | None, version: int, *, tokenizer: Any = None,
                max_shard_size: str | int | None = None) -> Published:
        """Save (unless ``model`` is None: the directory is already there) and announce ``version``.

        With ``model`` None the sha256 is the one ``save`` computed for ``version`` in this
        process, else (after a restart) it is read from the directory's manifest.
        """
        started = time.perf_counter()
        directory = version_dir(self.root, self.policy, version)
        if model is not None:
            directory, digest = self.save(model, version, tokenizer=tokenizer, max_shard_size=max_shard_size)
        elif self._saved is not None and self._saved[0] == version:
            digest = self._saved[1]
        else:
            digest = read_manifest(directory)[1]
        save_ms = (time.perf_counter() - started) * 1000
        uri = str(directory.resolve())
        offer: dict[str, Any] = {}
        if self.sender is not None and self.sender.offered(version):
            offer = {"group_address": self.sender.address, "group_backend": self.sender.backend,
                     "buckets": self.sender.plan(version)}
        event = WeightsPublished(producer=self.publisher.producer, policy=self.policy, version=version,
                                 uri=uri, sha256=digest, **offer)
        entry_id = self.publisher.publish(self.keys.weight_stream(self.policy), event, idempotency_key=self._publish_key(version),
                                          durable=True, lease=self.lease.fence if self.lease is not None else None)
        if self.sender is not None:
            self.sender.published(version, entry_id)
        log.debug("published %s v%d (%s)", self.policy, version, entry_id)
        self._published.append(version)
        self._prune()
        return Published(version, uri, digest, entry_id, save_ms)

    def serving_version(self) -> int:
        """The version every serving engine runs: the policy record, else the engines' own reports."""
        record = self.registry.policy(self.policy)
        if record is not None and record.serving >= 0:
            return record.serving
        engines = self.registry.serving(self.policy)
        return min(e.versions[self.policy] for e in engines) if engines else -1

    def wait_engines(self, timeout_s: float) -> None:
        """Until some engine serves (any policy): before that, what a policy serves is not known yet."""
        deadline = time.monotonic() + timeout_s
        while not any(e.state == "serving" for e in self.registry.engines().values()):
            if self.registry.policy(self.policy) is not None:
                return  # a policy record (written by the controller) answers on its own
            if time.monotonic() > deadline:
                raise ServingTimeout(f"no engine serves after {timeout_s:.1f}s")
            time.sleep(0.05)

    def published_version(self) -> int:
        record = self.registry.policy(self.policy)
        return record.published if record is not None else -1

    def wait_serving(self, version: int, timeout_s: float, after_id: str = "0") -> float:
        """Block until ``version`` (or newer) is served; returns the seconds waited.

        Follows the weight stream from ``after_id``; the registry is checked first and on
        every quiet second, so an announcement made before the wait began is not missed.
        """
        started = time.monotonic()
        deadline = started + timeout_s
        cursor = after_id
        while True:
            if self.serving_version() >= version:
                return time.monotonic() - started
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServingTimeout(f"{self.policy} v{version} not served after {timeout_s:.1f}s "
                                     f"(serving v{self.serving_version()})")
            block_ms = max(1, int(min(remaining, 1.0) * 1000))
            reply: Any = self.guard.call(partial(_xread, stream=self.keys.weight_stream(self.policy), after=cursor,
                                                 block_ms=block_ms))
            for _, entry_id, fields in stream_entries(reply):
                cursor = entry_id
                try:
                    event = decode(fields)
                except Exception:
                    continue
                if isinstance(event, WeightVersionServing) and event.policy == self.policy \
                        and event.version >= version:
                    return time.monotonic() - started
                if isinstance(event, WeightUpdateFailed) and event.policy == self.policy \
                        and event.version == version:
                    log.warning("%s v%d failed on engine %s: %s", self.policy, version, event.engine_id,
                                event.reason)

    def _follow_settled(self) -> None:
        """Fold what the controller settled since the last look: the served version, versions given up."""
        while True:
            reply: Any = self.guard.call(partial(_xread, stream=self.keys.weight_stream(self.policy), after=self._settled_cursor,
                                                 block_ms=0, count=500))
            entries = stream_entries(reply)
            for _, entry_id, fields in entries:
                self._settled_cursor = entry_id
                try:
                    event = decode(fields)
                except Exception:
                    continue
                if getattr(event, "policy", None) != self.policy:
                    continue
                if isinstance(event, WeightVersionServing):
                    self._served = max(self._served, event.version)
                elif isinstance(event, WeightUpdateFailed) and not event.engine_id:
                    self._given_up.add(event.version)
            if len(entries) < 500:
                break
        record = self.registry.policy(self.policy)
        if record is not None:
            self._served = max(self._served, record.serving)

    def _prune(self) -> None:
        """Delete versions beyond the newest ``keep_versions`` that the controller is done with."""
        if self.keep_versions <= 0 or len(self._published) <= self.keep_versions:
            return
        self._follow_settled()
        newest = set(sorted(self._published)[-self.keep_versions:])
        for old in sorted(self._published):
            if old in newest or old == self._served:
                continue
            if old < self._served or old in self._given_up:
                self._published.remove(old)
                shutil.rmtree(version_dir(self.root, self.policy, old), ignore_errors=True)


def _xread(c: Redis, *, stream: str, after: str, block_ms: int, count: int = 64) -> Any:
    return c.xread({stream: after}, count=count, block=block_ms if block_ms > 0 else None)

