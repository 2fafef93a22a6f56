"""A consumer process for fault tests: runs one ``Consumer`` until SIGTERM.

For every entry it handles it adds the id to the Redis set ``--record``, appends
``<name> <id>`` to the Redis list ``--record``:log, then sleeps ``--sleep-ms`` so
that it holds entries long enough to be killed while holding them.

    python tests/support/consumer_proc.py --url redis://... --namespace ns --stream S \
        --group g --name a --record rb:{ns}:processed
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollout_bus.events.connection import connect  # noqa: E402
from rollout_bus.events.consume import Consumer, ConsumerConfig, Message  # noqa: E402
from rollout_bus.events.names import Keys  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--stream", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--record", required=True, help="Redis set of handled entry ids")
    p.add_argument("--sleep-ms", type=float, default=0.0)
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--block-ms", type=int, default=100)
    p.add_argument("--claim-idle-ms", type=int, default=500)
    p.add_argument("--claim-every-ms", type=int, default=100)
    p.add_argument("--max-deliveries", type=int, default=5)
    p.add_argument("--group-ttl-s", type=float, default=900.0)
    p.add_argument("--start-id", default="0", help="where a new group starts (the trainer's is $)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name} %(levelname)s %(message)s")

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = connect(args.url)
    config = ConsumerConfig(block_ms=args.block_ms, count=args.count, claim_idle_ms=args.claim_idle_ms,
                            claim_every_ms=args.claim_every_ms, max_deliveries=args.max_deliveries,
                            group_ttl_s=args.group_ttl_s, start_id=args.start_id)
    consumer = Consumer(client, Keys(args.namespace), args.stream, args.group, args.name, config)
    consumer.ensure_group()

    def handle(msg: Message) -> None:
        pipe = client.pipeline(transaction=True)
        pipe.sadd(args.record, msg.id)
        pipe.rpush(args.record + ":log", f"{args.name} {msg.id}")
        pipe.execute()
        time.sleep(args.sleep_ms / 1000)

    consumer.run(handle, stop)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
