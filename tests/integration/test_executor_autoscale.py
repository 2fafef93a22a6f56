"""Autoscaled executors under a burst: a real redis-server, real executor processes, real rq jobs.

The run's fleet (``launch.job.executor_fleet``: the backlog read from the queues, decisions published on the
scaling stream) grows from one executor to three on a burst of held jobs, then shrinks after the jobs it does
not need finish. The executor it retires first still holds a job: it gets its SIGTERM while busy, finishes
the job (one attempt, no retry) and only then exits.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from rq.job import JobStatus

from rollout_bus.events.backlog import read_backlog
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.rollouts import RolloutRequest
from rollout_bus.events.schema import ExecutorsScaled, RolloutCompleted, RolloutStarted, decode
from rollout_bus.events.submit import RolloutSubmitter
from rollout_bus.launch.autoscale import ScalePolicy
from rollout_bus.launch.config import RunConfig
from rollout_bus.launch.fleet import ExecutorFleet
from rollout_bus.launch.job import executor_fleet
from rollout_bus.launch.procs import Child, ProcessSet, RestartPolicy
from tests.support.executor_plugins import GATES_ENV
from tests.support.executor_procs import FAST_FAULTS, job, register_engines, rollout_events
from tests.support.procs import ROOT, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

POLICY = ScalePolicy(min=1, max=3, up_depth=1, up_age_s=60.0, up_samples=2, up_cooldown_s=0.0, down_samples=3,
                     down_cooldown_s=0.5)


@pytest.fixture()
def procs(tmp_path: Path) -> Iterator[ProcessSet]:
    gates = tmp_path / "gates"
    gates.mkdir()
    ps = ProcessSet(tmp_path / "logs", env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", GATES_ENV: str(gates)})
    try:
        yield ps
    finally:
        ps.stop_all()


def make_fleet(procs: ProcessSet, client: redis.Redis, redis_server: RedisServer, keys: Keys) -> ExecutorFleet:
    def start(i: int) -> Child:
        return procs.start(f"executor-{i}", [
            "-m", "rollout_bus", "executor", "--redis-url", redis_server.url, "--namespace", keys.namespace,
            "--index", str(i), *FAST_FAULTS, "--generate", "tests.support.executor_plugins.gated_generate"],
            restart=RestartPolicy(budget=0))

    fleet: ExecutorFleet = executor_fleet(RunConfig(autoscale=POLICY), client, keys, procs, start)
    fleet.interval_s = 0.2
    return fleet


def scaled(client: redis.Redis, keys: Keys) -> list[ExecutorsScaled]:
    return [e for _, f in page(client, keys.scaling_stream) if isinstance(e := decode(f), ExecutorsScaled)]


def started_on(client: redis.Redis, keys: Keys) -> dict[str, str]:
    """request id -> the executor that started it."""
    return {e.request_id: e.executor for e in rollout_events(client, keys, "RolloutStarted")
            if isinstance(e, RolloutStarted)}


def test_a_burst_grows_the_fleet_and_the_shrink_lets_a_busy_executor_finish_its_job(
        procs: ProcessSet, redis_client: redis.Redis, redis_server: RedisServer, keys: Keys) -> None:
    gates = Path(procs.env[GATES_ENV])
    register_engines(redis_client, keys, {}, policy="p")
    fleet = make_fleet(procs, redis_client, redis_server, keys)
    fleet.start_initial()
    assert fleet.count == 1

    submitter = RolloutSubmitter(redis_client, keys)
    ids = [f"burst-{i}" for i in range(3)]
    for i, request_id in enumerate(ids):
        submitter.submit(RolloutRequest.create("p", i, 1, 1, request_id=request_id))

    def ticked(cond):  # type: ignore[no-untyped-def]
        def check() -> bool:
            fleet.tick()
            return bool(cond())
        return check

    wait_for("the fleet to grow to 3", ticked(lambda: fleet.count == 3), timeout_s=30)
    up = scaled(redis_client, keys)
    # one step to the demand (1 running + 2 waiting, or 3 waiting); two only if a job was between queue and start
    assert 1 <= len(up) <= 2 and (up[0].current, up[-1].target) == (1, 3)
    assert all(e.reason == "backlog" and e.depth >= 1 and e.depth + e.busy <= 3 for e in up)  # its inputs
    assert (up[0].min_executors, up[0].max_executors) == (1, 3) and up[0].producer.role == "autoscaler"

    wait_for("every job to start", lambda: len(started_on(redis_client, keys)) == 3, timeout_s=120)
    assert read_backlog(redis_client, keys).busy == 3
    on = started_on(redis_client, keys)
    by_index = {name.rsplit("-", 1)[1]: request_id for request_id, name in on.items()}
    assert sorted(by_index) == ["0", "1", "2"]  # one job each
    held = by_index["2"]  # the executor the fleet retires first (the highest index)
    for request_id in (by_index["0"], by_index["1"]):
        (gates / request_id).touch()
    wait_for("two jobs to finish", lambda: all(job(redis_client, by_index[i]).get_status() == JobStatus.FINISHED
                                                for i in ("0", "1")), timeout_s=60)

    executor_2 = fleet.members[2]
    wait_for("the fleet to shrink to 1", ticked(lambda: fleet.count == 1), timeout_s=60)
    down = scaled(redis_client, keys)[len(up):]
    assert [(e.current, e.target, e.reason) for e in down] == [(3, 2, "idle"), (2, 1, "idle")]
    assert all(e.depth == 0 and e.busy == 1 for e in down)
    assert executor_2 in fleet.retiring
    # the busy executor got its SIGTERM (rq says so) and is still there, its job still running
    wait_for("executor-2 to take the warm shutdown",
             lambda: "warm shut down requested" in executor_2.log_path.read_text(errors="replace"), timeout_s=30)
    assert executor_2.alive()
    assert job(redis_client, held).get_status() == JobStatus.STARTED

    (gates / held).touch()
    wait_for("executor-2 to exit once its job is done", lambda: not executor_2.alive(), timeout_s=60)
    assert executor_2.proc.returncode == 0, executor_2.tail()
    assert job(redis_client, held).get_status() == JobStatus.FINISHED
    completed = [e for e in rollout_events(redis_client, keys, "RolloutCompleted") if isinstance(e, RolloutCompleted)]
    assert sorted(e.request_id for e in completed) == sorted(ids)
    attempts = [e.attempt for e in rollout_events(redis_client, keys, "RolloutStarted") if e.request_id == held]
    assert attempts == [1]  # finished by the executor that was stopping, not retried elsewhere
    # the idle executors retired earlier exit on their own, however loaded the machine is
    wait_for("every retired executor to exit", ticked(lambda: fleet.retiring == []), timeout_s=60)
    assert all(c.proc.returncode == 0 for c in (executor_2, *[c for c in procs.children if c.retiring]))
    assert sorted(fleet.members) == [0] and fleet.members[0].alive()
    assert procs.restarts() == {"executor-0": 0, "executor-1": 0, "executor-2": 0}  # a retirement is no death
    assert os.environ.get(GATES_ENV) is None  # the gates live in the children's environment only


@pytest.mark.slow
def test_a_run_with_autoscaled_executors_trains_and_publishes_each_decision_it_records(
        tmp_path: Path, redis_server: RedisServer, keys: Keys) -> None:
    import json

    from rollout_bus.events.connection import connect
    from rollout_bus.launch.job import run_job
    from tests.support.fake_rollouts import shared_init_dir

    steps = 8
    policy = ScalePolicy(min=1, max=3, up_samples=1, up_cooldown_s=0.0, down_samples=3, down_cooldown_s=2.0)
    config = RunConfig(mode="async", steps=steps, seed=0, out=str(tmp_path / "out"), redis_url=redis_server.url,
                       namespace=keys.namespace, init_dir=str(shared_init_dir()), progress=False, timeout_s=240.0,
                       in_flight=4, executors=1, autoscale=policy)
    result = run_job(config)
    assert result.summaries["p0"]["steps"] == steps
    record = json.loads((result.out / "summary.json").read_text())["executors"]
    assert 1 <= record["peak"] <= 3
    client = connect(redis_server.url)
    try:
        published = scaled(client, keys)
    finally:
        client.close()
    # every change the fleet made is on the bus, with its inputs, in order
    assert [(e.current, e.target, e.reason, e.depth, e.busy) for e in published] == [
        (d["from"], d["to"], d["reason"], d["depth"], d["busy"]) for d in record["decisions"]]
    assert all(1 <= e.target <= 3 and (e.min_executors, e.max_executors) == (1, 3) for e in published)
