"""The main job with each role on its own "host" (network namespace); run on the trainer's host.

Usage: multihost_job.py <spec.json> <result.json>. The spec names the Redis url, the run
config fields, and for each role the command prefix that places it (``Hosts.prefix``). Once the
roles are started it records what the other hosts see: every engine's registered url, and an
role's ``/metrics`` fetched from here (another host). The run's summary and those findings go
to ``result.json``.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from rollout_bus.events.connection import connect
from rollout_bus.events.registry import Registry
from rollout_bus.launch.config import RunConfig
from rollout_bus.launch.job import RunHandle, run_job


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    places: dict[str, list[str]] = spec["places"]
    seen: dict[str, Any] = {}

    def place(name: str) -> list[str]:
        role = name.split("-")[0] if not name.startswith("executor-") else name
        return places.get(name, places.get(role, places["default"]))

    def on_start(handle: RunHandle) -> None:
        client = connect(handle.url)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            engines = Registry(client, handle.keys).engines()
            if engines and all(r.state.value == "serving" for r in engines.values()):
                break
            time.sleep(0.2)
        seen["engine_urls"] = sorted(r.url for r in engines.values())
        seen["metrics"] = {}
        for name, url in spec["scrape"].items():  # each role's /metrics, scraped from this (another) host
            with urllib.request.urlopen(url, timeout=10) as reply:
                samples = [line for line in reply.read().decode().splitlines() if line and line[0] != "#"]
            seen["metrics"][name] = [reply.status, len(samples)]
        client.close()

    config = RunConfig(**spec["config"])
    result = run_job(config, on_start=on_start, place=place)
    Path(result_path).write_text(json.dumps({"summaries": result.summaries, "faults": result.faults,
                                             "text": result.text, "seen": seen}, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:3])
