"""Which rq jobs an executor resolves: only the rollout job and its failure callback, checked without importing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.callbacks import Callback
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from rollout_bus.events.submit import FAILURE_CALLBACK, JOB_FUNC
from rollout_bus.executor.errors import ForbiddenJob
from rollout_bus.executor.rqjob import RolloutJob, refusal
from rollout_bus.executor.worker import Reaper, ReliableQueue

HOSTILE = "tests.support.hostile_job"


def queue(client: redis.Redis) -> Queue:
    return ReliableQueue("rb.t.rollouts", connection=client, serializer=JSONSerializer)


def test_only_the_rollout_job_with_its_failure_callback_is_resolved(fake_client: redis.Redis) -> None:
    q = queue(fake_client)
    good = q.enqueue_call(JOB_FUNC, kwargs={"request": {}}, on_failure=Callback(FAILURE_CALLBACK))
    assert refusal(RolloutJob.fetch(good.id, connection=fake_client, serializer=JSONSerializer)) is None
    cases = {
        "names 'os.system'": q.enqueue_call("os.system", args=["true"]),
        f"names '{HOSTILE}.run'": q.enqueue_call(f"{HOSTILE}.run"),
        "as its success callback": q.enqueue_call(JOB_FUNC, on_success=Callback(f"{HOSTILE}.run")),
        "as its failure callback": q.enqueue_call(JOB_FUNC, on_failure=Callback("os.system")),
        "as its stopped callback": q.enqueue_call(JOB_FUNC, on_stopped=Callback("os.system")),
    }
    for reason, job in cases.items():
        fetched = RolloutJob.fetch(job.id, connection=fake_client, serializer=JSONSerializer)
        assert reason in (refusal(fetched) or "")
        with pytest.raises(ForbiddenJob, match=reason):
            fetched.func  # noqa: B018 - the property is what rq calls
        assert fetched.failure_callback is None and fetched.success_callback is None
        assert fetched.stopped_callback is None
    assert HOSTILE not in sys.modules


def test_a_job_whose_data_cannot_be_read_is_refused_not_crashed(fake_client: redis.Redis) -> None:
    job = queue(fake_client).enqueue_call(JOB_FUNC, kwargs={"request": {}})
    fake_client.hset(job.key, "data", b"\xff not json")
    fetched = RolloutJob.fetch(job.id, connection=fake_client, serializer=JSONSerializer)
    assert "its data cannot be read" in (refusal(fetched) or "")
    with pytest.raises(ForbiddenJob):
        fetched.func  # noqa: B018


def test_the_reaper_never_runs_the_failure_callback_an_abandoned_foreign_job_names(
        fake_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"
    monkeypatch.setenv("ROLLOUT_BUS_TEST_MARKER", str(marker))
    q = queue(fake_client)
    job = q.enqueue_call("os.getcwd", on_failure=Callback(f"{HOSTILE}.run"))
    job.set_status(JobStatus.STARTED)
    fake_client.zadd(q.started_job_registry.key, {f"{job.id}:exec": 0})  # its executor died long ago
    Reaper(fake_client, [q], name="r", interval_s=1).reap_once()
    assert RolloutJob.fetch(job.id, connection=fake_client, serializer=JSONSerializer).get_status() == JobStatus.FAILED
    assert not marker.exists() and HOSTILE not in sys.modules
