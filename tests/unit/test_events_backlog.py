"""The executors' backlog as the autoscaler reads it from rq's keys; what Redis says about ages is not trusted."""

from __future__ import annotations

import redis
from rq.job import Job

from rollout_bus.events.backlog import read_backlog
from rollout_bus.events.names import Keys

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def queue(client: redis.Redis, name: str, *jobs: tuple[str, bytes | None]) -> None:
    for job_id, enqueued_at in jobs:
        client.rpush(f"rq:queue:{name}", job_id)
        if enqueued_at is not None:
            client.hset(Job.key_for(job_id), "enqueued_at", enqueued_at)


def test_depth_and_the_oldest_head_over_both_queues(fake_client: redis.Redis) -> None:
    keys = Keys("bl-1")
    queue(fake_client, keys.rollout_queue, ("a", b"2027-01-15T07:59:50.000000Z"), ("b", b"2027-01-15T07:59:59.000000Z"))
    queue(fake_client, keys.eval_queue, ("c", b"2027-01-15T07:59:30.500000Z"))
    backlog = read_backlog(fake_client, keys, now_s=NOW)
    assert backlog.depth == 3
    assert abs(backlog.oldest_age_s - 29.5) < 1e-6  # the eval queue's head waited longest
    assert backlog.busy == 0


def test_an_empty_namespace_has_no_backlog(fake_client: redis.Redis) -> None:
    backlog = read_backlog(fake_client, Keys("bl-2"), now_s=NOW)
    assert (backlog.depth, backlog.oldest_age_s, backlog.busy) == (0, 0.0, 0)


def test_garbage_missing_or_future_times_count_as_age_zero_but_the_jobs_still_count(fake_client: redis.Redis) -> None:
    keys = Keys("bl-3")
    queue(fake_client, keys.rollout_queue, ("x", b"\xff\xfe not a time"))
    queue(fake_client, keys.eval_queue, ("y", b"2099-01-01T00:00:00Z"))
    assert read_backlog(fake_client, keys, now_s=NOW).oldest_age_s == 0.0
    assert read_backlog(fake_client, keys, now_s=NOW).depth == 2
    other = Keys("bl-4")
    queue(fake_client, other.rollout_queue, ("z", None))  # a job id whose hash is gone
    assert (read_backlog(fake_client, other, now_s=NOW).depth, read_backlog(fake_client, other, now_s=NOW).oldest_age_s) == (1, 0.0)
