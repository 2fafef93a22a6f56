"""``rollout-bus status`` as a process against a real redis-server: tables, JSON, --watch and the exporter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis

from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.embedded import RedisServer, free_port
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import EngineRecord, EngineState, PolicyRecord, Registry
from tests.unit.test_timeline import POLICY, publish_scenario, scenario

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
STATUS = [sys.executable, "-m", "rollout_bus", "status"]


def populate(client: redis.Redis, keys: Keys) -> None:
    publish_scenario(client, keys, scenario())
    Registry(client, keys).put_engine(EngineRecord("e0", "http://h:1", EngineState.SERVING, versions={POLICY: 2}))
    Registry(client, keys).put_policy(PolicyRecord(POLICY, published=2, serving=2))
    Consumer(client, keys, keys.batch_stream(POLICY), "trainer-p0", "t-0", ConsumerConfig(block_ms=1)).read()


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "ROLLOUT_BUS_NAMESPACE")}


def test_status_prints_tables_and_json_of_a_live_namespace(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys) -> None:
    populate(redis_client, keys)
    args = ["--redis-url", redis_server.url, "--namespace", keys.namespace]
    text = subprocess.run([*STATUS, *args], capture_output=True, text=True, timeout=30, env=env(), check=True).stdout
    assert "serving" in text and f"batches/{POLICY}" in text and "trainer-p0" in text
    doc = json.loads(subprocess.run([*STATUS, *args, "--json"], capture_output=True, text=True, timeout=30,
                                    env=env(), check=True).stdout)
    batches = next(st for st in doc["streams"] if st["stream"] == f"batches/{POLICY}")
    assert batches["groups"][0]["pending"] == 3 and batches["groups"][0]["lag"] == 0


def test_status_watch_refreshes_until_stopped(redis_server: RedisServer, redis_client: redis.Redis,
                                              keys: Keys) -> None:
    proc = subprocess.Popen([*STATUS, "--redis-url", redis_server.url, "--namespace", keys.namespace,
                             "--watch", "0.05"], stdout=subprocess.PIPE, text=True, env=env())
    try:
        assert proc.stdout is not None
        seen = 0
        deadline = time.monotonic() + 20
        while seen < 2 and time.monotonic() < deadline:
            if proc.stdout.readline().startswith("namespace "):
                seen += 1
        assert seen == 2
    finally:
        proc.terminate()
        proc.wait(10)


def test_status_serves_the_bus_gauges_for_prometheus(redis_server: RedisServer, redis_client: redis.Redis,
                                                     keys: Keys) -> None:
    populate(redis_client, keys)
    port = free_port()
    proc = subprocess.Popen([*STATUS, "--redis-url", redis_server.url, "--namespace", keys.namespace,
                             "--serve-metrics", str(port)], stderr=subprocess.DEVNULL, env=env())
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        ns = keys.namespace
        assert f'rollout_bus_group_pending{{group="trainer-p0",namespace="{ns}",stream="batches/p0"}} 3.0' in body
        assert f'rollout_bus_stream_length{{namespace="{ns}",stream="engines"}}' in body
        assert f'rollout_bus_redis_up{{namespace="{ns}"}} 1.0' in body
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
