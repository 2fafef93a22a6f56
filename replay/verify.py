"""Invariants of a run, checked over its event log.

- No engine used a version it never received: every version in ``WeightsApplied``,
  ``EngineServing``, ``WeightVersionServing`` and a batch's sample versions (the event's
  min and max, and with ``verify_log`` every sample's from the exported payload) was published
  before (``WeightsPublished``), and every version an engine announced as serving was
  applied to that engine since it was (re)launched. ``base_version`` is the version engines launch with
  (the controller's initial checkpoint); it counts as published and received. Logs of schema
  version 2 events are in exact order (each producer's ``seq`` within a millisecond, see
  ``logfile.producer_order``); in older logs a ``WeightsApplied`` in the same millisecond as the
  ``EngineServing`` it precedes may come after it, and it still counts.
- Every completed request has exactly one batch, and it is the batch it names.
- No version went backwards: per policy published and serving, per engine and policy applied.
- No event lost or doubled: each producer's sequence numbers (``seq``, given out by the bus as it
  appends each event, from 1, and carried on across restarts of the same producer name) have no gap
  (``seq_gap``: events lost) and no repeat (``seq_repeat``: an event appended twice). Gaps can be
  seen only in a log that holds the producers' whole history: one exported whole (every range from
  ``-`` to ``+``) and never trimmed (no ``StreamsTrimmed`` that removed entries). A log of a time
  range is checked from each producer's first number in it; a trimmed one for repeats only. A log of
  chosen streams (``export --stream``) leaves out what producers wrote elsewhere: give it
  ``VerifyConfig(gaps=False)``.

Each ``Violation`` names its kind, the ids involved and the entries (``stream@id``) that
show it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rollout_bus.events import schema as s
from rollout_bus.events.batch import decode
from rollout_bus.events.errors import DecodeError
from rollout_bus.replay.logfile import LogEvent, LogReader, Payload, decode_entries

log = logging.getLogger(__name__)

Kind = Literal["version_not_published", "version_not_received", "version_backwards", "missing_batch",
               "duplicate_batch", "batch_mismatch", "duplicate_completion", "seq_gap", "seq_repeat",
               "session_mismatch", "session_not_closed"]
GAP_EXAMPLES = 20
"""Missing numbers named per producer (the count is always whole)."""


@dataclass(frozen=True)
class Violation:
    kind: Kind
    message: str
    ids: dict[str, Any]
    entries: list[str]

    def __str__(self) -> str:
        return f"{self.kind}: {self.message} [{', '.join(self.entries)}]"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "ids": self.ids, "entries": self.entries}


@dataclass
class VerifyConfig:
    base_version: int | None = 0
    gaps: bool = True
    """Report missing sequence numbers (off for a log of chosen streams)."""
    from_start: bool = True
    """The log starts at the beginning of every stream: each producer's numbers start at 1."""


def _ref(item: LogEvent) -> str:
    return f"{item.stream}@{item.id}"


@dataclass
class _Check:
    config: VerifyConfig
    violations: list[Violation] = field(default_factory=list)
    published: dict[str, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    applied: dict[tuple[str, str], dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    last: dict[tuple[str, ...], tuple[int, str]] = field(default_factory=dict)
    completed: dict[str, list[tuple[str, LogEvent]]] = field(default_factory=lambda: defaultdict(list))
    batches: dict[str, list[tuple[str, LogEvent]]] = field(default_factory=lambda: defaultdict(list))
    sample_versions: dict[tuple[str, str], set[int]] = field(default_factory=dict)
    unreceived: list[tuple[LogEvent, str, str, int]] = field(default_factory=list)
    """(item, engine, policy, version) served but not applied yet: settled when its millisecond is over."""
    numbers: dict[str, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    """producer -> sequence number -> the entry that has it."""
    trimmed: bool = False
    session_samples: dict[tuple[str, str], list[SessionSample]] = field(default_factory=dict)
    """Per exported batch payload: its samples made by agent sessions."""
    sessions_closed: dict[str, tuple[str, LogEvent]] = field(default_factory=dict)
    session_checks: list[tuple[SessionSample, LogEvent]] = field(default_factory=list)

    def add(self, kind: Kind, message: str, ids: dict[str, Any], *entries: str) -> None:
        self.violations.append(Violation(kind, message, ids, list(entries)))

    def is_base(self, version: int) -> bool:
        return self.config.base_version is not None and version == self.config.base_version

    def need_published(self, item: LogEvent, policy: str, version: int, what: str, **ids: Any) -> bool:
        if version in self.published[policy] or self.is_base(version):
            return True
        self.add("version_not_published", f"{what} version {version} of policy {policy!r}, never published",
                 {"policy": policy, "version": version, **ids}, _ref(item))
        return False

    def monotonic(self, key: tuple[str, ...], version: int, item: LogEvent, what: str, ids: dict[str, Any]) -> None:
        prev = self.last.get(key)
        if prev is not None and version < prev[0]:
            self.add("version_backwards", f"{what} went from {prev[0]} back to {version}",
                     {**ids, "version": version, "previous": prev[0]}, prev[1], _ref(item))
        if prev is None or version >= prev[0]:
            self.last[key] = (version, _ref(item))

    def settle(self, before_ms: int | None = None, engine: str | None = None) -> None:
        """Report the served versions still not applied: of milliseconds before ``before_ms`` (None: all),
        of ``engine`` (None: every engine)."""
        keep: list[tuple[LogEvent, str, str, int]] = []
        for item, engine_id, policy, version in self.unreceived:
            if (before_ms is not None and item.ms >= before_ms) or (engine is not None and engine_id != engine):
                keep.append((item, engine_id, policy, version))
            elif version not in self.applied[(engine_id, policy)]:
                self.add("version_not_received",
                         f"engine {engine_id} served version {version} of policy {policy!r}, never applied to it",
                         {"engine_id": engine_id, "policy": policy, "version": version}, _ref(item))
        self.unreceived = keep

    def sequence(self, item: LogEvent) -> None:
        ev = item.event
        if ev.seq <= 0:  # not numbered: schema version 1
            return
        producer = str(ev.producer)
        first = self.numbers[producer].setdefault(ev.seq, _ref(item))
        if first != _ref(item):
            self.add("seq_repeat", f"producer {producer} has event number {ev.seq} twice ({ev.type}): "
                     "an event appended twice, or a producer's numbers started over (Redis lost them)",
                     {"producer": producer, "seq": ev.seq, "type": ev.type}, first, _ref(item))

    def gaps(self) -> None:
        if not self.config.gaps:
            return
        if self.trimmed:
            log.warning("the log's streams were trimmed (StreamsTrimmed): lost events cannot be told from "
                        "trimmed ones; only repeated sequence numbers are checked")
            return
        for producer, numbers in sorted(self.numbers.items()):
            ordered = sorted(numbers)  # gaps from the numbers seen, never from the range they span: a forged
            top = ordered[-1]          # number near 2**64 must not cost a list of that many
            prev = 0 if self.config.from_start else ordered[0] - 1
            lost = 0
            missing: list[int] = []
            around: list[Any] = []
            for n in ordered:
                if n > prev + 1:
                    lost += n - prev - 1
                    missing.extend(range(prev + 1, min(n, prev + 1 + GAP_EXAMPLES - len(missing))))
                    if len(around) < 6:  # each gap's edges
                        around += [numbers[m] for m in (prev, n) if m in numbers]
                prev = n
            if not lost:
                continue
            shown = ", ".join(map(str, missing[:GAP_EXAMPLES])) + (", ..." if lost > len(missing) else "")
            self.add("seq_gap", f"producer {producer} lost {lost} event(s): numbers {shown} of 1..{top} "
                     "are missing", {"producer": producer, "missing": missing[:GAP_EXAMPLES],
                                     "lost": lost, "last": top}, *around[:6])

    def event(self, item: LogEvent) -> None:
        ev = item.event
        if self.unreceived:
            self.settle(item.ms)
        self.sequence(item)
        if isinstance(ev, s.StreamsTrimmed) and any(ev.entries.values()):
            self.trimmed = True
        if isinstance(ev, s.WeightsPublished):
            self.monotonic(("published", ev.policy), ev.version, item, f"published version of {ev.policy!r}",
                           {"policy": ev.policy})
            self.published[ev.policy].setdefault(ev.version, _ref(item))
        elif isinstance(ev, s.WeightsApplied):
            ids = {"engine_id": ev.engine_id}
            self.need_published(item, ev.policy, ev.version, f"engine {ev.engine_id} applied", **ids)
            self.monotonic(("applied", ev.engine_id, ev.policy), ev.version, item,
                           f"version of {ev.policy!r} applied on engine {ev.engine_id}", {"policy": ev.policy, **ids})
            self.applied[(ev.engine_id, ev.policy)].setdefault(ev.version, _ref(item))
        elif isinstance(ev, s.EngineLaunching):  # a new process: it holds only its launch weights
            self.settle(engine=ev.engine_id)  # what the old process served, by what the old process received
            for key in [k for k in self.applied if k[0] == ev.engine_id]:
                del self.applied[key]
        elif isinstance(ev, s.EngineServing):
            for policy, version in sorted(ev.versions.items()):
                what = f"engine {ev.engine_id} served"
                if (self.need_published(item, policy, version, what, engine_id=ev.engine_id)
                        and version not in self.applied[(ev.engine_id, policy)] and not self.is_base(version)):
                    self.unreceived.append((item, ev.engine_id, policy, version))
        elif isinstance(ev, s.WeightVersionServing):
            self.need_published(item, ev.policy, ev.version, "policy announced serving")
            self.monotonic(("serving", ev.policy), ev.version, item, f"serving version of {ev.policy!r}",
                           {"policy": ev.policy})
        elif isinstance(ev, s.BatchReady):
            samples = self.sample_versions.pop((item.stream, item.id), set())
            for version in sorted({ev.min_weight_version, ev.max_weight_version} | samples):
                self.need_published(item, ev.policy, version, f"batch {ev.batch_id} has samples of",
                                    batch_id=ev.batch_id, request_id=ev.request_id)
            self.batches[ev.request_id].append((ev.batch_id, item))
            for sample in self.session_samples.pop((item.stream, item.id), []):
                self.session_checks.append((sample, item))
        elif isinstance(ev, s.SessionClosed):
            self.sessions_closed[ev.session_id] = (ev.digest, item)
        elif isinstance(ev, s.RolloutCompleted):
            self.completed[ev.request_id].append((ev.batch_id, item))

    def sessions(self) -> None:
        """Each agent session's sample is its journal: the digest of the sample's tokens and loss mask in the
        batch equals the one its session closed with (a sample left out of training has an all-zero mask)."""
        for sample, item in self.session_checks:
            closed = self.sessions_closed.get(sample.session_id)
            batch_id = getattr(item.event, "batch_id", "")
            ids = {"session_id": sample.session_id, "batch_id": batch_id}
            if closed is None:
                self.add("session_not_closed", f"batch {batch_id} has a sample of session "
                         f"{sample.session_id}, which never closed", ids, _ref(item))
            elif sample.trained and closed[0] != sample.digest:
                self.add("session_mismatch", f"the sample of session {sample.session_id} in batch "
                         f"{batch_id} is not its journal (digest {sample.digest}, the session closed "
                         f"with {closed[0]})", ids, _ref(item), _ref(closed[1]))

    def finish(self) -> list[Violation]:
        self.settle()
        self.gaps()
        self.sessions()
        for request_id, batches in self.batches.items():
            if len(batches) > 1:
                ids = sorted({b for b, _ in batches})
                self.add("duplicate_batch", f"request {request_id} has {len(batches)} batches: {', '.join(ids)}",
                         {"request_id": request_id, "batch_ids": ids}, *(_ref(i) for _, i in batches))
        for request_id, completions in self.completed.items():
            refs = [_ref(i) for _, i in completions]
            if len(completions) > 1:
                self.add("duplicate_completion", f"request {request_id} completed {len(completions)} times",
                         {"request_id": request_id}, *refs)
            batches = self.batches.get(request_id, [])
            named = completions[0][0]
            if not batches:
                self.add("missing_batch", f"request {request_id} completed with batch {named}, which never appeared",
                         {"request_id": request_id, "batch_id": named}, *refs)
            elif len(batches) == 1 and batches[0][0] != named:
                self.add("batch_mismatch",
                         f"request {request_id} completed naming batch {named}, but its batch is {batches[0][0]}",
                         {"request_id": request_id, "batch_id": named, "actual_batch_id": batches[0][0]},
                         *refs, _ref(batches[0][1]))
        return self.violations


def verify(events: Iterable[LogEvent], config: VerifyConfig | None = None) -> list[Violation]:
    """Every violation in ``events`` (in entry-id order), in the order found."""
    check = _Check(config or VerifyConfig())
    for item in events:
        check.event(item)
    return check.finish()


@dataclass(frozen=True)
class SessionSample:
    session_id: str
    digest: str
    trained: bool


def session_samples(data: bytes | memoryview) -> list[SessionSample]:
    """The samples of an encoded batch that agent sessions made, with the digest of their tokens and mask."""
    from rollout_bus.events.train_data import TrainData
    from rollout_bus.gateway.tito import digest

    batch = decode(bytearray(data), verify=False)
    records = batch.meta.get("sessions") if isinstance(batch.meta, dict) else None
    if not records:
        return []
    data_ = TrainData.from_batch(batch)
    by_index = {int(i): k for k, i in enumerate(data_.sample_indices.tolist())}
    out = []
    for record in records:
        k = by_index.get(int(record.get("index", -1)))
        sid = record.get("session_id")
        if k is None or not isinstance(sid, str) or "turn" in record:  # one turn's sample: not the whole journal
            continue
        view = data_.sample(k)
        mask = [int(m) for m in view.loss_mask.tolist()]
        ids = [int(t) for t in view.tokens.tolist()]
        out.append(SessionSample(sid, digest(ids, [0] * int(view.prompt_length) + mask), any(mask)))
    return out


def sample_versions(data: bytes | memoryview) -> set[int]:
    """Every weight version the samples of an encoded batch (``events.batch``) report."""
    batch = decode(bytearray(data), verify=False)
    found: set[int] = set()
    for name in ("weight_versions", "weight_versions_max"):
        if name in batch.tensors:
            found.update(int(v) for v in batch.tensors[name].tolist())
    return found


def verify_log(path: str | Path, config: VerifyConfig | None = None, *, samples: bool = True,
               allow_truncated: bool = False) -> list[Violation]:
    """``verify`` over a log file; with ``samples``, each exported batch's per-sample versions count too.
    A log of a time range (any range not ``-`` to ``+``) is checked for gaps from each producer's first
    number in it."""
    with LogReader(path, allow_truncated=allow_truncated) as reader:
        config = config or VerifyConfig()
        if any(r.start != "-" or r.end != "+" for r in reader.header.ranges):
            config = dataclasses.replace(config, from_start=False)
        check = _Check(config)
        for record in reader:
            if isinstance(record, Payload):
                if samples:
                    try:
                        check.sample_versions[(record.stream, record.entry_id)] = sample_versions(record.data)
                        found = session_samples(record.data)
                        if found:
                            check.session_samples[(record.stream, record.entry_id)] = found
                    except DecodeError as exc:
                        log.warning("batch %s: payload not readable (%s): only its event's versions are checked",
                                    record.batch_id, exc.reason)
                continue
            for item in decode_entries([record]):
                check.event(item)
    return check.finish()
