"""Show a rollout-bus namespace: engines, policies, rq queues, streams, consumer lag, dead letters.

    rollout-bus status [--redis-url URL] [--namespace NS] [--json] [--watch SECONDS]
    rollout-bus status --redis-url A,B,C          # a sharded run: each shard's Redis in turn
    rollout-bus status --serve-metrics 9100      # Prometheus exporter of the bus gauges
    rollout-bus status --check-weights [--engine ID]...   # engines' weights against the published ones

Reads only (works with the read-only ``status`` ACL user), except ``--check-weights``, which sends the
controller a ``CheckWeights`` command (``rollout_bus.check_weights``). ``REDIS_URL`` and
``ROLLOUT_BUS_NAMESPACE`` are the defaults of ``--redis-url`` and ``--namespace``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from rollout_bus.events.names import name_arg

if TYPE_CHECKING:
    from rollout_bus.events.metrics import BusSnapshot

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollout-bus status", description=__doc__.split("\n\n")[0])
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="redis:// or rediss:// URL (default $REDIS_URL, else redis://127.0.0.1:6379/0); a sharded "
                        "run's urls A,B,C show each shard")
    p.add_argument("--namespace", default=os.environ.get("ROLLOUT_BUS_NAMESPACE", "default"), type=name_arg("namespace"),
                   help="rollout-bus namespace (default $ROLLOUT_BUS_NAMESPACE or 'default')")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until interrupted")
    p.add_argument("--serve-metrics", type=int, metavar="PORT",
                   help="serve the bus gauges on PORT at /metrics until stopped (no output)")
    p.add_argument("--dead-letters", type=int, default=5, metavar="N", help="show the last N dead letters")
    p.add_argument("--check-weights", action="store_true",
                   help="ask the controller to compare each engine's weights digest with the published one and "
                        "print the answers (exit 1 on a mismatch; needs a user that may send commands)")
    p.add_argument("--engine", action="append", type=name_arg("engine id"), metavar="ID",
                   help="with --check-weights: check only this engine (repeat for more)")
    p.add_argument("--check-timeout-s", type=float, default=60.0, metavar="S",
                   help="with --check-weights: how long to wait for the controller's answer (default 60)")
    args = p.parse_args(argv)
    if args.engine and not args.check_weights:
        p.error("--engine goes with --check-weights")
    if args.check_weights and (args.watch is not None or args.serve_metrics is not None):
        p.error("--check-weights runs once: not with --watch or --serve-metrics")
    if args.watch is not None and args.watch <= 0:
        p.error("--watch must be > 0")
    from rollout_bus.launch.shards import split_urls

    try:
        args.urls = split_urls(args.redis_url) if args.redis_url else [None]
    except ValueError as exc:
        p.error(str(exc))
    if len(args.urls) > 1 and (args.check_weights or args.serve_metrics is not None):
        p.error("--check-weights and --serve-metrics take one Redis url: run them once per shard")
    return args


def redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _versions(versions: dict[str, int]) -> str:
    return ",".join(f"{p}={v}" for p, v in sorted(versions.items())) or "-"


def render(snap: BusSnapshot, *, now_ms: int | None = None) -> str:
    """The snapshot as plain-text tables."""
    from rollout_bus.replay.timeline import format_table

    now = now_ms if now_ms is not None else time.time_ns() // 1_000_000
    out = [f"namespace {snap.namespace}", "", "ENGINES", format_table(
        ["engine", "state", "backend", "versions", "updating", "load", "offloaded", "age_s", "url"],
        [[e.engine_id, str(e.state), e.backend, _versions(e.versions), _versions(e.updating), e.load,
          ",".join(e.offloaded_tags) or "-", f"{max(0, now - e.updated_ms) / 1000:.1f}", e.url]
         for e in sorted(snap.engines.values(), key=lambda e: e.engine_id)])]
    out += ["", "POLICIES", format_table(
        ["policy", "published", "serving", "uri"],
        [[p.policy, p.published, p.serving, p.uri or "-"]
         for p in sorted(snap.policies.values(), key=lambda p: p.policy)])]
    out += ["", "QUEUES", format_table(
        ["queue", "queued", "started", "failed", "deferred", "scheduled", "finished"],
        [[q.name, q.queued, q.started, q.failed, q.deferred, q.scheduled, q.finished] for q in snap.queues])]
    rows: list[list[Any]] = []
    for st in snap.streams:
        if not st.groups:
            rows.append([st.stream, st.length, st.last_id, "-", "-", "-", "-"])
        for g in st.groups:
            lag = f"{g.lag}{'~' if g.lag_estimated else ''}"
            rows.append([st.stream, st.length, st.last_id, g.name, g.consumers, g.pending, lag])
    out += ["", "STREAMS", format_table(["stream", "length", "last_id", "group", "consumers", "pending", "lag"],
                                        rows)]
    if snap.degraded:
        out += ["", "DURABILITY DEGRADED (writes waiting for their replicas)", format_table(
            ["writer", "write", "acked", "waiting_s", "bound_s"],
            [[w, d.get("what", "?"), f"{d.get('acked', '?')}/{d.get('replicas', '?')}",
              f"{max(0, now - int(d.get('since_ms') or now)) / 1000:.1f}", d.get("bound_s", "?")]
             for w, d in sorted(snap.degraded.items())])]
    out += ["", f"DEAD LETTERS {snap.dead_letters}"]
    if snap.recent_dead_letters:
        out.append(format_table(["id", "source", "group", "deliveries", "reason"],
                                [[d["id"], d["source"], d["group"], d["deliveries"], d["reason"]]
                                 for d in snap.recent_dead_letters]))
    return "\n".join(out)


def as_json(snap: BusSnapshot) -> str:
    return json.dumps(dataclasses.asdict(snap), sort_keys=True, default=str)


def serve(args: argparse.Namespace) -> int:
    from prometheus_client import REGISTRY

    from rollout_bus.events.connection import connect
    from rollout_bus.events.metrics import BusCollector, serve_metrics
    from rollout_bus.events.names import Keys

    REGISTRY.register(BusCollector(connect(args.redis_url), Keys(args.namespace)))
    server, _ = serve_metrics(args.serve_metrics)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log.info("bus metrics of namespace %s on :%d/metrics", args.namespace, server.server_port)
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    server.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.serve_metrics is not None:
        return serve(args)
    from rollout_bus.events.connection import connect, redis_url
    from rollout_bus.events.errors import BusError
    from rollout_bus.events.metrics import bus_snapshot
    from rollout_bus.events.names import Keys

    keys = Keys(args.namespace)
    if len(args.urls) > 1:
        return _shards(args, keys)
    client = connect(args.redis_url)
    if args.check_weights:
        from rollout_bus.check_weights import ask
        from rollout_bus.check_weights import render as render_checks

        try:
            code, answers = ask(client, keys, args.engine, args.check_timeout_s)
        except BusError as exc:
            print(f"cannot reach {redacted(redis_url(args.redis_url))}: {exc}", file=sys.stderr)
            return 2
        finally:
            client.close()
        if answers:
            print(json.dumps([dataclasses.asdict(a) for a in answers], default=str) if args.json
                  else render_checks(answers), flush=True)
        return code
    try:
        while True:
            try:
                snap = bus_snapshot(client, keys, recent_dead_letters=args.dead_letters)
            except BusError as exc:
                print(f"cannot read {redacted(redis_url(args.redis_url))}: {exc}", file=sys.stderr)
                if args.watch is None:
                    return 2
            else:
                text = as_json(snap) if args.json else render(snap)
                if args.watch is not None and sys.stdout.isatty():
                    sys.stdout.write("\x1b[2J\x1b[H")
                print(text, flush=True)
            if args.watch is None:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def _shards(args: argparse.Namespace, keys: Any) -> int:
    """Each shard's snapshot in turn (``--json``: one document, ``{"shards": [...]}``); a shard that does not
    answer is named with the reason and the others are shown. Exit 2 when one could not be read."""
    from rollout_bus.events.connection import UNREACHABLE, Guard, ReconnectPolicy, probe_client, redis_url
    from rollout_bus.events.errors import BusError
    from rollout_bus.events.metrics import bus_snapshot

    unread: tuple[type[BaseException], ...] = (BusError, ValueError, *UNREACHABLE)
    clients: dict[int, Any] = {}
    try:
        while True:
            docs: list[dict[str, Any]] = []
            texts: list[str] = []
            for i, url in enumerate(args.urls):
                where = redacted(redis_url(url))
                try:
                    if i not in clients:  # made here: a Sentinel shard asks its sentinels first, and may fail
                        clients[i] = probe_client(redis_url(url), timeout_s=2.0)
                    client = clients[i]
                    snap = bus_snapshot(client, keys, recent_dead_letters=args.dead_letters,
                                        guard=Guard(client, ReconnectPolicy(max_wait_s=2.0), name=f"shard {i}"))
                except unread as exc:
                    docs.append({"shard": i, "url": where, "error": str(exc)})
                    texts.append(f"== shard {i} ({where}): cannot read: {exc}")
                else:
                    docs.append({"shard": i, "url": where, "snapshot": dataclasses.asdict(snap)})
                    texts.append(f"== shard {i} ({where})\n{render(snap)}")
            if args.watch is not None and sys.stdout.isatty():
                sys.stdout.write("\x1b[2J\x1b[H")
            print(json.dumps({"shards": docs}, sort_keys=True, default=str) if args.json else "\n\n".join(texts),
                  flush=True)
            if args.watch is None:
                return 2 if any("error" in d for d in docs) else 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        for made in clients.values():
            made.close()


if __name__ == "__main__":
    sys.exit(main())
