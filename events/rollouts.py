"""A rollout request: what a trainer asks the executors for, validated before it is queued.

The request travels as the single JSON argument of an rq job (``to_json``) and is
rebuilt strictly by the executor (``from_json``): an unknown or mistyped field is an
``InvalidRequest`` naming the field, never silently dropped. Its sizes have upper bounds
(``RequestBounds``), checked by the submitter and again by the executor.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.names import check_name

MAX_REQUEST_ID = 58
"""rq job ids take letters, digits, '_' and '-'; 58 so that the batch id "batch-<request_id>" fits in 64."""
_REQUEST_ID_RE = re.compile(rf"[A-Za-z0-9_\-]{{1,{MAX_REQUEST_ID}}}")
MIN_TEMPERATURE = 1e-4
"""The smallest sampling temperature above 0 (greedy) that a rollout request or an engine accepts: a
smaller one is 0 in float32, and sampling at it divides by zero. The CPU engine uses this value too."""


@dataclass(frozen=True)
class RequestBounds:
    """Upper bounds on what one rollout request may ask for: prompts reserved and drawn, samples and
    tokens an executor holds, the size of the batch it publishes. The defaults fit a 24 GiB host: at
    most 16,384 samples and 2**25 generated tokens per request (about 2.5 GiB of tokens and log-probs
    in an executor's lists)."""

    max_groups: int = 4096
    """``n_groups`` and ``over_sample_groups`` (prompts reserved per round)."""
    max_samples_per_group: int = 1024
    max_samples: int = 16384
    """Samples one sampling round draws: ``max(n_groups, over_sample_groups) * n_samples_per_group``."""
    max_new_tokens: int = 32768
    max_tokens: int = 2**25
    """Tokens one sampling round may generate: samples drawn times ``max_new_tokens``."""
    max_stop_token_ids: int = 256
    max_returned: int = 4096
    """Data-source items given back with a request (``returned``)."""

    def problems(self, request: RolloutRequest) -> list[str]:
        """What in ``request`` passes a bound, each naming the field and the bound (fields of the wrong
        type are reported by ``RolloutRequest.validate`` itself)."""
        out: list[str] = []

        def over(name: str, value: Any, bound: int, field_name: str) -> bool:
            if _int(value) and value > bound:
                out.append(f"{name} is {value}, over the bound {bound} (RequestBounds.{field_name})")
                return True
            return False

        over("n_groups", request.n_groups, self.max_groups, "max_groups")
        over("over_sample_groups", request.over_sample_groups, self.max_groups, "max_groups")
        over("n_samples_per_group", request.n_samples_per_group, self.max_samples_per_group,
             "max_samples_per_group")
        sampling = request.sampling if isinstance(request.sampling, SamplingParams) else None
        if sampling is not None:
            over("sampling.max_new_tokens", sampling.max_new_tokens, self.max_new_tokens, "max_new_tokens")
        if sampling is not None and isinstance(sampling.stop_token_ids, list | tuple):
            over("the number of sampling.stop_token_ids", len(sampling.stop_token_ids), self.max_stop_token_ids,
                 "max_stop_token_ids")
        if isinstance(request.returned, list):
            over("the number of returned items", len(request.returned), self.max_returned, "max_returned")
        drawn = [g for g in (request.n_groups, request.over_sample_groups) if g is not None and _int(g)]
        if drawn and _int(request.n_samples_per_group):
            samples = max(drawn) * request.n_samples_per_group
            if not over("samples per round (max(n_groups, over_sample_groups) * n_samples_per_group)", samples,
                        self.max_samples, "max_samples") and sampling is not None and _int(sampling.max_new_tokens):
                over("tokens per round (samples per round * sampling.max_new_tokens)",
                     samples * sampling.max_new_tokens, self.max_tokens, "max_tokens")
        return out


DEFAULT_BOUNDS = RequestBounds()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class SamplingParams:
    """The subset of SGLang's sampling parameters a rollout sets."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()

    def problems(self) -> list[str]:
        out: list[str] = []
        if not _number(self.temperature) or not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= 100.0):
            out.append(f"sampling.temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE}, 100], "
                       f"got {self.temperature!r}"[:300])
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            out.append(f"sampling.top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            out.append(f"sampling.top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not _int(self.max_new_tokens) or self.max_new_tokens < 1:
            out.append(f"sampling.max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.stop_token_ids, list | tuple) or not all(_int(t) and t >= 0 for t in self.stop_token_ids):
            out.append(f"sampling.stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"[:300])
        return out

    def to_sglang(self) -> dict[str, Any]:
        """``sampling_params`` of a ``/generate`` call."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_new_tokens, "stop_token_ids": list(self.stop_token_ids)}


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout: ``n_groups`` prompts, ``n_samples_per_group`` samples each, for ``policy``."""

    policy: str
    rollout_id: int
    n_groups: int
    n_samples_per_group: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    deadline_ms: int | None = None
    """Unix time in ms after which the request fails; None: only the job timeout bounds it."""
    data: dict[str, Any] = field(default_factory=dict)
    """Options for the data source (merged over the executor's configured ones)."""
    eval: bool = False
    over_sample_groups: int | None = None
    """Groups drawn per sampling round (>= n_groups); the round stops once n_groups are kept."""
    std_normalise: bool = False
    """GRPO: divide each group's centred rewards by the group's std + eps."""
    returned: list[dict[str, Any]] = field(default_factory=list)
    """Data-source items the trainer gives back (the prompts of groups it dropped as stale): the
    executor returns them to the policy's data source the first time this request draws
    prompts, exactly once whatever the retries, and they go out first. Each needs an
    integer ``index``."""
    agent: str = ""
    """Agent episodes (an executor started with ``--agent``): empty, the executor runs its agent on each
    sample; ``external``, it opens the sessions and hands them out to external agent processes (claimed
    through a gateway's ``POST /sessions/claim``), then waits for each to be closed with its reward."""
    agent_timeout_s: float = 600.0
    """How long an external agent has to close a session before it is recorded as abandoned."""

    @classmethod
    def create(cls, policy: str, rollout_id: int, n_groups: int, n_samples_per_group: int, *,
               timeout_s: float | None = None, **kwargs: Any) -> RolloutRequest:
        """A request whose deadline is ``timeout_s`` seconds from now (or ``deadline_ms`` if given)."""
        if timeout_s is not None:
            if "deadline_ms" in kwargs:
                raise InvalidRequest("give either timeout_s or deadline_ms, not both")
            kwargs["deadline_ms"] = now_ms() + int(timeout_s * 1000)
        return cls(policy=policy, rollout_id=rollout_id, n_groups=n_groups,
                   n_samples_per_group=n_samples_per_group, **kwargs)

    # --- identity ------------------------------------------------------------------------
    @property
    def batch_id(self) -> str:
        """The id of the one batch this request may produce, whatever attempt produces it."""
        return f"batch-{self.request_id}"

    @property
    def n_samples(self) -> int:
        return self.n_groups * self.n_samples_per_group

    def remaining_s(self, at_ms: int | None = None) -> float | None:
        if self.deadline_ms is None:
            return None
        return (self.deadline_ms - (at_ms if at_ms is not None else now_ms())) / 1000.0

    # --- validation ----------------------------------------------------------------------
    def validate(self, known_policies: Collection[str] | None = None, *, check_deadline: bool = True,
                 at_ms: int | None = None, bounds: RequestBounds = DEFAULT_BOUNDS) -> None:
        """Raise ``InvalidRequest`` listing everything to fix.

        ``known_policies`` None skips the policy check; ``check_deadline`` False accepts a deadline
        that has passed (an executor fails such a request with ``DeadlineExceeded`` instead).
        """
        problems: list[str] = []
        try:
            check_name("policy", self.policy)
        except ValueError as exc:
            problems.append(str(exc))
        else:
            if known_policies is not None and self.policy not in known_policies:
                known = ", ".join(sorted(known_policies)) or "none"
                problems.append(f"unknown policy {self.policy!r} (known: {known})")
        if not isinstance(self.request_id, str) or not _REQUEST_ID_RE.fullmatch(self.request_id):
            problems.append(f"request_id {self.request_id!r} must be 1-58 letters, digits, '_' or '-' (it is the rq job id)")
        if not _int(self.rollout_id) or self.rollout_id < 0:
            problems.append(f"rollout_id must be a non-negative integer, got {self.rollout_id!r}")
        for name in ("n_groups", "n_samples_per_group"):
            value = getattr(self, name)
            if not _int(value) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if self.over_sample_groups is not None and (
                not _int(self.over_sample_groups) or not _int(self.n_groups)
                or self.over_sample_groups < self.n_groups):
            problems.append(f"over_sample_groups must be an integer >= n_groups ({self.n_groups!r}), "
                            f"got {self.over_sample_groups!r}")
        if not isinstance(self.sampling, SamplingParams):
            problems.append("sampling must be SamplingParams")
        else:
            problems += self.sampling.problems()
        problems += bounds.problems(self)
        if self.deadline_ms is not None:
            if not _int(self.deadline_ms):
                problems.append(f"deadline_ms must be an integer (unix ms), got {self.deadline_ms!r}")
            elif check_deadline and self.deadline_ms <= (at_ms if at_ms is not None else now_ms()):
                ago = ((at_ms if at_ms is not None else now_ms()) - self.deadline_ms) / 1000.0
                problems.append(f"deadline_ms is {ago:.3f}s in the past: give a later deadline or a timeout")
        if not isinstance(self.data, dict) or not all(isinstance(k, str) for k in self.data):
            problems.append("data must be a map with string keys")
        if not isinstance(self.returned, list) or not all(
                isinstance(it, dict) and _int(it.get("index")) and all(isinstance(k, str) for k in it)
                for it in self.returned):
            problems.append("returned must be a list of data-source items (maps with an integer 'index')")
        for name in ("eval", "std_normalise"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false")
        if self.agent not in AGENT_MODES:
            problems.append(f"agent must be one of {AGENT_MODES}, got {self.agent!r}")
        if (isinstance(self.agent_timeout_s, bool) or not isinstance(self.agent_timeout_s, int | float)
                or not 0 < self.agent_timeout_s <= 86400):
            problems.append(f"agent_timeout_s must be a number of seconds in (0, 86400], got {self.agent_timeout_s!r}")
        if problems:
            raise InvalidRequest("invalid rollout request: " + "; ".join(problems))

    # --- wire ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["sampling"]["stop_token_ids"] = list(self.sampling.stop_token_ids)
        return out

    @classmethod
    def from_json(cls, data: Any) -> RolloutRequest:
        """Strictly rebuild a request; ``InvalidRequest`` for unknown, missing or mistyped fields."""
        if not isinstance(data, dict):
            raise InvalidRequest(f"a rollout request must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequest(f"unknown rollout request field(s) {unknown}; known: {sorted(known)}")
        kwargs = dict(data)
        sampling = kwargs.get("sampling", {})
        if not isinstance(sampling, dict):
            raise InvalidRequest("sampling must be a JSON object")
        s_known = {f.name for f in fields(SamplingParams)}
        s_unknown = sorted(set(sampling) - s_known)
        if s_unknown:
            raise InvalidRequest(f"unknown sampling field(s) {s_unknown}; known: {sorted(s_known)}")
        stop = sampling.get("stop_token_ids", ())
        if not isinstance(stop, list | tuple):
            raise InvalidRequest("sampling.stop_token_ids must be a list of token ids")
        kwargs["sampling"] = SamplingParams(**{**sampling, "stop_token_ids": tuple(stop)})
        try:
            request = cls(**kwargs)
        except TypeError as exc:
            raise InvalidRequest(f"invalid rollout request: {exc}") from None
        return request


AGENT_MODES = ("", "external")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer too large for a float
        return False
