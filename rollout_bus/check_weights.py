"""``rollout-bus status --check-weights``: ask the controller to check every engine's weights, print the answers.

It sends a ``CheckWeights`` command on the commands stream (so it needs a Redis user that may write it:
the read-only ``status`` user may not) and reads the controller's ``WeightsChecked`` answers to it from
every policy's weight stream, until the one that closes the request (``done``, or ``refused`` with the reason).
Exit status: 0 every checked engine matches, 1 a mismatch (that engine left the serving set) or no
answer in time, 2 bad input (an engine id the registry does not know) or a refused command.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Sequence

from rollout_bus.events.connection import Redis
from rollout_bus.events.errors import DecodeError, RedisCommandError
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page, weight_streams
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import Registry
from rollout_bus.events.schema import CheckWeights, Producer, WeightsChecked, decode

CLOSING = ("done", "refused")


def ask(client: Redis, keys: Keys, engine_ids: Sequence[str] | None, timeout_s: float) -> tuple[int, list[WeightsChecked]]:
    """Send the check, wait for its answers: (exit status, the answers)."""
    if engine_ids:
        known = Registry(client, keys).engines()
        unknown = sorted(set(engine_ids) - set(known))
        if unknown:
            print(f"--engine: unknown engine ids {unknown}; the registry knows {sorted(known)}", file=sys.stderr)
            return 2, []
    producer = Producer("status", f"{socket.gethostname()}-{os.getpid()}")
    command = CheckWeights(producer=producer, request_id=f"check-{os.urandom(6).hex()}",
                           engine_ids=list(engine_ids) if engine_ids else None)
    try:
        start = Publisher(client, keys, producer).publish(keys.command_stream, command)
    except RedisCommandError as exc:
        print(f"cannot send the check ({exc}): --check-weights writes the commands stream, which the read-only "
              "status user may not; use a user that may send commands", file=sys.stderr)
        return 2, []
    answers: list[WeightsChecked] = []
    deadline = time.monotonic() + timeout_s
    start_at = start.split("-")[0] + "-0"
    cursors: dict[str, str] = {}
    closing: WeightsChecked | None = None
    while time.monotonic() < deadline:
        # the answers go on each policy's weight stream, the close on the base policy's: once the close is seen,
        # one more pass takes every answer (each was written before it)
        final = closing is not None
        for stream in weight_streams(client, keys, legacy=False):
            for entry_id, fields in page(client, stream, cursors.get(stream, start_at)):
                cursors[stream] = "(" + entry_id
                try:
                    event = decode(fields)
                except DecodeError:
                    continue
                if not isinstance(event, WeightsChecked) or event.request_id != command.request_id:
                    continue
                if event.outcome in CLOSING:
                    closing = event
                else:
                    answers.append(event)
        if closing is not None and closing.outcome == "refused":
            print(f"the controller refused the check: {closing.reason}", file=sys.stderr)
            return 2, answers
        if closing is not None and final:
            return (1 if any(a.outcome == "mismatch" for a in answers) else 0), answers
        if closing is None:
            time.sleep(0.1)
    print(f"no complete answer from the controller within {timeout_s:g} s (is one running?)", file=sys.stderr)
    return 1, answers


def render(answers: Sequence[WeightsChecked]) -> str:
    from rollout_bus.replay.timeline import format_table

    return "WEIGHTS\n" + format_table(
        ["engine", "policy", "version", "outcome", "expected", "actual", "reason"],
        [[a.engine_id, a.policy, a.version, a.outcome, a.expected[:16] or "-", a.actual[:16] or "-", a.reason or "-"]
         for a in sorted(answers, key=lambda a: (a.engine_id, a.policy))])
