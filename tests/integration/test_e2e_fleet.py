"""The main job with an elastic fleet: a pool grown and shrunk while the run goes on (``rollout-bus scale``),
and a colocated run (``--colocate``) whose engines are offloaded and onloaded around every step."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.schema import (
    EngineOffloaded,
    EngineOnloaded,
    EngineServing,
    EnginesScaled,
    RolloutFailed,
    TrainStepDone,
    WeightsPublished,
    decode,
)
from rollout_bus.launch.config import RunConfig
from rollout_bus.launch.job import RunHandle, run_job
from rollout_bus.scale import ask
from tests.support.fake_rollouts import shared_init_dir

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def events(url: str, stream: str) -> list[tuple[str, Any]]:
    client = connect(url)
    try:
        return [(entry_id, decode(f)) for entry_id, f in page(client, stream)]
    finally:
        client.close()


def step(url: str, keys: Keys) -> int:
    return max((e.step for _, e in events(url, keys.trainer_stream) if isinstance(e, TrainStepDone)), default=0)


def newest_published(url: str, keys: Keys) -> int:
    return max((e.version for _, e in events(url, keys.weight_stream("p0")) if isinstance(e, WeightsPublished)), default=0)


def test_a_pool_grows_and_shrinks_mid_run_with_nothing_lost_and_new_engines_serve_the_current_version(
        tmp_path: Path, redis_server: RedisServer, keys: Keys) -> None:
    url = redis_server.url
    outcome: dict[str, Any] = {}

    def scale_during(handle: RunHandle) -> None:
        def drive() -> None:
            client = connect(url)
            try:
                while step(url, keys) < 3:
                    time.sleep(0.05)
                outcome["published_before_up"] = newest_published(url, keys)
                outcome["up"] = ask(client, keys, "p0", "+1", 120, echo=False)
                while step(url, keys) < 8:
                    time.sleep(0.05)
                outcome["down"] = ask(client, keys, "p0", "-1", 120, echo=False)
            except Exception as exc:  # reported by the test, not lost in a thread
                outcome["error"] = repr(exc)
            finally:
                client.close()
        thread = threading.Thread(target=drive, daemon=True)
        thread.start()
        outcome["thread"] = thread

    # 12 steps left after the scale-down is asked: it must finish mid-run even on a loaded machine
    config = RunConfig(mode="async", steps=20, seed=0, out=str(tmp_path / "out"), redis_url=url,
                       namespace=keys.namespace, init_dir=str(shared_init_dir()), progress=False, timeout_s=240.0,
                       token_delay_ms=2.0, controller_args=["--drain-grace-s", "0.5"])
    result = run_job(config, on_start=scale_during)
    outcome["thread"].join(timeout=60)
    assert "error" not in outcome, outcome["error"]
    assert result.summaries["p0"]["steps"] == 20
    up_status, up = outcome["up"]
    down_status, down = outcome["down"]
    assert up_status == 0 and [(a.outcome, a.from_count, a.to_count) for a in up] == [("started", 1, 2),
                                                                                      ("done", 1, 2)]
    assert up[-1].engine_ids == ["engine-1"]
    assert down_status == 0 and [(a.outcome, a.from_count, a.to_count) for a in down] == [("started", 2, 1),
                                                                                          ("done", 2, 1)]
    engine_log = [e for _, e in events(url, keys.engine_stream)]
    (serving,) = [e for e in engine_log if isinstance(e, EngineServing) and e.engine_id == "engine-1"]
    assert serving.versions["p0"] >= outcome["published_before_up"] >= 2  # the current version, before serving
    rollouts = [e for _, e in events(url, keys.rollout_stream)]
    assert not [e for e in rollouts if isinstance(e, RolloutFailed)]  # no request lost to the shrink
    assert result.faults["dead_letters"] == 0
    drawn = subprocess.run([sys.executable, "-m", "rollout_bus", "replay", "timeline", "--live", "--redis-url", url,
                            "--namespace", keys.namespace], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0, drawn.stderr
    scaling = drawn.stdout.split("SCALING", 1)[1]
    assert "engine-1" in scaling and "done" in scaling and "scale/" in scaling
    assert [line.split()[1] for line in drawn.stdout.splitlines() if line.startswith("engine-1 ")] == ["stopped"]
    html = tmp_path / "run.html"
    pictured = subprocess.run([sys.executable, "-m", "rollout_bus", "replay", "timeline", "--live", "--redis-url", url,
                               "--namespace", keys.namespace, "--html", str(html)], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    assert pictured.returncode == 0, pictured.stderr
    page_text = html.read_text()
    assert page_text.count('class="scale"') == 4 and "scaling (4)" in page_text  # started and done, up and down
    assert "1 -&gt; 2 engines, done" in page_text and "draining" in page_text
    scaled = [e for e in engine_log if isinstance(e, EnginesScaled)]
    assert all(e.requested_by.startswith("scale/") for e in scaled)


def test_a_colocated_run_offloads_and_onloads_the_engines_around_every_step(
        tmp_path: Path, redis_server: RedisServer, keys: Keys) -> None:
    steps = 4
    config = RunConfig(colocate=True, mode="sync", steps=steps, seed=0, out=str(tmp_path / "out"),
                       redis_url=redis_server.url, namespace=keys.namespace, init_dir=str(shared_init_dir()),
                       progress=False, timeout_s=240.0)
    result = run_job(config)
    p0 = result.summaries["p0"]
    assert p0["steps"] == steps
    assert len(p0["offload_ms"]) == steps and len(p0["onload_ms"]) == steps
    assert all(ms > 0 for ms in p0["offload_ms"] + p0["onload_ms"])
    assert "colocated   offload" in result.text
    engine_log = [e for _, e in events(redis_server.url, keys.engine_stream)]
    offloads = [e for e in engine_log if isinstance(e, EngineOffloaded)]
    onloads = [e for e in engine_log if isinstance(e, EngineOnloaded)]
    assert len(offloads) == steps and all(sorted(e.tags) == ["kv_cache", "weights"] for e in offloads)
    assert [e.tags for e in onloads] == [["weights"], ["kv_cache"]] * steps  # miles' order, every step
