"""The only rq jobs an executor runs: the project's rollout job and its failure callback.

rq imports a job's function and callbacks from the dotted names stored in the job's hash, so
anyone who can write an ``rq:job:`` key (every role that queues requests) could otherwise have an
executor import and call any function (``os.system``). ``RolloutJob`` is the job class of the
executor's worker, queues and registries: it resolves only ``events.submit.JOB_FUNC`` (on a plain
function, no instance) and only ``FAILURE_CALLBACK`` as a callback. Any other name is never
imported: the function raises ``ForbiddenJob`` with the reason, and the callbacks are none.
"""

from __future__ import annotations

import logging
from typing import Any

from rq.job import Job

from rollout_bus.events.submit import FAILURE_CALLBACK, JOB_FUNC
from rollout_bus.executor.errors import ForbiddenJob

log = logging.getLogger(__name__)


def refusal(job: Job) -> str | None:
    """Why ``job`` must not run (None: it is a rollout job), read without importing anything."""
    try:
        func_name, instance = job.func_name, job.instance
    except Exception as exc:  # unreadable job data: a refusal, not a crash of the worker
        return f"job {job.id}: its data cannot be read ({type(exc).__name__}: {exc})"
    if func_name != JOB_FUNC or instance is not None:
        return f"job {job.id} names {func_name!r}: executors run only {JOB_FUNC}"
    callbacks = {"success": job._success_callback_name, "failure": job._failure_callback_name,
                 "stopped": job._stopped_callback_name}
    allowed = {"failure": FAILURE_CALLBACK}
    for kind, name in callbacks.items():
        if name and name != allowed.get(kind):
            return f"job {job.id} names {name!r} as its {kind} callback: only {FAILURE_CALLBACK} is run"
    return None


class RolloutJob(Job):
    """A job that resolves its function and callbacks only if they are the project's own."""

    @property
    def func(self) -> Any:
        reason = refusal(self)
        if reason is not None:
            raise ForbiddenJob(reason)
        return super().func

    @property
    def success_callback(self) -> Any:
        return None  # the rollout job has none; a name here is never imported

    @property
    def stopped_callback(self) -> Any:
        return None

    @property
    def failure_callback(self) -> Any:
        reason = refusal(self)
        if reason is not None:
            log.error("%s; its callbacks are not run", reason)
            return None
        return super().failure_callback
