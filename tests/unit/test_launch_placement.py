"""``--placement shared|disaggregated``: the split, its errors, and real processes pinned before their exec."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_bus.launch.placement import (
    ENGINES,
    LIGHT,
    TRAINER,
    Placement,
    PlacementError,
    PlacementRecord,
    child_setup,
    parse_cpus,
    pin_process,
    plan,
    read_affinity,
)
from rollout_bus.launch.procs import ProcessSet, RestartPolicy

MINE = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(MINE) < 2, reason="needs 2 CPUs to pin processes apart")

THREADED = ("import threading, time\n"
            "ts = [threading.Thread(target=time.sleep, args=(60,), daemon=True) for _ in range(3)]\n"
            "[t.start() for t in ts]\nprint('up', flush=True)\ntime.sleep(60)\n")


def thread_affinities(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()]


def wait_for(predicate: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.mark.parametrize(("cpus", "engines", "trainer"), [
    ((0, 1), (0,), (1,)),
    ((0, 1, 2), (0, 1), (2,)),
    ((0, 1, 2, 3), (0, 1), (2, 3)),
    ((0, 1, 2, 3, 4), (0, 1, 2), (3, 4)),
    ((2, 5, 7), (2, 5), (7,)),
])
def test_the_default_split_is_half_and_half_rounded_toward_the_engines(
        cpus: tuple[int, ...], engines: tuple[int, ...], trainer: tuple[int, ...]) -> None:
    p = plan("disaggregated", available=cpus, gpus=())
    assert (p.engine_cpus, p.trainer_cpus) == (engines, trainer)
    assert p.cpus("trainer-p0") == trainer and p.cpus("controller") == engines and p.cpus("executor-3") == engines
    assert p.env("trainer-p0") == {"OMP_NUM_THREADS": str(len(trainer))}


def test_a_given_side_takes_its_cpus_and_the_other_side_the_rest() -> None:
    p = plan("disaggregated", engine_cpus="0-2", available=range(8), gpus=(), engines=3, trainers=2)
    assert p.engine_cpus == (0, 1, 2) and p.trainer_cpus == (3, 4, 5, 6, 7)
    assert (p.engine_threads, p.trainer_threads) == (1, 2)
    p = plan("disaggregated", trainer_cpus="1", available=(0, 1, 2), gpus=())
    assert p.engine_cpus == (0, 2) and p.trainer_cpus == (1,)
    assert parse_cpus("3,0-1, 5") == (0, 1, 3, 5)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"available": (3,)}, "needs at least 2 CPUs"),
    ({"available": (0, 1), "engine_cpus": "0", "trainer_cpus": "0-1"}, "overlap on [0]"),
    ({"available": (0, 1), "engine_cpus": "0,4"}, "CPU 4 is not among the CPUs this process may run on"),
    ({"available": (0, 1), "engine_cpus": "0-1"}, "each side needs at least one"),
    ({"available": (0, 1), "trainer_cpus": "1-x"}, "is not a CPU number or a range"),
])
def test_a_split_that_cannot_be_made_is_refused_saying_why(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(PlacementError) as err:
        plan("disaggregated", gpus=(), **kwargs)  # type: ignore[arg-type]
    assert words in str(err.value)


def test_shared_pins_nothing_and_refuses_cpu_lists() -> None:
    p = plan("shared")
    assert p == Placement() and p.cpus("trainer-p0") is None and p.env("controller") == {}
    with pytest.raises(PlacementError, match="need --placement disaggregated"):
        plan("shared", engine_cpus="0")


def test_gpus_are_split_disjoint_and_a_single_one_goes_to_the_trainer() -> None:
    one = plan("disaggregated", available=(0, 1), gpus=("0",))
    assert one.env("trainer-p0")["CUDA_VISIBLE_DEVICES"] == "0" and one.env("controller")["CUDA_VISIBLE_DEVICES"] == ""
    three = plan("disaggregated", available=(0, 1), gpus=("0", "1", "2"))
    assert (three.engine_gpus, three.trainer_gpus) == (("0", "1"), ("2",))
    assert "CUDA_VISIBLE_DEVICES" not in plan("disaggregated", available=(0, 1), gpus=()).env("trainer-p0")


@two_cpus
def test_a_child_pinned_before_exec_runs_every_thread_on_its_cpus_and_the_record_reads_it_back() -> None:
    cpu = MINE[-1]
    proc = subprocess.Popen([sys.executable, "-c", THREADED], stdout=subprocess.PIPE, preexec_fn=child_setup([cpu]),
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES="7"))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
        affinities = thread_affinities(proc.pid)
        assert len(affinities) == 4 and all(a == {cpu} for a in affinities)
        record = PlacementRecord(plan("disaggregated", available=MINE, gpus=()))
        record.observe("trainer-p0", proc.pid)
        assert record.processes["trainer-p0"] == {"pid": proc.pid, "cpus": [cpu], "gpus": ["7"], "side": TRAINER}
        assert record.to_dict()["observed"] == {ENGINES: [], TRAINER: [cpu]}
        assert f"trainer on CPUs [{cpu}], GPUs ['7'] (trainer-p0)" in record.text()
    finally:
        proc.kill()
        proc.wait()
    assert read_affinity(proc.pid) is None


@two_cpus
def test_a_running_process_is_pinned_thread_by_thread() -> None:
    proc = subprocess.Popen([sys.executable, "-c", THREADED], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
        assert all(a == set(MINE) for a in thread_affinities(proc.pid))  # not pinned yet
        pin_process(proc.pid, [MINE[0]])
        assert all(a == {MINE[0]} for a in thread_affinities(proc.pid))
    finally:
        proc.kill()
        proc.wait()


@two_cpus
def test_the_process_set_pins_each_side_and_pins_a_restarted_child_again(tmp_path: Path) -> None:
    placement = plan("disaggregated", available=MINE, gpus=())
    procs = ProcessSet(tmp_path, placement=placement)
    sleeper = ["-c", "import time; time.sleep(60)"]
    trainer = procs.start("trainer-p0", sleeper, restart=RestartPolicy(budget=1, backoff_s=0.0))
    executor = procs.start("executor-0", sleeper)
    try:
        assert os.sched_getaffinity(trainer.pid) == set(placement.trainer_cpus)
        assert os.sched_getaffinity(executor.pid) == set(placement.engine_cpus)
        assert Path(f"/proc/{trainer.pid}/environ").read_bytes().split(b"\0").count(
            f"OMP_NUM_THREADS={len(placement.trainer_cpus)}".encode()) == 1
        first = trainer.pid
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: not trainer.alive())
        wait_for(lambda: bool(procs.supervise()) or trainer.pid != first)
        assert trainer.pid != first and trainer.alive()
        assert os.sched_getaffinity(trainer.pid) == set(placement.trainer_cpus)
    finally:
        procs.stop_all()


@two_cpus
def test_rollout_bus_run_on_one_cpu_refuses_disaggregated_before_it_starts_anything(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "rollout_bus", "run", "--placement", "disaggregated", "--steps", "1",
                           "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=120,
                          preexec_fn=child_setup([MINE[0]]))
    assert done.returncode != 0
    assert "--placement disaggregated needs at least 2 CPUs" in done.stderr
    assert f"this process may run on 1 (CPU {MINE[0]})" in done.stderr and "--placement shared" in done.stderr
    assert not out.exists()  # nothing was started: no run directory, no redis, no roles


def test_rollout_bus_run_takes_the_placement_and_the_correction_and_passes_them_to_its_trainers(
        tmp_path: Path) -> None:
    from rollout_bus.launch.cli import build_parser, config_from_args
    from rollout_bus.launch.job import _trainer_args

    config = config_from_args(build_parser().parse_args(["--off-policy", "mis", "--placement", "shared"]))
    assert (config.off_policy, config.placement) == ("mis", "shared")
    args = _trainer_args(config, "p0", "redis://x", "ns", tmp_path, tmp_path, tmp_path, tmp_path, {},
                         ["--torch-threads", "3"])
    assert args[args.index("--off-policy") + 1] == "mis" and args[args.index("--torch-threads") + 1] == "3"
    assert config_from_args(build_parser().parse_args([])).off_policy == "tis"
    with pytest.raises(SystemExit, match="need --placement disaggregated"):
        config_from_args(build_parser().parse_args(["--engine-cpus", "0"]))


def test_the_light_roles_take_a_set_of_their_own_and_the_controller_and_engines_stay() -> None:
    placed = plan("disaggregated", available=(0, 1, 2, 3), engine_cpus="0-1", trainer_cpus="2-3", light_cpus="3",
                  gpus=())
    assert placed.light_cpus == (3,) and placed.planned()["light_cpus"] == [3]
    for name in ("executor-0", "executor-eval", "recorder", "redis-server", "bus-exporter"):
        assert placed.side(name) == LIGHT and placed.cpus(name) == (3,), name
    for name in ("controller", "engine-0-4242"):  # the engines are the controller's children: its set
        assert placed.side(name) == ENGINES and placed.cpus(name) == (0, 1), name
    assert placed.side("trainer-p0") == TRAINER and placed.cpus("trainer-p0") == (2, 3)
    default = plan("disaggregated", available=(0, 1), gpus=())
    assert default.light_cpus is None and default.side("executor-0") == ENGINES and default.cpus("executor-0") == (0,)
    record = PlacementRecord(placed)
    record.processes = {"controller": {"pid": 1, "cpus": [0, 1], "gpus": None, "side": ENGINES},
                        "executor-0": {"pid": 2, "cpus": [3], "gpus": None, "side": LIGHT},
                        "trainer-p0": {"pid": 3, "cpus": [2, 3], "gpus": None, "side": TRAINER}}
    assert record.sides() == {ENGINES: [0, 1], TRAINER: [2, 3], LIGHT: [3]}
    assert record.to_dict()["disjoint"] is True  # the engines against the trainer: the light set may overlap
    assert "light on CPUs [3] (executor-0)" in record.text()


def test_light_cpus_need_disaggregated_and_cpus_this_process_has() -> None:
    with pytest.raises(PlacementError, match="--light-cpus need --placement disaggregated"):
        plan("shared", light_cpus="1")
    with pytest.raises(PlacementError, match="--light-cpus 7"):
        plan("disaggregated", available=(0, 1), light_cpus="7", gpus=())
