"""``rollout-bus scale engines --policy P --to N`` (or ``+K`` / ``-K``): grow or shrink a pool while the run goes on.

It sends a ``ScaleEngines`` command on the commands stream (a Redis user that may send commands: the
read-only ``status`` user may not) and follows the controller's ``EnginesScaled`` answers to it on the engine
stream: ``started`` (from and to), then ``done`` once every new engine serves the current weights and every
stopped one drained and stopped, ``failed`` when some did not, or ``refused`` with what to fix.
Exit status: 0 done, 1 failed or no answer in time, 2 bad input (a malformed count, a policy without a pool,
a size below 0 or above the pool's bound) or a command that could not be sent.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time
from typing import TYPE_CHECKING

from rollout_bus.events.errors import BusError, DecodeError, InvalidRequest, RedisCommandError
from rollout_bus.events.names import Keys, name_arg
from rollout_bus.events.schema import EnginesScaled, Producer, ScaleEngines, decode, scale_target

EXIT = {"done": 0, "failed": 1, "refused": 2}


if TYPE_CHECKING:
    from rollout_bus.events.connection import Redis


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollout-bus scale", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["engines"], help="what to scale")
    p.add_argument("change", nargs="?", default=None, metavar="+K|-K",
                   help="engines to add (+K) or remove (-K); or give --to")
    p.add_argument("--to", default=None, metavar="N|+K|-K", help="the pool's new size (or +K / -K)")
    p.add_argument("--policy", required=True, type=name_arg("policy"), help="the policy whose engine pool to scale")
    p.add_argument("--namespace", default=os.environ.get("ROLLOUT_BUS_NAMESPACE", "default"),
                   type=name_arg("namespace"))
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else redis://127.0.0.1:6379/0")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="how long to wait for the controller's last answer (engines start, drain and stop)")
    argv = list(sys.argv[1:] if argv is None else argv)
    # "-2" reads as an option to argparse: a signed count not given to --to is taken out first
    changes = [i for i, a in enumerate(argv) if re.fullmatch(r"[+-]\d+", a) and (i == 0 or argv[i - 1] != "--to")]
    change = [argv[i] for i in changes]
    args = p.parse_args([a for i, a in enumerate(argv) if i not in changes])
    if args.change is not None:
        change.append(args.change)
    if len(change) + (args.to is not None) != 1:
        p.error("give the new size as --to N, or a change as +K or -K (one of them)")
    args.count = args.to if args.to is not None else change[0]
    try:
        scale_target(args.count, 0)
    except InvalidRequest as exc:
        p.error(str(exc))
    if args.timeout_s <= 0:
        p.error("--timeout-s must be > 0")
    return args


def ask(client: Redis, keys: Keys, policy: str, count: str, timeout_s: float,
        echo: bool = True) -> tuple[int, list[EnginesScaled]]:
    """Send the command, follow its answers: (exit status, the answers)."""
    from rollout_bus.events.paging import page
    from rollout_bus.events.publish import Publisher

    producer = Producer("scale", f"{socket.gethostname()}-{os.getpid()}")
    command = ScaleEngines(producer=producer, policy=policy, count=count, request_id=f"scale-{os.urandom(6).hex()}")
    try:
        start = Publisher(client, keys, producer).publish(keys.command_stream, command)
    except RedisCommandError as exc:
        print(f"cannot send the command ({exc}): scaling writes the commands stream, which the read-only status "
              "user may not; use a user that may send commands", file=sys.stderr)
        return 2, []
    answers: list[EnginesScaled] = []
    deadline = time.monotonic() + timeout_s
    cursor = start.split("-")[0] + "-0"
    while time.monotonic() < deadline:
        for entry_id, fields in page(client, keys.engine_stream, cursor):
            cursor = "(" + entry_id
            try:
                event = decode(fields)
            except DecodeError:
                continue
            if not isinstance(event, EnginesScaled) or event.request_id != command.request_id:
                continue
            answers.append(event)
            if echo:
                print(describe(event), file=sys.stderr if event.outcome in ("refused", "failed") else sys.stdout)
            if event.outcome in EXIT:
                return EXIT[event.outcome], answers
        time.sleep(0.1)
    print(f"no final answer from the controller within {timeout_s:g} s (is one running?)", file=sys.stderr)
    return 1, answers


def describe(event: EnginesScaled) -> str:
    engines = f" ({', '.join(event.engine_ids)})" if event.engine_ids else ""
    reason = f": {event.reason}" if event.reason else ""
    return (f"{event.outcome}: {event.policy} {event.from_count} -> {event.to_count} engines{engines}, "
            f"asked by {event.requested_by}{reason}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rollout_bus.events.connection import connect

    client = connect(args.redis_url)
    try:
        status, _ = ask(client, Keys(args.namespace), args.policy, args.count, args.timeout_s)
    except BusError as exc:
        print(f"cannot reach Redis: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
