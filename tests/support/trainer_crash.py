"""A trainer process that SIGKILLs itself right after one step's checkpoint, before the ack.

``python -m tests.support.trainer_crash STEP <rollout-bus trainer train arguments>``: the
reference trainer with an ``after_checkpoint`` hook, so fault tests can crash it at the one
moment a random kill rarely hits (checkpoint written, batch not yet acked).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable

from rollout_bus.trainer import cli
from rollout_bus.trainer.checkpoint import TrainerState
from rollout_bus.trainer.service import Trainer

log = logging.getLogger("trainer_crash")


def crash_after(step: int) -> Callable[[TrainerState], None]:
    def hook(state: TrainerState) -> None:
        if state.step == step:
            log.warning("SIGKILL after the checkpoint of step %d, before its ack", step)
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


def main(argv: list[str]) -> int:
    step, rest = int(argv[0]), argv[1:]
    ns = cli.parse(rest)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def setup(trainer: Trainer) -> None:
        trainer.after_checkpoint.append(crash_after(step))
    return cli.run_trainer(ns, setup)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
