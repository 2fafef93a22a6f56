"""One picture of a run over time, as data: engine lanes, versions served, batches, restarts, dead letters.

``picture(entries)`` folds a log's raw entries (a file's ``LogReader.entries()`` or
``exporter.read_live``: the same entries give the same ``Picture``) through the timeline
fold (``replay.timeline``) and keeps what a picture of the run needs:

- a lane per engine: its states as spans, and per policy the weight version it had, as
  spans (a span ends when the engine relaunches or stops);
- each policy's published and serving versions;
- every batch at the time it was ready, with its staleness (``BatchView.staleness``) and
  whether a trainer trained it;
- restarts: engine relaunches (``EngineRestarting``) and trainer restarts (a trainer that
  joins again);
- dead letters, with their source stream, group and reason (read from the dead-letter
  stream, which the timeline itself skips).

``replay.picture_html`` and ``replay.picture_png`` draw it; both embed nothing but this data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rollout_bus.events import schema as s
from rollout_bus.events.registry import EngineState
from rollout_bus.replay.logfile import LogEntry, decode_entries
from rollout_bus.replay.timeline import Timeline, apply

DEAD_LETTERS = "dead-letters"
_MAX_TEXT = 200  # dead-letter fields are untrusted: shown, cut short


@dataclass
class Span:
    start_ms: int
    end_ms: int
    value: str


@dataclass
class Lane:
    engine_id: str
    states: list[Span] = field(default_factory=list)
    versions: dict[str, list[Span]] = field(default_factory=dict)
    """Per policy: the weight version the engine had, as spans labelled with the version."""


@dataclass
class BatchMark:
    ms: int
    batch_id: str
    policy: str
    rollout_id: int
    n_samples: int
    staleness: int | None
    staleness_source: str
    trained: bool | None
    """True when the first trainer to take it trained it, False when it did not, None when nobody took it."""


@dataclass
class Mark:
    ms: int
    kind: str
    """``engine`` or ``trainer`` for restarts, the source stream for dead letters."""
    subject: str
    detail: str


@dataclass
class Picture:
    start_ms: int = 0
    end_ms: int = 0
    lanes: list[Lane] = field(default_factory=list)
    published: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    serving: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    batches: list[BatchMark] = field(default_factory=list)
    restarts: list[Mark] = field(default_factory=list)
    dead_letters: list[Mark] = field(default_factory=list)
    scalings: list[Mark] = field(default_factory=list)
    """Each answer to a scale command (``EnginesScaled``): subject the pool, detail from, to, outcome, who asked."""
    steps: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Per trainer: (ms, step) of each ``TrainStepDone``."""
    turns: list[Mark] = field(default_factory=list)
    """Agent session turns (``SessionTurn``): kind ``engine`` or ``journal``, subject the session, detail the turn."""
    sessions_closed: list[Mark] = field(default_factory=list)
    """Agent sessions ending (``SessionClosed``): kind their status."""
    events: int = 0

    def counts(self) -> str:
        """``"2 engines, 115 batches, 1 restart, 2 dead letters"``."""
        def n(count: int, one: str, many: str) -> str:
            return f"{count} {one if count == 1 else many}"
        return ", ".join([n(len(self.lanes), "engine", "engines"), n(len(self.batches), "batch", "batches"),
                          n(len(self.restarts), "restart", "restarts"),
                          n(len(self.dead_letters), "dead letter", "dead letters")])

    @property
    def policies(self) -> list[str]:
        return sorted({*self.published, *self.serving, *(b.policy for b in self.batches)})

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (tuples as lists)."""
        out: dict[str, Any] = dataclasses.asdict(self)
        for name in ("published", "serving", "steps"):
            out[name] = {k: [list(p) for p in v] for k, v in out[name].items()}
        return out


def _text(fields: dict[bytes, bytes], name: str) -> str:
    raw = fields.get(name.encode(), b"")
    return (raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw))[:_MAX_TEXT]


def _dead_letter(entry: LogEntry) -> Mark:
    f = entry.fields
    group, deliveries = _text(f, "group"), _text(f, "deliveries")
    detail = _text(f, "reason") + (f" (group {group}, {deliveries} deliveries)" if group else "")
    return Mark(entry.sort_key[0], _text(f, "source") or "?", _text(f, "entry_id"), detail)


def _spans(points: list[tuple[int, str | None]], end_ms: int) -> list[Span]:
    """Spans from ``(ms, value)`` change points; a None value ends the span before it."""
    spans: list[Span] = []
    for i, (ms, value) in enumerate(points):
        if value is None:
            continue
        until = points[i + 1][0] if i + 1 < len(points) else end_ms
        spans.append(Span(ms, max(until, ms), value))
    return spans


def _lane(t: Timeline, engine_id: str, end_ms: int) -> Lane:
    view = t.engines[engine_id]
    lane = Lane(engine_id, states=_spans([(ms, state) for ms, state in view.history], end_ms))
    # a relaunch or a stop ends what the old process had
    gone = [(ms, None) for ms, state in view.history if state in (EngineState.LAUNCHING, EngineState.STOPPED)]
    for policy, history in sorted(view.version_history.items()):
        points: list[tuple[int, str | None]] = sorted([*((ms, str(v)) for ms, v in history), *gone],
                                                      key=lambda p: (p[0], p[1] is not None))
        lane.versions[policy] = _spans(points, end_ms)
    return lane


def picture(entries: Iterable[LogEntry]) -> Picture:
    """The picture of every entry, in log order."""
    t = Timeline()
    pic = Picture()
    joined: set[str] = set()
    first: int | None = None
    last = 0
    for entry in entries:
        ms = entry.sort_key[0]
        first = ms if first is None else first
        last = max(last, ms)
        if entry.stream == DEAD_LETTERS:
            pic.dead_letters.append(_dead_letter(entry))
            continue
        for item in decode_entries([entry]):
            apply(t, item)
            ev = item.event
            if isinstance(ev, s.EngineRestarting):
                pic.restarts.append(Mark(ms, "engine", ev.engine_id, f"relaunch, attempt {ev.attempt}"))
            elif isinstance(ev, s.TrainerJoined):
                if ev.trainer_id in joined:
                    pic.restarts.append(Mark(ms, "trainer", ev.trainer_id, f"joined {ev.group} again"))
                joined.add(ev.trainer_id)
            elif isinstance(ev, s.EnginesScaled):
                reason = f": {ev.reason}" if ev.reason else ""
                pic.scalings.append(Mark(ms, "scale", ev.policy, f"{ev.from_count} -> {ev.to_count} engines, "
                                                                 f"{ev.outcome}, asked by {ev.requested_by}{reason}"))
            elif isinstance(ev, s.TrainStepDone):
                pic.steps.setdefault(ev.trainer_id, []).append((ms, ev.step))
            elif isinstance(ev, s.SessionTurn):
                versions = (str(ev.oldest_version) if ev.oldest_version == ev.newest_version
                            else f"{ev.oldest_version}..{ev.newest_version}")
                pic.turns.append(Mark(ms, "journal" if ev.from_journal else "engine", ev.session_id,
                                      f"turn {ev.turn} on {ev.engine_id}: {ev.new_tokens} tokens in, "
                                      f"{ev.output_tokens} out ({ev.cached_tokens} cached), version {versions}"))
            elif isinstance(ev, s.SessionClosed):
                pic.sessions_closed.append(Mark(ms, ev.status, ev.session_id,
                                                f"{ev.status} after {ev.turns} turns, reward {ev.reward:g}"
                                                + (f": {ev.reason}" if ev.reason else "")))
    pic.start_ms, pic.end_ms, pic.events = first or 0, last, t.events
    # an engine id seen only in weight events (a superseded update names none) is no engine's lane
    pic.lanes = [_lane(t, e, last) for e in sorted(t.engines) if t.engines[e].history]
    for name, view in sorted(t.policies.items()):
        pic.published[name] = list(view.published_history)
        pic.serving[name] = list(view.serving_history)
    for b in sorted(t.batches.values(), key=lambda b: (b.ready_ms, b.entry_id)):
        trained = b.consumptions[0].accepted if b.consumptions else None
        pic.batches.append(BatchMark(b.ready_ms, b.batch_id, b.policy, b.rollout_id, b.n_samples, b.staleness,
                                     b.staleness_source, trained))
    return pic
