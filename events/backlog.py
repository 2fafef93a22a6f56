"""The executors' backlog as an autoscaler reads it: jobs waiting, the oldest one's age, jobs running.

One read of the namespace's rq queues (``keys.rollout_queue`` and ``keys.eval_queue``, the queues every
executor takes from): ``LLEN`` of each (rq's ``Queue.count``), the head job's ``enqueued_at`` (rq pops from
the head, so the head has waited longest; ``at_front`` jobs jump the line and read younger, which only
delays an age trigger), and the count of each started registry without rq's cleanup (which writes).
The ``enqueued_at`` read from Redis is not trusted: a value that does not parse, or lies in the future,
reads as age 0 (the depth still counts).

``publish_scaling`` writes an ``ExecutorsScaled`` decision on ``keys.scaling_stream``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from rq import Queue
from rq.job import Job

from rollout_bus.events.connection import Guard, Redis, as_str
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import ExecutorsScaled

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backlog:
    depth: int
    """Jobs waiting, over the queues."""
    oldest_age_s: float
    """The longest wait of a job at a queue's head (0 when none waits)."""
    busy: int
    """Jobs started and not finished (the started registries)."""


def _age_s(raw: object, now_s: float) -> float:
    if raw is None:
        return 0.0
    try:
        text = as_str(raw)
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (ValueError, UnicodeDecodeError):
        log.warning("a queued job's enqueued_at %r is not a time: its age counts as 0", str(raw)[:80])
        return 0.0
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    age = now_s - when.timestamp()
    return age if math.isfinite(age) and age > 0 else 0.0


def read_backlog(client: Redis, keys: Keys, *, now_s: float | None = None, guard: Guard | None = None) -> Backlog:
    """The backlog of ``keys``' rq queues; ``now_s``: wall-clock seconds the ages are measured at (default now)."""
    g = guard or Guard(client, name="backlog")
    names = (keys.rollout_queue, keys.eval_queue)

    def read(c: Redis) -> tuple[list[int], list[object], list[int]]:
        queues = [Queue(name, connection=c) for name in names]
        with c.pipeline(transaction=False) as pipe:
            for q in queues:
                pipe.llen(q.key)
                pipe.lindex(q.key, 0)
            replies = pipe.execute()
        depths = [int(replies[2 * i]) for i in range(len(queues))]
        heads = [replies[2 * i + 1] for i in range(len(queues))]
        enqueued: list[object] = []
        for head in heads:
            enqueued.append(None if head is None else c.hget(Job.key_for(as_str(head)), "enqueued_at"))
        busy = [q.started_job_registry.get_job_count(cleanup=False) for q in queues]
        return depths, enqueued, busy

    depths, enqueued, busy = g.call(read)
    now = time.time() if now_s is None else now_s
    return Backlog(sum(depths), max((_age_s(raw, now) for raw in enqueued), default=0.0), sum(busy))


def publish_scaling(publisher: Publisher, keys: Keys, event: ExecutorsScaled) -> str:
    """``event`` on ``keys.scaling_stream``; the entry id."""
    return publisher.publish(keys.scaling_stream, event)


__all__ = ["Backlog", "publish_scaling", "read_backlog"]
