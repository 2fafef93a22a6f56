"""A worker told to stop does not wait on its pubsub thread: rq unsubscribes before it stops that thread, and a
thread that loops once more after the unsubscribe waits, unsubscribed, up to rq's 60 s sleep for a subscription
that never comes. redis-py's ``stop`` joins it with no limit, so an executor sat there until its supervisor's
SIGKILL (``executor-0 did not stop in 10s``, at the end of most runs)."""

from __future__ import annotations

import threading
import time

import fakeredis
from rq.serializers import JSONSerializer

from rollout_bus.executor.worker import PUBSUB_STOP_S, ExecutorWorker, ReliableQueue


def test_a_stopping_worker_leaves_a_pubsub_thread_that_waits_for_a_subscription_behind() -> None:
    client = fakeredis.FakeRedis()
    queue = ReliableQueue("rb.t.rollouts", connection=client, serializer=JSONSerializer)
    worker = ExecutorWorker([queue], name="w-stop", connection=client, heartbeat_ttl_s=10,
                            heartbeat_interval_s=1.0, worker_ttl_s=30)
    worker.subscribe()
    pubsub, thread = worker.pubsub, worker.pubsub_thread
    assert pubsub is not None and thread is not None and thread.is_alive()
    # the state that hung: unsubscribed, the thread looping on, now waiting (60 s) for a subscription
    pubsub.unsubscribe()
    deadline = time.monotonic() + 10
    while pubsub.subscribed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not pubsub.subscribed and thread.is_alive()
    stopper = threading.Thread(target=worker.unsubscribe, daemon=True)
    stopper.start()
    stopper.join(10 * PUBSUB_STOP_S)
    assert not stopper.is_alive(), "unsubscribe still waits on the pubsub thread"
