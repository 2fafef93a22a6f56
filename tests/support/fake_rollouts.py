"""Test doubles for trainer tests that need no engines: a fake rollout service on any Redis client.

``FakeRollouts`` answers a trainer the way executors and the controller would, from one
thread: each ``RolloutRequested`` becomes a ``BatchReady`` (through the executor's
``BatchSink``) whose samples carry a weight version ``lag`` versions behind what the
fake engines serve, and each ``WeightsPublished`` is served at once (registry record and
``WeightVersionServing``). It runs on fakeredis as well as on a real server, which is
what makes the mode, staleness and resume logic testable in milliseconds.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollout_bus.events.connection import Guard, Redis
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import stream_entries
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import PolicyRecord, Registry
from rollout_bus.events.rollouts import RolloutRequest
from rollout_bus.events.schema import (
    Producer,
    RolloutRequested,
    WeightsPublished,
    WeightVersionServing,
    decode,
)
from rollout_bus.events.train_data import TrainData, group_normalise, ragged
from rollout_bus.executor.output import BatchSink
from rollout_bus.lm.tokenizer import EOS_ID, encode

log = logging.getLogger(__name__)

VersionFn = Callable[[int, int], int]
"""(rollout id, serving version) -> the weight version stamped on the batch's samples."""


@dataclass
class FakeRollouts:
    client: Redis
    keys: Keys
    policies: tuple[str, ...] = ("default",)
    lag: int = 0
    """Samples carry ``serving - lag`` (at least 0) unless ``version_of`` says otherwise."""
    version_of: VersionFn | None = None
    seed: int = 0
    poll_s: float = 0.005
    serving: dict[str, int] = field(default_factory=dict)
    requests: list[RolloutRequested] = field(default_factory=list)
    batches: list[str] = field(default_factory=list)
    drop_requests: set[int] = field(default_factory=set)
    """Rollout ids whose first request is ignored (a lost rollout: the trainer must ask again)."""
    poison: dict[int, Callable[[TrainData], None]] = field(default_factory=dict)
    """Rollout ids whose first batch is altered in place after it is built (bad values on the wire)."""
    poisoned: list[str] = field(default_factory=list)
    """Batch ids published with ``poison`` applied."""

    def __post_init__(self) -> None:
        self.producer = Producer("fake", "rollouts")
        self.publisher = Publisher(self.client, self.keys, self.producer)
        self.sink = BatchSink(self.client, self.keys, self.publisher)
        self.registry = Registry(self.client, self.keys)
        self.guard = Guard(self.client, name="fake rollouts")
        self._cursors = {self.keys.rollout_stream: "0", **{self.keys.weight_stream(p): "0" for p in self.policies}}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rng = random.Random(self.seed)
        self._dropped: set[int] = set()
        self.errors: list[BaseException] = []

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> FakeRollouts:
        for policy in self.policies:
            self.serving.setdefault(policy, 0)
            self.registry.put_policy(PolicyRecord(policy, published=0, serving=self.serving[policy]))
        self._thread = threading.Thread(target=self._run, name="fake-rollouts", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.sink.close()
        if self.errors:
            raise self.errors[0]

    def __enter__(self) -> FakeRollouts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.pump():
                    self._stop.wait(self.poll_s)
            except BaseException as exc:  # surfaced by stop()
                log.exception("fake rollouts failed")
                self.errors.append(exc)
                return

    def pump(self) -> int:
        """Handle every new request and publication once; returns how many were handled."""
        handled = 0
        for stream, fields in self._read():
            event = decode(fields)
            if stream != self.keys.rollout_stream and isinstance(event, WeightsPublished):
                self._serve(event)
                handled += 1
            elif stream == self.keys.rollout_stream and isinstance(event, RolloutRequested):
                if event.rollout_id in self.drop_requests and event.rollout_id not in self._dropped:
                    self._dropped.add(event.rollout_id)
                    continue
                self.requests.append(event)
                self._rollout(event)
                handled += 1
        return handled

    def _read(self) -> list[tuple[str, Any]]:
        reply: Any = self.guard.call(lambda c: c.xread(dict(self._cursors), count=100))
        out: list[tuple[str, Any]] = []
        for stream, entry_id, fields in stream_entries(reply):
            self._cursors[stream] = entry_id
            out.append((stream, fields))
        return out

    def _serve(self, event: WeightsPublished) -> None:
        if event.version <= self.serving.get(event.policy, -1):
            return
        self.serving[event.policy] = event.version
        self.registry.put_policy(PolicyRecord(event.policy, published=event.version, serving=event.version,
                                              uri=event.uri, sha256=event.sha256))
        self.publisher.publish(self.keys.weight_stream(event.policy), WeightVersionServing(
            producer=self.producer, policy=event.policy, version=event.version, engine_ids=["fake-0"]))

    def _rollout(self, event: RolloutRequested) -> None:
        serving = self.serving.get(event.policy, 0)
        version = (self.version_of(event.rollout_id, serving) if self.version_of is not None
                   else max(0, serving - self.lag))
        data = fake_batch(event.n_groups, event.n_samples_per_group, rollout_id=event.rollout_id,
                          version=version, first_group=event.rollout_id * event.n_groups, rng=self._rng)
        alter = self.poison.pop(event.rollout_id, None)
        if alter is not None:
            alter(data)
        request = RolloutRequest(policy=event.policy, rollout_id=event.rollout_id, n_groups=event.n_groups,
                                 n_samples_per_group=event.n_samples_per_group, request_id=event.request_id)
        self.batches.append(self.sink.publish(request, data))
        if alter is not None:
            self.poisoned.append(self.batches[-1])


def fake_batch(n_groups: int, per_group: int, *, rollout_id: int, version: int, first_group: int = 0,
               rng: random.Random | None = None) -> TrainData:
    """A valid batch of arithmetic-looking samples with random answers and 0/1 rewards."""
    rng = rng or random.Random(0)
    tokens: list[list[int]] = []
    prompts: list[int] = []
    responses: list[int] = []
    raw: list[float] = []
    groups: list[int] = []
    for g in range(n_groups):
        prompt = encode(f"{g % 10}+{rng.randrange(10)}=", add_bos=True)
        for _ in range(per_group):
            response = encode(str(rng.randrange(19))) + [EOS_ID]
            tokens.append(prompt + response)
            prompts.append(len(prompt))
            responses.append(len(response))
            raw.append(float(rng.random() < 0.5))
            groups.append(first_group + g)
    n = len(tokens)
    group_t = torch.tensor(groups, dtype=torch.int64)
    raw_t = torch.tensor(raw, dtype=torch.float32)
    return TrainData(
        tokens=ragged(tokens, torch.int32), loss_masks=ragged([[1] * r for r in responses], torch.int32),
        rollout_log_probs=ragged([[-1.0] * r for r in responses], torch.float32),
        prompt_lengths=torch.tensor(prompts, dtype=torch.int64),
        response_lengths=torch.tensor(responses, dtype=torch.int64),
        rewards=group_normalise(raw_t, group_t), raw_reward=raw_t, truncated=torch.zeros(n, dtype=torch.int32),
        sample_indices=torch.arange(n, dtype=torch.int64), group_indices=group_t,
        rollout_ids=torch.full((n,), rollout_id, dtype=torch.int64),
        weight_versions=torch.full((n,), version, dtype=torch.int64),
        weight_versions_max=torch.full((n,), version, dtype=torch.int64),
        metadata={"data_source": "fake-source", "prompt_indices": sorted(set(groups)),
                  "labels": ["0"] * n_groups})


def shared_init_dir(name: str = "rollout-bus-test-init") -> Path:
    """A per-machine directory for the warm-started test weights (reused while the config matches)."""
    # a cache kept across runs on purpose: in the system's temp directory, not pytest's (see tests/conftest.py)
    return Path(os.environ.get("ROLLOUT_BUS_SYSTEM_TEMP") or tempfile.gettempdir()) / name
