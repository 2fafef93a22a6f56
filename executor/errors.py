"""Errors of the rollout executor, under the project's exception root.

``Permanent`` failures fail a request at once (no rq retry): retrying cannot help (bad
data, a broken reward function, a deadline that has passed). Every other failure is
transient and the job is retried while it has retries left.
"""

from __future__ import annotations

from rollout_bus.events.errors import Failure


class RolloutError(Failure):
    """A rollout request could not be served."""


class Permanent(RolloutError):
    """Retrying the request cannot help; it fails at once."""


class PluginError(Permanent):
    """A plug-in path could not be loaded, or a plug-in does not have the expected shape."""


class DataError(Permanent):
    """The data source produced items that are not valid prompts.

    ``indices`` names them (None: unknown); those are dropped, the request's other prompts go back.
    """

    def __init__(self, message: str, indices: tuple[int, ...] | None = None) -> None:
        super().__init__(message)
        self.indices = indices


class RewardError(Permanent):
    """The reward function raised or returned something that is not a number."""


class FilterError(Permanent):
    """The dynamic sampling filter raised or returned something that is not a verdict."""


class DeadlineExceeded(Permanent):
    """The request's deadline passed before it was done."""


class NoServingEngine(DeadlineExceeded):
    """No engine served the policy before the deadline."""


class EngineRejected(Permanent):
    """An engine refused a generate call (HTTP 4xx): the request itself is wrong."""


class EnginesFailed(RolloutError):
    """Generate calls kept failing on every engine tried (transient: the job is retried)."""


class ForbiddenJob(Permanent):
    """An rq job that names a function or callback other than the project's own: never imported, never retried."""
