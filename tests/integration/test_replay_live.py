"""A real run's log, exported, imported into a fresh redis-server, replayed and retrained offline.

``rollout-bus run`` runs the whole system (controller, engine, executor, trainer) as
processes on a redis-server of ours, under a known namespace, with the batch payloads held
for export (``hold_payloads``). Then the timeline and the invariants of the live namespace,
of the exported file and of a copy imported into a second redis-server must agree number
for number (and with the run's own summary), and two offline retrainings from the log
(one through the CLI, one in-process) must train the same batches in the same order to
the same weights, which are the live trainer's final weights.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_bus.events import schema as s
from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.lm.model import load_model
from rollout_bus.replay import cli as replay
from rollout_bus.replay.exporter import hold_payloads, read_live, release_payloads
from rollout_bus.replay.feed import feed_batches, trained_batch_ids
from rollout_bus.replay.logfile import LogReader, decode_entries
from rollout_bus.replay.offline import BATCH_IDS_FILE, RESULT_FILE, OfflineConfig, run_offline, weights_sha256
from rollout_bus.replay.picture import picture
from rollout_bus.replay.timeline import timeline
from rollout_bus.replay.verify import verify, verify_log
from rollout_bus.tasks.warmstart import WarmStartConfig, warm_start_cached
from rollout_bus.trainer.weights import version_dir
from tests.support.fake_rollouts import shared_init_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
POLICY = "p0"
STEPS = 5
WARM_STEPS = 400  # the default warm start (cached across runs): a policy that gets some answers right, so every
# step has signal (a batch without any takes no optimiser step and publishes no version)
RUN_ARGS = ["--mode", "one-step", "--steps", str(STEPS), "--seed", "0", "--n-groups", "4", "--n-samples", "4",
            "--warm-steps", str(WARM_STEPS), "--no-progress", "--no-plot", "--timeout-s", "120"]


@pytest.fixture()
def source() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture()
def target() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


def cli(capsys: pytest.CaptureFixture[str], *args: str, rc: int = 0) -> str:
    capsys.readouterr()
    assert replay.main(list(args)) == rc, capsys.readouterr()
    return capsys.readouterr().out


def plain(value: Any) -> Any:
    """What JSON makes of it (tuples become lists), for comparing function output with the CLI's."""
    return json.loads(json.dumps(value, sort_keys=True))


def warm_init(out: Path) -> Path:
    """The run's warm-start weights, made once per machine and copied where run.py looks for them."""
    warm = warm_start_cached(shared_init_dir(), WarmStartConfig(steps=WARM_STEPS, keep=0.25, digits=1, seed=0))
    init = out / "init" / warm.name
    shutil.copytree(warm, init)
    return init


def numbers(t: dict[str, Any]) -> dict[str, Any]:
    """The figures a replay must reproduce."""
    return {
        "engines": {e: (v["state"], v["versions"], v["restarts"]) for e, v in t["engines"].items()},
        "policies": {p: (v["published"], v["serving"], [x for _, x in v["published_history"]],
                         [x for _, x in v["serving_history"]]) for p, v in t["policies"].items()},
        "batches": {b: (v["rollout_id"], v["n_samples"], v["min_weight_version"], v["max_weight_version"],
                        v["staleness"], v["staleness_source"]) for b, v in t["batches"].items()},
        "requests": {r: (v["state"], v["batch_ids"]) for r, v in t["requests"].items()},
        "trainers": {tr: (v["step"], v["weight_version"], v["consumed"], v["rejected"])
                     for tr, v in t["trainers"].items()},
        "counts": t["counts"],
    }


def test_a_live_run_exports_imports_replays_and_retrains_to_the_same_numbers(
        source: RedisServer, target: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    namespace = f"live-{uuid.uuid4().hex[:8]}"
    keys = Keys(namespace)
    out = tmp_path / "run"
    init = warm_init(out)
    client = connect(source.url)
    try:
        hold_payloads(client, keys, [POLICY])  # before the run: the trainer's acks release nothing we need

        # --- the live run --------------------------------------------------------------------
        started = time.monotonic()
        env = {**os.environ, "REDIS_URL": source.url, "PYTHONUNBUFFERED": "1"}
        env.pop("ROLLOUT_BUS_NAMESPACE", None)
        done = subprocess.run([sys.executable, "-m", "rollout_bus", "run", *RUN_ARGS, "--namespace", namespace,
                               "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        run_s = time.monotonic() - started
        summary = json.loads((out / "summary.json").read_text())["policies"][POLICY]
        assert summary["steps"] == STEPS

        live_src = ["--redis-url", source.url, "--namespace", namespace]
        live = json.loads(cli(capsys, "timeline", "--live", *live_src, "--json"))
        assert plain(timeline(decode_entries(read_live(client, keys))).to_dict()) == live
        assert "ok: no violations" in cli(capsys, "verify", "--live", *live_src)
        assert verify(decode_entries(read_live(client, keys))) == []

        # --- what the live run says --------------------------------------------------------------
        want = numbers(live)
        assert want["engines"] == {"engine-0": ("stopped", {POLICY: STEPS}, 0)}  # run.py stops it at exit
        assert want["policies"] == {POLICY: (STEPS, STEPS, list(range(1, STEPS + 1)), list(range(1, STEPS + 1)))}
        assert want["trainers"] == {f"trainer-{POLICY}": (STEPS, STEPS, STEPS, 0)}
        assert len(want["batches"]) == STEPS and all(r[0] == "completed" for r in want["requests"].values())
        batches = sorted(live["batches"].values(), key=lambda b: b["rollout_id"])
        # one-step ahead: the first batch is on-policy, every later one exactly one version behind
        assert [b["staleness"] for b in batches] == [0] + [1] * (STEPS - 1)
        assert all(b["staleness_source"] == "consumed" for b in batches)
        hist: dict[str, int] = {}
        for b in batches:
            hist[str(b["staleness"])] = hist.get(str(b["staleness"]), 0) + b["n_samples"]
        assert hist == {str(k): v for k, v in summary["staleness_hist"].items()}  # the run's own figures

        # --- export, with the payloads ---------------------------------------------------------
        path = tmp_path / "live.rblog"
        exported = json.loads(cli(capsys, "export", str(path), *live_src))
        assert exported["payloads"] == STEPS and exported["missing_payloads"] == []
        assert "ok: no violations" in cli(capsys, "verify", str(path))  # every sample's version checked too
        assert verify_log(path) == []
        with LogReader(path) as reader:  # every producer's events numbered 1..n: none lost, none doubled
            numbers_of: dict[str, list[int]] = {}
            for item in reader.events():
                numbers_of.setdefault(str(item.event.producer), []).append(item.event.seq)
        assert {"controller", "executor", "trainer"} <= {p.split("/")[0] for p in numbers_of}
        assert {p: sorted(n) for p, n in numbers_of.items()} == {p: list(range(1, len(n) + 1))
                                                                for p, n in numbers_of.items()}
        with LogReader(path) as reader:
            assert plain(timeline(reader.events()).to_dict()) == live
        with LogReader(path) as reader:  # the timeline picture too: same data live and exported
            drawn = picture(read_live(client, keys)).to_dict()
            assert picture(reader.entries()).to_dict() == drawn
        assert len(drawn["batches"]) == STEPS and [lane["engine_id"] for lane in drawn["lanes"]] == ["engine-0"]
    finally:
        released = release_payloads(client, keys, [POLICY])
        client.close()
    assert released == STEPS

    # --- import into a fresh redis-server and replay there ------------------------------------
    copy_ns = "replayed"
    dst = ["--redis-url", target.url, "--namespace", copy_ns]
    imported = json.loads(cli(capsys, "import", str(path), *dst))
    assert all(imported["ids_preserved"].values()) and imported["payloads"] == STEPS
    assert imported["entries"] == exported["entries"]
    replayed = json.loads(cli(capsys, "timeline", "--live", *dst, "--json"))
    assert "ok: no violations" in cli(capsys, "verify", "--live", *dst)
    dest = connect(target.url)
    try:
        assert verify(decode_entries(read_live(dest, Keys(copy_ns)))) == []
    finally:
        dest.close()
    assert numbers(replayed) == want
    assert replayed == live  # every figure, to the entry id

    # --- offline retraining, twice: once through the CLI, once in-process ----------------------
    in_stream_order = [b for b, _, _ in feed_batches(path, policy=POLICY)]
    assert in_stream_order == [b["batch_id"] for b in batches] == trained_batch_ids(path, policy=POLICY)
    first_out = tmp_path / "offline-1"
    done = subprocess.run([sys.executable, "-m", "rollout_bus", "trainer", "offline", "--log", str(path), "--policy", POLICY,
                           "--model-path", str(init), "--seed", "0", "--out", str(first_out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads(done.stdout.strip().splitlines()[-1])
    assert (first_out / BATCH_IDS_FILE).read_text().split() == first["batch_ids"]
    assert json.loads((first_out / RESULT_FILE).read_text())["weights_sha256"] == first["weights_sha256"]

    second, model = run_offline(OfflineConfig(log=str(path), model_path=str(init), policy=POLICY, seed=0))
    assert first["batch_ids"] == second.batch_ids == in_stream_order
    assert first["weights_sha256"] == second.weights_sha256 == weights_sha256(load_model(first_out / "model"))
    assert first["final_metrics"]["loss"] == second.final_metrics["loss"]
    assert second.version == STEPS and second.final_metrics["steps"] == STEPS
    # the live trainer trained the same batches in the same order from the same weights: same result
    assert second.weights_sha256 == weights_sha256(load_model(version_dir(out / "weights", POLICY, STEPS)))
    print(f"live run {run_s:.1f}s; {STEPS} batches, staleness {[b['staleness'] for b in batches]}, "
          f"events {live['events']}, weights {second.weights_sha256[:12]}", file=sys.stderr)


def test_a_weight_applied_in_the_same_millisecond_as_the_serving_announcement_counts(
        source: RedisServer) -> None:
    """Ids order streams only to the millisecond: the controller's ``WeightsApplied`` then
    ``EngineServing`` (a relaunched engine) can share one. By ids the engine stream would come first;
    the controller's own sequence numbers put them in the order it made them."""
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    ctrl = s.Producer("controller", "c-0")
    client = connect(source.url)
    try:
        numbers = itertools.count(1)

        def add(stream: str, entry_id: str, event: s.Event) -> None:  # numbered as the publish script would
            client.xadd(stream, s.encode(dataclasses.replace(event, seq=next(numbers))), id=entry_id)  # type: ignore[arg-type]
        add(keys.weight_stream(POLICY), "1000-0", s.WeightsPublished(producer=ctrl, policy=POLICY, version=1, uri="u",
                                                              sha256="ab" * 32))
        add(keys.engine_stream, "1001-0", s.EngineLaunching(producer=ctrl, engine_id="e0", url="u", backend="cpu"))
        add(keys.weight_stream(POLICY), "1002-0", s.WeightsApplied(producer=ctrl, policy=POLICY, version=1, engine_id="e0",
                                                            duration_ms=1.0))
        add(keys.engine_stream, "1002-0", s.EngineServing(producer=ctrl, engine_id="e0", url="u",
                                                          versions={POLICY: 1}))
        entries = list(decode_entries(read_live(client, keys)))
        assert [e.event.type for e in entries][-2:] == ["WeightsApplied", "EngineServing"]
        assert verify(entries) == []
        # a version served and never applied is still caught, once its millisecond is over
        add(keys.weight_stream(POLICY), "1003-0", s.WeightsPublished(producer=ctrl, policy=POLICY, version=2, uri="u",
                                                              sha256="ab" * 32))
        add(keys.engine_stream, "1004-0", s.EngineServing(producer=ctrl, engine_id="e0", url="u",
                                                          versions={POLICY: 2}))
        add(keys.weight_stream(POLICY), "1005-0", s.WeightsApplied(producer=ctrl, policy=POLICY, version=2, engine_id="e0",
                                                            duration_ms=1.0))
        found = verify(decode_entries(read_live(client, keys)))
        assert [(v.kind, v.entries) for v in found] == [("version_not_received", ["engines@1004-0"])]
    finally:
        client.close()
