"""``rollout-bus run --placement disaggregated``: the engines' side and the trainer on disjoint CPUs.

A short real run of the tiny LM (its own redis-server, the controller and its engine, an executor and
the trainer as processes). While it is up, a watcher reads the kernel's affinity of every thread of the
trainer, the engine, the controller, the executor and redis; the summary's placement, read back by the
run itself, must say the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rollout_bus.events.connection import abandon, connect
from rollout_bus.events.errors import BusUnavailable
from rollout_bus.events.registry import Registry
from rollout_bus.launch.config import RunConfig
from rollout_bus.launch.job import RunHandle, run_job
from rollout_bus.launch.placement import ENGINES, TRAINER
from tests.support.fake_rollouts import shared_init_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MINE = sorted(os.sched_getaffinity(0))


def threads_of(pid: int) -> dict[int, set[int]]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            out[int(task.name)] = os.sched_getaffinity(int(task.name))
    return out


class Watcher(threading.Thread):
    """Every 0.2 s while the run is up: each role's pid and the affinity of each of its threads."""

    def __init__(self, handle: RunHandle) -> None:
        super().__init__(daemon=True)
        self.handle = handle
        self.seen: dict[str, dict[int, set[int]]] = {}
        self.stop = threading.Event()
        self.client: Any = None

    def run(self) -> None:
        self.client = client = connect(self.handle.url)
        registry = Registry(client, self.handle.keys)
        try:
            while not self.stop.is_set():
                pids = {c.name: c.pid for c in self.handle.procs.children if c.alive()}
                try:
                    pids.update({e.engine_id: e.pid for e in registry.engines().values() if e.pid})
                except BusUnavailable:
                    if self.stop.is_set():  # the run is over and its redis-server gone: nothing more to see
                        return
                    raise
                for name, pid in pids.items():
                    with contextlib.suppress(FileNotFoundError):  # it exited meanwhile
                        self.seen.setdefault(name, {}).update(threads_of(pid))
                time.sleep(0.2)
        finally:
            client.close()

    def halt(self) -> None:
        """Stop looking; a registry read waiting for the run's Redis (stopped with the run) gives up at once."""
        self.stop.set()
        if self.client is not None:
            abandon(self.client)
        self.join(10)
        assert not self.is_alive(), "the watcher did not stop"


def run_watched(config: RunConfig) -> tuple[Any, dict[str, dict[int, set[int]]]]:
    """``run_job(config)`` with a ``Watcher`` on it: the result, and every thread's CPUs as the kernel had them."""
    watchers: list[Watcher] = []

    def on_start(handle: RunHandle) -> None:
        watchers.append(Watcher(handle))
        watchers[0].start()

    try:
        result = run_job(config, on_start=on_start)
    finally:
        for w in watchers:
            w.halt()
    return result, watchers[0].seen


@pytest.mark.skipif(len(MINE) < 2, reason="disaggregated placement needs 2 CPUs")
def test_a_disaggregated_run_keeps_the_engines_and_the_trainer_on_disjoint_cpus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)  # the run's own redis-server, pinned with the engines
    engines_cpus = MINE[:(len(MINE) + 1) // 2]
    trainer_cpus = MINE[(len(MINE) + 1) // 2:]
    config = RunConfig(mode="async", steps=4, seed=0, out=str(tmp_path / "out"), init_dir=str(shared_init_dir()),
                       progress=False, plot=False, n_groups=4, n_samples=4, timeout_s=180.0, redis_aof=False,
                       placement="disaggregated", off_policy="decoupled")
    result, seen = run_watched(config)
    engines = [n for n in seen if n.startswith("engine")]
    assert engines and "trainer-p0" in seen and "controller" in seen and "executor-0" in seen
    assert len(seen["trainer-p0"]) > 1  # torch's and the trainer's own threads, not only the main one
    for name, threads in seen.items():  # every thread of every process, as the kernel had it during the run
        want = set(trainer_cpus) if name.startswith("trainer-") else set(engines_cpus)
        assert all(cpus == want for cpus in threads.values()), (name, threads)

    summary: dict[str, Any] = json.loads((result.out / "summary.json").read_text())
    placed = summary["placement"]
    assert placed["mode"] == "disaggregated" and placed["disjoint"] is True
    assert placed["engine_cpus"] == engines_cpus and placed["trainer_cpus"] == trainer_cpus
    assert placed["observed"] == {ENGINES: engines_cpus, TRAINER: trainer_cpus}
    processes = placed["processes"]
    assert processes["trainer-p0"]["cpus"] == trainer_cpus and processes["trainer-p0"]["side"] == TRAINER
    for name in ("controller", "executor-0", "redis-server", *engines):
        assert processes[name]["cpus"] == engines_cpus and processes[name]["side"] == ENGINES, name
    for name in ("trainer-p0", "controller", *engines):  # read from the very processes the watcher saw
        assert processes[name]["pid"] in seen[name], name
    assert summary["config"]["off_policy"] == "decoupled" and summary["policies"]["p0"]["steps"] == 4
    assert f"trainer on CPUs {trainer_cpus}" in result.text and f"engines on CPUs {engines_cpus}" in result.text


@pytest.mark.skipif(len(MINE) < 2, reason="disaggregated placement needs 2 CPUs")
def test_a_disaggregated_run_with_weights_by_broadcast_sends_every_version_by_collective(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run --placement disaggregated --weight-sync broadcast``: the summary names both, and the versions,
    the trainer's last one too, reach the engine through the collective (the last one no longer falls back
    to disk because the trainer exited before the controller asked for it)."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    steps = 5
    config = RunConfig(mode="async", steps=steps, seed=0, out=str(tmp_path / "out"),
                       init_dir=str(shared_init_dir()), progress=False, plot=False, n_groups=4, n_samples=4,
                       timeout_s=180.0, redis_aof=False, placement="disaggregated", weight_sync="broadcast")
    result = run_job(config)
    summary: dict[str, Any] = json.loads((result.out / "summary.json").read_text())
    assert summary["weight_sync"] == "broadcast" and summary["placement"]["mode"] == "disaggregated"
    assert summary["policies"]["p0"]["steps"] == steps
    trainer_log = (result.out / "logs" / "trainer-p0.log").read_text()
    sent = sorted({int(v) for v in re.findall(r"broadcast p0 v(\d+) in ", trainer_log)})
    assert steps in sent and len(sent) >= steps - 1, sent  # the last version too (v1 may open the group by disk)


@pytest.mark.skipif(len(MINE) < 2, reason="disaggregated placement needs 2 CPUs")
def test_light_roles_on_a_set_of_their_own_leave_the_engines_set_to_the_controller_and_engines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--light-cpus``: the executors and the run's redis-server run where they are told (here beside the
    trainer), the controller and its engines keep the engines' set; the kernel says so while the run is up."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    engines_cpus, trainer_cpus = MINE[:1], MINE[1:]
    light = MINE[-1:]
    config = RunConfig(mode="async", steps=3, seed=0, out=str(tmp_path / "out"), init_dir=str(shared_init_dir()),
                       progress=False, plot=False, n_groups=4, n_samples=4, timeout_s=180.0, redis_aof=False,
                       placement="disaggregated", engine_cpus=str(engines_cpus[0]),
                       trainer_cpus=",".join(map(str, trainer_cpus)), light_cpus=str(light[0]))
    result, seen = run_watched(config)
    engines = [n for n in seen if n.startswith("engine")]
    assert engines and "executor-0" in seen and "controller" in seen
    for name, threads in seen.items():
        want = set(light) if name.startswith("executor") else (
            set(trainer_cpus) if name.startswith("trainer-") else set(engines_cpus))
        assert all(cpus == want for cpus in threads.values()), (name, threads)
    placed = json.loads((result.out / "summary.json").read_text())["placement"]
    assert placed["light_cpus"] == light and placed["observed"]["light"] == light
    assert placed["processes"]["redis-server"]["cpus"] == light and placed["processes"]["redis-server"]["side"] == "light"
    assert placed["observed"]["engines"] == engines_cpus and placed["disjoint"] is True
