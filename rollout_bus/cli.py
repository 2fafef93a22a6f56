"""The ``rollout-bus`` command: one entry point, a subcommand per role and tool.

    rollout-bus run           the main job: every role as a process, on a private Redis
    rollout-bus controller    the inference controller (engines, health, weights, offload)
    rollout-bus executor      one rollout executor (an rq worker); start more to scale
    rollout-bus gateway       the agent session gateway: OpenAI's API per session, exact tokens
    rollout-bus trainer       the reference trainer (``train``) or a recorder (``record``)
    rollout-bus record        the same as ``rollout-bus trainer record``
    rollout-bus request       queue one rollout request, optionally wait for it
    rollout-bus status        engines, policies, queues, consumer lag, dead letters
    rollout-bus scale         start or stop engines of a policy's pool while the run goes on
    rollout-bus replay        event logs: export, import, timeline, verify, feed, offline
    rollout-bus prepare-model a packaged GGUF model as a Hugging Face directory, offline

Each subcommand owns its flags and ``--help``; its module is imported only when it is
chosen, so ``rollout-bus <command> --help`` answers before torch or Redis clients load.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    module: str
    summary: str
    prefix: tuple[str, ...] = ()
    """Arguments put before the user's (``record`` is ``trainer record``)."""


COMMANDS: dict[str, Command] = {
    "run": Command("rollout_bus.launch.cli", "the main job: every role as a process, on a private Redis"),
    "controller": Command("rollout_bus.controller.cli", "the inference controller: engines, health, weights"),
    "executor": Command("rollout_bus.executor.cli", "one rollout executor (an rq worker); start more to scale"),
    "gateway": Command("rollout_bus.gateway.cli", "the agent session gateway: OpenAI's API per session"),
    "trainer": Command("rollout_bus.trainer.cli", "the reference GRPO trainer (train) or a recorder (record)"),
    "record": Command("rollout_bus.trainer.cli", "a passive recorder of one policy's batches", ("record",)),
    "request": Command("rollout_bus.request", "queue one rollout request, optionally wait for its outcome"),
    "status": Command("rollout_bus.status", "engines, policies, queues, consumer lag, dead letters"),
    "scale": Command("rollout_bus.scale", "start or stop engines of a policy's pool while the run goes on"),
    "replay": Command("rollout_bus.replay.cli", "event logs: export, import, timeline, verify, feed, offline"),
    "prepare-model": Command("rollout_bus.lm.prepare", "a packaged GGUF model as a Hugging Face directory, offline"),
}

ALIASES: dict[tuple[str, str], tuple[str, ...]] = {
    ("trainer", "offline"): ("replay", "offline"),
}
"""``rollout-bus trainer offline ...`` is ``rollout-bus replay offline ...``."""


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: rollout-bus <command> [options]   (rollout-bus <command> --help for its options)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    return "\n".join(lines)


def resolve(argv: Sequence[str]) -> tuple[Command, list[str]]:
    """The command ``argv`` names and the arguments its own ``main`` gets; ``SystemExit`` if none."""
    args = list(argv)
    if len(args) >= 2 and (args[0], args[1]) in ALIASES:
        args = [*ALIASES[(args[0], args[1])], *args[2:]]
    name = args[0]
    command = COMMANDS.get(name)
    if command is None:
        close = [c for c in COMMANDS if c.startswith(name[:3])]
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise SystemExit(f"rollout-bus: unknown command {name!r}{hint}\n\n{usage()}")
    return command, [*command.prefix, *args[1:]]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    if args[0] == "--version":
        from rollout_bus import __version__

        print(f"rollout-bus {__version__}")
        return 0
    command, rest = resolve(args)
    from rollout_bus.events.processes import watch_run

    watch_run()  # a role of a run stops when the run is gone (it also has the kernel's death signal)
    entry: Callable[[list[str]], int | None] = importlib.import_module(command.module).main
    from rollout_bus.events.errors import BusReset

    try:
        return int(entry(rest) or 0)
    except BusReset as exc:  # a role stopped because Redis lost the run's data: one line, its own status
        logging.getLogger("rollout_bus").error("%s: BusReset: %s", args[0], exc)
        return BusReset.exit_code


if __name__ == "__main__":
    sys.exit(main())
