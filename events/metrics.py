"""Shared metrics plumbing: a ``/metrics`` port per role and bus-level gauges read from Redis.

``serve_metrics(port)`` starts prometheus-client's HTTP server for the process (in
multiprocess mode when ``PROMETHEUS_MULTIPROC_DIR`` is set). ``bus_snapshot`` reads one
namespace's streams (XLEN, XINFO GROUPS: lag, pending, consumers), dead letters, rq
queues and registry; ``BusCollector`` turns each scrape into gauges from a fresh
snapshot. Register the collector in one process per namespace (the status exporter,
``rollout-bus status --serve-metrics PORT``), not in every role, or series repeat.
Reading is all it does: it works with the read-only ``status`` ACL user.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

import redis
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from rq import Queue

from rollout_bus.events.connection import Guard, ReconnectPolicy, as_str
from rollout_bus.events.errors import BusError
from rollout_bus.events.names import Keys, logical_stream
from rollout_bus.events.paging import discover_streams
from rollout_bus.events.registry import EngineRecord, PolicyRecord, Registry

log = logging.getLogger(__name__)
LAG_SCAN_CAP = 1_000
PREFIX = "rollout_bus"


def serve_metrics(port: int, *, addr: str = "0.0.0.0",
                  registry: CollectorRegistry | None = None) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``/metrics`` on ``port`` (0: a free one, see ``server.server_port``) from a daemon thread."""
    if registry is None and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    server, thread = start_http_server(port, addr=addr, registry=registry or REGISTRY)
    log.info("serving /metrics on %s:%d", addr, server.server_port)
    return server, thread


# --- snapshot ----------------------------------------------------------------------------------

@dataclass
class GroupStat:
    name: str
    consumers: int
    pending: int
    lag: int | None
    last_delivered_id: str
    lag_estimated: bool = False


@dataclass
class StreamStat:
    stream: str
    key: str
    length: int
    last_id: str
    groups: list[GroupStat] = field(default_factory=list)


@dataclass
class QueueStat:
    name: str
    queued: int
    started: int
    failed: int
    deferred: int
    scheduled: int
    finished: int


@dataclass
class BusSnapshot:
    namespace: str
    streams: list[StreamStat]
    queues: list[QueueStat]
    dead_letters: int
    recent_dead_letters: list[dict[str, str]]
    engines: dict[str, EngineRecord]
    policies: dict[str, PolicyRecord]
    degraded: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Durable writes waiting for their replicas, by writer (``keys.durability_status``)."""
    epoch: str | None = None
    """The namespace's bus epoch (``keys.bus_epoch``); None: not created, or Redis lost it."""


def _group(c: redis.Redis, stream: str, info: dict[str, Any]) -> GroupStat:
    last = as_str(info["last-delivered-id"])
    lag = info.get("lag")
    stat = GroupStat(as_str(info["name"]), int(info["consumers"]), int(info["pending"]),
                     None if lag is None else int(lag), last)
    if stat.lag is None:  # deletions or trims between the group and the tail: count what is left (capped)
        stat.lag = len(c.xrange(stream, min="(" + last, max="+", count=LAG_SCAN_CAP) or [])
        stat.lag_estimated = True
    return stat


def stream_stats(c: redis.Redis, keys: Keys, stream: str) -> StreamStat:
    info = c.xinfo_stream(stream)
    groups = [_group(c, stream, g) for g in c.xinfo_groups(stream)]
    return StreamStat(logical_stream(keys, stream), stream, int(info["length"]), as_str(info["last-generated-id"]),
                      groups)


def queue_stats(c: redis.Redis, name: str) -> QueueStat:
    """Counts of one rq queue, read without rq's cleanup (which writes)."""
    q = Queue(name, connection=c)
    return QueueStat(
        name, q.count, q.started_job_registry.get_job_count(cleanup=False),
        q.failed_job_registry.get_job_count(cleanup=False), q.deferred_job_registry.get_job_count(cleanup=False),
        q.scheduled_job_registry.get_job_count(cleanup=False),
        q.finished_job_registry.get_job_count(cleanup=False))


def _recent_dead_letters(c: redis.Redis, keys: Keys, n: int) -> list[dict[str, str]]:
    out = []
    rows: list[Any] = (c.xrevrange(keys.dead_letters, count=n) or []) if n > 0 else []
    for entry_id, fields in rows:
        row = {"id": as_str(entry_id)}
        for name in ("source", "group", "reason", "deliveries"):
            row[name] = as_str(fields.get(name.encode(), b""))
        out.append(row)
    return out


def bus_snapshot(client: redis.Redis, keys: Keys, *, guard: Guard | None = None,
                 recent_dead_letters: int = 5) -> BusSnapshot:
    """One consistent-enough read of the namespace's streams, queues, dead letters and registry."""
    g = guard or Guard(client, name="bus-snapshot")
    streams = [st for st in discover_streams(client, keys, guard=g) if st != keys.dead_letters]
    registry = Registry(client, keys, guard=g)

    def read(c: redis.Redis) -> tuple[list[StreamStat], list[QueueStat], int, list[dict[str, str]]]:
        return ([stream_stats(c, keys, st) for st in streams],
                [queue_stats(c, q) for q in (keys.rollout_queue, keys.eval_queue)],
                int(c.xlen(keys.dead_letters)), _recent_dead_letters(c, keys, recent_dead_letters))
    stream_rows, queue_rows, dead, recent = g.call(read)
    degraded = g.call(lambda c: _degraded(c.hgetall(keys.durability_status)))
    epoch = g.call(lambda c: c.get(keys.bus_epoch))
    return BusSnapshot(keys.namespace, stream_rows, queue_rows, dead, recent, registry.engines(),
                       registry.policies(), degraded, None if epoch is None else as_str(epoch))


def _degraded(raw: dict[Any, Any]) -> dict[str, dict[str, Any]]:
    """The durability status hash, each value parsed as a JSON object (anything else is shown as text)."""
    out: dict[str, dict[str, Any]] = {}
    for writer, value in raw.items():
        try:
            state = json.loads(value)
        except (ValueError, UnicodeDecodeError):
            state = None
        if isinstance(state, dict) and not isinstance(state.get("since_ms", 0), int | float):
            state["since_ms"] = None  # written by any writer: shown, never trusted as a number
        out[as_str(writer)] = state if isinstance(state, dict) else {"what": repr(value)[:200]}
    return out


# --- collector ---------------------------------------------------------------------------------

class BusCollector(Collector):
    """Bus-level gauges of one namespace, computed at each scrape."""

    def __init__(self, client: redis.Redis, keys: Keys, *, guard: Guard | None = None) -> None:
        self.client = client
        self.keys = keys
        self.guard = guard or Guard(client, ReconnectPolicy(max_wait_s=2.0), name="bus-collector")

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(f"{PREFIX}_redis_up", "1 when the last scrape could read Redis", labels=["namespace"])
        try:
            snap = bus_snapshot(self.client, self.keys, guard=self.guard, recent_dead_letters=0)
        except BusError as exc:
            log.warning("bus metrics: cannot read namespace %s: %s", self.keys.namespace, exc)
            up.add_metric([self.keys.namespace], 0)
            yield up
            return
        up.add_metric([self.keys.namespace], 1)
        yield up
        yield from families(snap)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["namespace", *labels])


def families(snap: BusSnapshot) -> Iterator[Metric]:
    ns = snap.namespace
    length = _gauge("stream_length", "Entries in the stream (XLEN)", ["stream"])
    lag = _gauge("group_lag", "Entries of the stream not yet delivered to the group", ["stream", "group"])
    pending = _gauge("group_pending", "Entries delivered to the group and not acknowledged", ["stream", "group"])
    consumers = _gauge("group_consumers", "Consumers in the group", ["stream", "group"])
    for st in snap.streams:
        length.add_metric([ns, st.stream], st.length)
        for grp in st.groups:
            lag.add_metric([ns, st.stream, grp.name], grp.lag or 0)
            pending.add_metric([ns, st.stream, grp.name], grp.pending)
            consumers.add_metric([ns, st.stream, grp.name], grp.consumers)
    dead = _gauge("dead_letters", "Entries in the dead-letter stream", [])
    dead.add_metric([ns], snap.dead_letters)
    jobs = _gauge("queue_jobs", "rq jobs of a queue by state", ["queue", "state"])
    for q in snap.queues:
        for state in ("queued", "started", "failed", "deferred", "scheduled", "finished"):
            jobs.add_metric([ns, q.name, state], getattr(q, state))
    engines = _gauge("engines", "Engines in the registry by state", ["state"])
    by_state: dict[str, int] = {}
    for rec in snap.engines.values():
        by_state[str(rec.state)] = by_state.get(str(rec.state), 0) + 1
    for state, n in sorted(by_state.items()):
        engines.add_metric([ns, state], n)
    versions = _gauge("policy_version", "Weight version of a policy (published or serving)", ["policy", "kind"])
    for pol in snap.policies.values():
        versions.add_metric([ns, pol.policy, "published"], pol.published)
        versions.add_metric([ns, pol.policy, "serving"], pol.serving)
    engine_versions = _gauge("engine_weight_version", "Weight version an engine has of a policy (registry)",
                             ["engine", "policy"])
    for rec in snap.engines.values():
        for policy, version in sorted(rec.versions.items()):
            engine_versions.add_metric([ns, rec.engine_id, policy], version)
    degraded = _gauge("durable_writes_degraded", "Durable writes waiting for their replicas past their tries", [])
    degraded.add_metric([ns], len(snap.degraded))
    yield from (length, lag, pending, consumers, dead, jobs, engines, versions, engine_versions, degraded)
