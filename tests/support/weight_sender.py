"""A trainer's weight publisher and sender in a process of its own (``trainer.broadcast``), for fault tests.

``python -m tests.support.weight_sender --redis URL --namespace NS --root ROOT --base DIR --versions 3,4
--status FILE`` saves each version (a seeded TinyLM of the base's config) under ROOT, publishes it with
its offer by collective, and serves the controller's requests; it publishes the next version once the
previous one was sent or given up on. ``--bucket-delay-s`` sleeps before each bucket after the first, so
a test can act mid-broadcast; ``--hang-after N`` stops answering (sleeps) after bucket N of the first
version, as a trainer that hangs. ``--gate DIR``: publish each version after the first only once the file
``DIR/go-v<version>`` exists, so a test can look at the engines on one version before the next one comes.
``FILE`` holds JSON: the store's address, the buckets sent of the
current version, and the versions sent and failures so far (written after every change).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from rollout_bus.events.connection import connect
from rollout_bus.events.names import Keys
from rollout_bus.events.schema import Producer
from rollout_bus.lm.model import build_model, load_config
from rollout_bus.trainer.broadcast import Offer, WeightSender
from rollout_bus.trainer.weights import WeightPublisher


class TestSender(WeightSender):
    def __init__(self, *args: Any, status: Path, delay_s: float, hang_after: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.status = status
        self.delay_s = delay_s
        self.hang_after = hang_after
        self.buckets_sent = 0
        self.current = -1

    def write(self) -> None:
        data = {"address": self.address, "pid": os.getpid(), "version": self.current,
                "buckets_sent": self.buckets_sent, "sent": [s.version for s in self.sent], "failures": self.failures}
        tmp = self.status.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.status)

    def send_bucket(self, pg: Any, offer: Offer, index: int) -> None:
        if index and self.delay_s:
            time.sleep(self.delay_s)
        if 0 <= self.hang_after <= index:
            time.sleep(3600)
        super().send_bucket(pg, offer, index)
        self.buckets_sent = index + 1
        self.write()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--base", required=True)
    parser.add_argument("--versions", required=True)
    parser.add_argument("--status", required=True)
    parser.add_argument("--policy", default="default")
    parser.add_argument("--bucket-kb", type=float, default=64.0)
    parser.add_argument("--bucket-delay-s", type=float, default=0.0)
    parser.add_argument("--hang-after", type=int, default=-1)
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--gate", default=None, help="publish version v (after the first) once DIR/go-v<v> exists")
    ns = parser.parse_args()
    client = connect(ns.redis)
    keys = Keys(ns.namespace)
    sender = TestSender(client, keys, ns.policy, bucket_bytes=int(ns.bucket_kb * 1024), timeout_s=ns.timeout_s,
                        status=Path(ns.status), delay_s=ns.bucket_delay_s, hang_after=ns.hang_after)
    publisher = WeightPublisher(client, keys, ns.policy, ns.root, Producer("trainer", "test-sender"), sender=sender)
    sender.write()
    sender.start()
    config = load_config(Path(ns.base))
    for i, version in enumerate(int(v) for v in ns.versions.split(",")):
        while i and ns.gate is not None and not (Path(ns.gate) / f"go-v{version}").exists():
            time.sleep(0.02)
        sender.current, sender.buckets_sent = version, 0
        done = len(sender.sent) + len(sender.failures)
        publisher.publish(build_model(config, seed=version), version)
        sender.write()
        while len(sender.sent) + len(sender.failures) == done:
            time.sleep(0.02)
        sender.hang_after = -1
        sender.write()
    while True:  # keep the store up: the test stops the process
        time.sleep(1.0)


if __name__ == "__main__":
    main()
