"""A trainer process that stops itself with SIGSTOP in the middle of its first step.

``python -m tests.support.trainer_pause <rollout-bus trainer train arguments>``: the reference
trainer, whose first ``train_step`` returns only after the process was stopped and continued, so a
fault test can hold it past its lease at the moment that matters (the step computed, nothing of
it written yet) and then let it go on. It logs ``paused mid-step`` just before it stops.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

from rollout_bus.trainer import cli
from rollout_bus.trainer.learner import Learner

log = logging.getLogger("trainer_pause")


def main(argv: list[str]) -> int:
    ns = cli.parse(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train_step = Learner.train_step
    paused: list[bool] = []

    def step_then_stop(self: Learner, data: Any) -> dict[str, float]:
        metrics = train_step(self, data)
        if not paused:
            paused.append(True)
            log.warning("paused mid-step: SIGSTOP to pid %d", os.getpid())
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGSTOP)
            log.warning("continued after the pause")
        return metrics

    Learner.train_step = step_then_stop  # type: ignore[method-assign]
    return cli.run_trainer(ns)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
