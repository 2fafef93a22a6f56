"""The state of a run at any moment, rebuilt as a fold over its event log (faust-style).

``timeline(events, at_ms)`` applies every event up to ``at_ms`` (entry-id time, the bus's
clock) in log order (exact: entry ids, then each producer's ``seq`` within a millisecond) and returns what was true then: each engine's state and weight
versions (with their history), each policy's published and serving versions, every
request and batch with its weight versions and staleness, and each trainer's progress.
The same log gives the same ``Timeline`` whether it is read live from Redis or from an
exported file. ``render`` prints it as plain-text tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_bus.events import schema as s
from rollout_bus.events.registry import EngineState
from rollout_bus.replay.logfile import LogEvent


def version_at(history: Sequence[tuple[int, int]], ms: int) -> int | None:
    """The version in effect at ``ms`` in a ``[(ms, version), ...]`` history, or None before the first."""
    current = None
    for when, version in history:
        if when > ms:
            break
        current = version
    return current


@dataclass
class EngineView:
    engine_id: str
    state: str = "unknown"
    url: str = ""
    since_ms: int = 0
    versions: dict[str, int] = field(default_factory=dict)
    updating: dict[str, int] = field(default_factory=dict)
    offloaded_tags: list[str] = field(default_factory=list)
    restarts: int = 0
    failed_updates: int = 0
    history: list[tuple[int, str]] = field(default_factory=list)
    version_history: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    _before_offload: str = field(default="", repr=False)

    def set_state(self, state: str, ms: int) -> None:
        if state != self.state:
            self.state = state
            self.since_ms = ms
            self.history.append((ms, state))


@dataclass
class PolicyView:
    policy: str
    published: int = -1
    serving: int = -1
    published_history: list[tuple[int, int]] = field(default_factory=list)
    serving_history: list[tuple[int, int]] = field(default_factory=list)
    failed_updates: int = 0


@dataclass
class Consumption:
    trainer_id: str
    staleness: int
    accepted: bool
    ms: int


@dataclass
class BatchView:
    batch_id: str
    policy: str
    rollout_id: int
    request_id: str
    n_samples: int
    min_weight_version: int
    max_weight_version: int
    bytes: int
    entry_id: str
    ready_ms: int
    serving_at_ready: int | None = None
    consumptions: list[Consumption] = field(default_factory=list)

    @property
    def staleness(self) -> int | None:
        """The trainer's staleness at its first consumption, else serving version at ready minus oldest."""
        if self.consumptions:
            return self.consumptions[0].staleness
        if self.serving_at_ready is not None and self.serving_at_ready >= 0:
            return max(0, self.serving_at_ready - self.min_weight_version)
        return None

    @property
    def staleness_source(self) -> str:
        if self.consumptions:
            return "consumed"
        return "serving" if self.staleness is not None else "unknown"


@dataclass
class RequestView:
    request_id: str
    policy: str
    rollout_id: int
    state: str = "requested"
    attempts: int = 0
    requested_ms: int | None = None
    finished_ms: int | None = None
    batch_ids: list[str] = field(default_factory=list)
    reason: str = ""


@dataclass
class TrainerView:
    trainer_id: str
    policy: str
    group: str = ""
    step: int = -1
    weight_version: int = -1
    consumed: int = 0
    rejected: int = 0


@dataclass
class TurnView:
    turn: int
    engine_id: str
    new_tokens: int
    output_tokens: int
    versions: str
    from_journal: bool
    gen_ms: float
    env_ms: float


@dataclass
class SessionView:
    session_id: str
    policy: str
    request_id: str = ""
    status: str = "open"
    reason: str = ""
    attempts: int = 0
    started_ms: int | None = None
    closed_ms: int | None = None
    turns: list[TurnView] = field(default_factory=list)
    reward: float | None = None
    engine_switches: int = 0
    versions: str = ""

    @property
    def engines(self) -> list[str]:
        out: list[str] = []
        for t in self.turns:
            if t.engine_id and (not out or out[-1] != t.engine_id):
                out.append(t.engine_id)
        return out


@dataclass
class ScaleView:
    """One answer to a scale command (``EnginesScaled``): started, then done, failed or refused."""

    ms: int
    policy: str
    requested_by: str
    from_count: int
    to_count: int
    outcome: str
    reason: str = ""
    engine_ids: list[str] = field(default_factory=list)


@dataclass
class Timeline:
    at_ms: int | None = None
    last_id: str | None = None
    events: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    engines: dict[str, EngineView] = field(default_factory=dict)
    policies: dict[str, PolicyView] = field(default_factory=dict)
    batches: dict[str, BatchView] = field(default_factory=dict)
    requests: dict[str, RequestView] = field(default_factory=dict)
    trainers: dict[str, TrainerView] = field(default_factory=dict)
    sessions: dict[str, SessionView] = field(default_factory=dict)
    scalings: list[ScaleView] = field(default_factory=list)

    def session(self, session_id: str, policy: str) -> SessionView:
        return self.sessions.setdefault(session_id, SessionView(session_id, policy))

    def engine(self, engine_id: str) -> EngineView:
        return self.engines.setdefault(engine_id, EngineView(engine_id))

    def policy(self, policy: str) -> PolicyView:
        return self.policies.setdefault(policy, PolicyView(policy))

    def request(self, policy: str, rollout_id: int, request_id: str) -> RequestView:
        return self.requests.setdefault(request_id, RequestView(request_id, policy, rollout_id))

    def trainer(self, trainer_id: str, policy: str) -> TrainerView:
        return self.trainers.setdefault(trainer_id, TrainerView(trainer_id, policy))

    def staleness(self, policy: str | None = None) -> list[int]:
        return [b.staleness for b in self.batches.values()
                if b.staleness is not None and (policy is None or b.policy == policy)]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data, including each batch's derived staleness."""
        out = dataclasses.asdict(self)
        for engine in out["engines"].values():
            engine.pop("_before_offload", None)
        for batch_id, batch in out["batches"].items():
            view = self.batches[batch_id]
            batch["staleness"] = view.staleness
            batch["staleness_source"] = view.staleness_source
        return out


# --- the fold ----------------------------------------------------------------------------------

_ENGINE_STATES: dict[type[s.Event], str] = {
    s.EngineLaunching: EngineState.LAUNCHING, s.EngineReady: EngineState.PENDING_WEIGHTS,
    s.EngineServing: EngineState.SERVING, s.EngineUnhealthy: EngineState.UNHEALTHY,
    s.EngineRestarting: EngineState.RESTARTING, s.EngineStopped: EngineState.STOPPED,
    s.EngineDraining: EngineState.DRAINING,
}


def _engine(t: Timeline, ev: Any, ms: int) -> None:
    engine = t.engine(ev.engine_id)
    if isinstance(ev, s.EngineLaunching | s.EngineReady | s.EngineServing):
        engine.url = ev.url
    if isinstance(ev, s.EngineServing):
        for policy, version in ev.versions.items():
            _set_version(engine, policy, version, ms)
    if isinstance(ev, s.EngineLaunching):  # a new process: versions come with its first weights
        engine.versions = {}
        engine.updating = {}
    if isinstance(ev, s.EngineRestarting):
        engine.restarts += 1
    if isinstance(ev, s.EngineOffloaded):
        if not engine.offloaded_tags:
            engine._before_offload = engine.state
        engine.offloaded_tags = sorted(set(engine.offloaded_tags) | set(ev.tags))
        engine.set_state(EngineState.OFFLOADED, ms)
    elif isinstance(ev, s.EngineOnloaded):
        engine.offloaded_tags = sorted(set(engine.offloaded_tags) - set(ev.tags))
        if not engine.offloaded_tags:
            engine.set_state(engine._before_offload or EngineState.SERVING, ms)
    else:
        engine.offloaded_tags = [] if isinstance(ev, s.EngineStopped | s.EngineLaunching) else engine.offloaded_tags
        engine.set_state(str(_ENGINE_STATES[type(ev)]), ms)


def _set_version(engine: EngineView, policy: str, version: int, ms: int) -> None:
    history = engine.version_history.setdefault(policy, [])
    if engine.versions.get(policy) != version or not history:
        history.append((ms, version))
    engine.versions[policy] = version


def _weights(t: Timeline, ev: Any, ms: int) -> None:
    policy = t.policy(ev.policy)
    if isinstance(ev, s.WeightsPublished):
        policy.published = ev.version
        policy.published_history.append((ms, ev.version))
    elif isinstance(ev, s.WeightVersionServing):
        policy.serving = ev.version
        policy.serving_history.append((ms, ev.version))
    elif isinstance(ev, s.WeightUpdateStarted):
        for engine_id in ev.engine_ids:
            t.engine(engine_id).updating[ev.policy] = ev.version
    elif isinstance(ev, s.WeightsApplied):
        engine = t.engine(ev.engine_id)
        engine.updating.pop(ev.policy, None)
        _set_version(engine, ev.policy, ev.version, ms)
    elif isinstance(ev, s.WeightUpdateFailed):
        if ev.engine_id:  # no engine id: the version was refused or superseded as a whole
            engine = t.engine(ev.engine_id)
            engine.updating.pop(ev.policy, None)
            engine.failed_updates += 1
        policy.failed_updates += 1


def _scaled(t: Timeline, ev: Any, ms: int) -> None:
    t.scalings.append(ScaleView(ms, ev.policy, ev.requested_by, ev.from_count, ev.to_count, ev.outcome, ev.reason,
                                list(ev.engine_ids)))


def _rollout(t: Timeline, ev: Any, ms: int) -> None:
    req = t.request(ev.policy, ev.rollout_id, ev.request_id)
    if isinstance(ev, s.RolloutRequested):
        req.requested_ms = ms
    elif isinstance(ev, s.RolloutStarted):
        req.state = "started"
        req.attempts = max(req.attempts, ev.attempt)
    elif isinstance(ev, s.RolloutCompleted):
        req.state = "completed"
        req.finished_ms = ms
    elif isinstance(ev, s.RolloutFailed):
        req.state = "failed"
        req.finished_ms = ms
        req.attempts = max(req.attempts, ev.attempts)
        req.reason = ev.reason


def _batch(t: Timeline, ev: Any, ms: int, entry_id: str) -> None:
    policy = t.policy(ev.policy)
    t.batches[ev.batch_id] = BatchView(
        ev.batch_id, ev.policy, ev.rollout_id, ev.request_id, ev.n_samples, ev.min_weight_version,
        ev.max_weight_version, ev.bytes, entry_id, ms,
        serving_at_ready=policy.serving if policy.serving_history else None)
    t.request(ev.policy, ev.rollout_id, ev.request_id).batch_ids.append(ev.batch_id)


def _trainer(t: Timeline, ev: Any, ms: int) -> None:
    trainer = t.trainer(ev.trainer_id, ev.policy)
    if isinstance(ev, s.TrainerJoined):
        trainer.group = ev.group
    elif isinstance(ev, s.BatchConsumed):
        if ev.accepted:
            trainer.consumed += 1
        else:
            trainer.rejected += 1
        batch = t.batches.get(ev.batch_id)
        if batch is not None:
            batch.consumptions.append(Consumption(ev.trainer_id, ev.staleness, ev.accepted, ms))
    elif isinstance(ev, s.TrainStepDone):
        trainer.step = ev.step
        trainer.weight_version = ev.weight_version


_FOLDS: dict[type[s.Event], Callable[[Timeline, Any, int], None]] = {
    **{cls: _engine for cls in (*_ENGINE_STATES, s.EngineOffloaded, s.EngineOnloaded)},
    **{cls: _weights for cls in (s.WeightsPublished, s.WeightUpdateStarted, s.WeightsApplied,
                                 s.WeightUpdateFailed, s.WeightVersionServing)},
    **{cls: _rollout for cls in (s.RolloutRequested, s.RolloutStarted, s.RolloutCompleted, s.RolloutFailed)},
    **{cls: _trainer for cls in (s.TrainerJoined, s.BatchConsumed, s.TrainStepDone)},
    s.EnginesScaled: _scaled,
}


def _session(t: Timeline, ev: Any, ms: int) -> None:
    view = t.session(ev.session_id, ev.policy)
    if isinstance(ev, s.SessionStarted):
        view.request_id = ev.request_id or view.request_id
        view.attempts = max(view.attempts, ev.attempt)
        view.started_ms = view.started_ms if view.started_ms is not None else ms
    elif isinstance(ev, s.SessionTurn):
        versions = (str(ev.oldest_version) if ev.oldest_version == ev.newest_version
                    else f"{ev.oldest_version}..{ev.newest_version}")
        view.turns = [turn for turn in view.turns if turn.turn < ev.turn]  # a retried episode replays from 0
        view.turns.append(TurnView(ev.turn, ev.engine_id, ev.new_tokens, ev.output_tokens, versions,
                                   ev.from_journal, ev.gen_ms, ev.env_ms))
    elif isinstance(ev, s.SessionClosed):
        view.status, view.reason, view.closed_ms = ev.status, ev.reason, ms
        view.reward, view.engine_switches = ev.reward, ev.engine_switches
        view.versions = (str(ev.oldest_version) if ev.oldest_version == ev.newest_version
                         else f"{ev.oldest_version}..{ev.newest_version}")
        view.request_id = ev.request_id or view.request_id


_FOLDS.update({cls: _session for cls in (s.SessionStarted, s.SessionTurn, s.SessionClosed)})


def apply(t: Timeline, item: LogEvent) -> None:
    """Fold one event into ``t``."""
    ev = item.event
    t.events += 1
    t.last_id = item.id
    t.counts[ev.type] = t.counts.get(ev.type, 0) + 1
    if isinstance(ev, s.BatchReady):
        _batch(t, ev, item.ms, item.id)
        return
    fold = _FOLDS.get(type(ev))
    if fold is not None:
        fold(t, ev, item.ms)


def timeline(events: Iterable[LogEvent], at_ms: int | None = None) -> Timeline:
    """The state after every event (in entry-id order) up to and including ``at_ms``."""
    t = Timeline(at_ms=at_ms)
    for item in events:
        if at_ms is not None and item.ms > at_ms:
            break
        apply(t, item)
    return t


# --- text ------------------------------------------------------------------------------------

def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain-text table: left-aligned columns, one header line and a rule."""
    cells = [[str(h) for h in headers]] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _versions(versions: dict[str, int]) -> str:
    return ",".join(f"{p}={v}" for p, v in sorted(versions.items())) or "-"


def render(t: Timeline, *, max_batches: int = 20) -> str:
    """The timeline as plain-text tables (the newest ``max_batches`` batches; 0 for all)."""
    when = "end of log" if t.at_ms is None else f"{t.at_ms} ms"
    out = [f"timeline at {when}: {t.events} events, last entry {t.last_id or '-'}"]
    out += ["", "ENGINES", format_table(
        ["engine", "state", "since_ms", "versions", "updating", "restarts", "failed_updates", "url"],
        [[e.engine_id, e.state, e.since_ms, _versions(e.versions), _versions(e.updating), e.restarts,
          e.failed_updates, e.url] for e in sorted(t.engines.values(), key=lambda e: e.engine_id)])]
    out += ["", "POLICIES", format_table(
        ["policy", "published", "serving", "published_history", "serving_history", "failed_updates"],
        [[p.policy, p.published, p.serving, " ".join(str(v) for _, v in p.published_history),
          " ".join(str(v) for _, v in p.serving_history), p.failed_updates]
         for p in sorted(t.policies.values(), key=lambda p: p.policy)])]
    if t.scalings:
        out += ["", "SCALING", format_table(
            ["ms", "policy", "from", "to", "outcome", "requested_by", "engines", "reason"],
            [[c.ms, c.policy, c.from_count, c.to_count, c.outcome, c.requested_by, ",".join(c.engine_ids) or "-",
              c.reason or "-"] for c in t.scalings])]
    states: dict[str, int] = {}
    for r in t.requests.values():
        states[r.state] = states.get(r.state, 0) + 1
    out += ["", "REQUESTS " + (" ".join(f"{k}={v}" for k, v in sorted(states.items())) or "none")]
    batches = sorted(t.batches.values(), key=lambda b: b.ready_ms)
    shown = batches[-max_batches:] if max_batches else batches
    stale = t.staleness()
    summary = f"{len(batches)} batches" + (f", staleness mean {sum(stale) / len(stale):.2f} max {max(stale)}"
                                           if stale else "")
    out += ["", f"BATCHES ({summary}; showing {len(shown)})", format_table(
        ["batch", "policy", "rollout", "samples", "versions", "staleness", "source", "consumed_by"],
        [[b.batch_id, b.policy, b.rollout_id, b.n_samples, f"{b.min_weight_version}..{b.max_weight_version}",
          b.staleness, b.staleness_source, ",".join(c.trainer_id for c in b.consumptions) or "-"]
         for b in shown])]
    if t.sessions:
        shown_sessions = sorted(t.sessions.values(), key=lambda v: v.started_ms or 0)
        shown_sessions = shown_sessions[-max_batches:] if max_batches else shown_sessions
        status_counts: dict[str, int] = {}
        for v in t.sessions.values():
            status_counts[v.status] = status_counts.get(v.status, 0) + 1
        out += ["", f"SESSIONS ({' '.join(f'{k}={n}' for k, n in sorted(status_counts.items()))}; showing "
                    f"{len(shown_sessions)}; turns as engine:new+output, J: from the journal)", format_table(
            ["session", "policy", "status", "attempts", "reward", "versions", "engines", "turns"],
            [[v.session_id, v.policy, v.status, v.attempts, None if v.reward is None else f"{v.reward:.3g}",
              v.versions or "-", ">".join(v.engines) or "-",
              " ".join(f"{'J' if tv.from_journal else tv.engine_id}:{tv.new_tokens}+{tv.output_tokens}"
                       for tv in v.turns) or "-"]
             for v in shown_sessions])]
    out += ["", "TRAINERS", format_table(
        ["trainer", "policy", "group", "step", "weight_version", "consumed", "rejected"],
        [[tr.trainer_id, tr.policy, tr.group, tr.step, tr.weight_version, tr.consumed, tr.rejected]
         for tr in sorted(t.trainers.values(), key=lambda tr: tr.trainer_id)])]
    return "\n".join(out)
