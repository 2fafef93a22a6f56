"""Every Redis stream, key and queue name of the project, in one place.

All keys of one namespace share the Redis Cluster hash tag ``{namespace}`` so that
keys touched together (a stream, its dedupe keys, its payloads) sit in one slot and
can be used together in one Lua script or transaction.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_NAMESPACE = "default"
REGISTRY_GENERATION = "#gen"
"""A field of each registry hash counting its writes (never a record: no checked name starts with ``#``);
a reader that holds a snapshot re-reads the records only when it changed."""
NAME_MAX = 64
NAME_RULE = "1-64 letters, digits, '_' or '-', not starting with '-'"
"""The one grammar of every name that reaches a key, a path or an engine: namespaces, policies,
adapters (``<policy>@v<version>``), trainer, engine and group ids, request and batch ids.

Each place such a name reaches takes this grammar: peft's adapter names (a '.' breaks its module
dict: ``policy.v2@v1`` is a ``KeyError`` inside the engine), SGLang's adapter names (``base:adapter``
splits on ':'), file names (no separator, no leading '.'), Redis keys (':' separates their parts,
braces are the hash tag), rq job ids, and command lines (a leading '-' reads as an option)."""
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]{0,63}")
HOST_NAME_MAX = 255
_HOST_CHARS = _NAME_CHARS | {"."}
_HOST_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")
_WHY = {".": ": a '.' breaks peft's adapter names", ":": ": ':' separates Redis key parts and SGLang's adapter names",
        "/": ": '/' is a path separator", "\\": ": '\\' is a path separator", "{": ": braces are Redis hash tags",
        "}": ": braces are Redis hash tags", " ": ": no spaces"}


def name_problem(kind: str, value: object, *, host: bool = False) -> str | None:
    """Why ``value`` is not a valid ``kind`` name (None: it is), naming the first wrong character and its
    position (1-based). ``host`` takes a host-derived name (a producer's instance): '.' allowed, up to 255."""
    if isinstance(value, str) and (_HOST_RE if host else NAME_PATTERN).fullmatch(value):
        return None
    fault = name_fault(value, host=host)
    return f"{kind} {fault}" if not isinstance(value, str) or not value else f"{kind} {value[:80]!r}: {fault}"


def name_fault(value: object, *, host: bool = False) -> str:
    """What is wrong with ``value`` as a name (``name_problem`` without the kind and the value)."""
    chars, longest = (_HOST_CHARS, HOST_NAME_MAX) if host else (_NAME_CHARS, NAME_MAX)
    rule = f"1-{longest} letters, digits, '_', '.' or '-', not starting with '-' or '.'" if host else NAME_RULE
    if not isinstance(value, str):
        return f"must be a string ({rule}), not {type(value).__name__}"
    if not value:
        return f"must not be empty ({rule})"
    for position, ch in enumerate(value, 1):
        if ch not in chars or (position == 1 and ch in "-."):
            why = ": a name must not start with it" if position == 1 and ch in chars else _WHY.get(ch, "")
            return f"character {ch!r} at position {position} is not allowed{why} ({rule})"
    return f"has {len(value)} characters, more than {longest} ({rule})"


def check_name(kind: str, value: str) -> str:
    """``value`` when it is a valid ``kind`` name, else ``ValueError`` naming the wrong character."""
    problem = name_problem(kind, value)
    if problem is not None:
        raise ValueError(problem)
    return value


def name_arg(kind: str) -> Callable[[str], str]:
    """An argparse ``type`` for a ``kind`` name: a bad one is a usage error that names the wrong character."""
    def parse(value: str) -> str:
        problem = name_problem(kind, value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = kind  # argparse names the type in its messages
    return parse


ADAPTER_SEPARATOR = "@v"
"""Between a policy and its version in a LoRA adapter's name (``events.registry.adapter_name``)."""
_VERSION_DIGITS = 19


def adapter_name_problem(value: object) -> str | None:
    """Why ``value`` is not a LoRA adapter name an engine takes (None: it is). An adapter name is a name
    (``NAME_RULE``), or one made by ``events.registry.adapter_name``: ``<policy>@v<version>``, a policy
    name and a version of 1-19 digits; the message names the first wrong character and its position."""
    form = f"an adapter name is a name or <policy>{ADAPTER_SEPARATOR}<version>"
    if not isinstance(value, str) or not value:
        return f"lora_name {name_fault(value)}; {form}"
    policy, sep, version = value.rpartition(ADAPTER_SEPARATOR)
    if sep and version.isascii() and version.isdigit() and len(version) <= _VERSION_DIGITS:
        if NAME_PATTERN.fullmatch(policy):
            return None
        return f"lora_name {value[:80]!r}: {name_fault(policy)}; {form}"
    if NAME_PATTERN.fullmatch(value):
        return None
    return f"lora_name {value[:80]!r}: {name_fault(value)}; {form}"


@dataclass(frozen=True)
class Keys:
    """Names of every stream and key under one namespace."""

    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        check_name("namespace", self.namespace)

    @classmethod
    def from_env(cls) -> Keys:
        return cls(os.environ.get("ROLLOUT_BUS_NAMESPACE", DEFAULT_NAMESPACE))

    @property
    def prefix(self) -> str:
        return f"rb:{{{self.namespace}}}"

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    # --- event streams ---------------------------------------------------------------
    @property
    def engine_stream(self) -> str:
        """Engine lifecycle events, written by the controller."""
        return self._k("stream", "engines")

    def weight_stream(self, policy: str) -> str:
        """One policy's weights: its trainer's ``WeightsPublished`` and the controller's outcomes for it (applied,
        serving, failed, checked). One stream per policy, so that a trainer's ACL user may add to its own alone."""
        return self._k("stream", "weights", check_name("policy", policy))

    @property
    def legacy_weight_stream(self) -> str:
        """The single weights stream of every policy, before each had its own: nothing writes it any more; the
        controller still applies the ``WeightsPublished`` it holds (an event log from before, imported) for one
        release. It goes in the release after."""
        return self._k("stream", "weights")

    @property
    def command_stream(self) -> str:
        """Imperative commands to the controller (offload, onload)."""
        return self._k("stream", "commands")

    @property
    def rollout_stream(self) -> str:
        """Rollout request lifecycle events."""
        return self._k("stream", "rollouts")

    @property
    def trainer_stream(self) -> str:
        """Trainer events: joins, batches consumed, steps done."""
        return self._k("stream", "trainers")

    def batch_stream(self, policy: str) -> str:
        """BatchReady events of one policy; one consumer group per trainer."""
        return self._k("stream", "batches", check_name("policy", policy))

    @property
    def session_stream(self) -> str:
        """Agent session events (started, turn completed, closed), written by session gateways."""
        return self._k("stream", "sessions")

    @property
    def dead_letters(self) -> str:
        return self._k("stream", "dead-letters")

    @property
    def housekeeping_stream(self) -> str:
        """What the janitor removed: streams trimmed, payloads swept, groups expired."""
        return self._k("stream", "housekeeping")

    @property
    def scaling_stream(self) -> str:
        """Fleet scaling decisions with their inputs (``ExecutorsScaled``, written by the run's autoscaler)."""
        return self._k("stream", "scaling")

    @property
    def eval_stream(self) -> str:
        """Held-out evaluations of a policy's weights (``EvalCompleted``, from the executors)."""
        return self._k("stream", "evals")

    def event_streams(self) -> list[str]:
        """The streams of fixed name (the legacy weights stream among them); a policy's batch and weight streams are
        found by their patterns (``events.paging.discover_streams``)."""
        return [self.engine_stream, self.legacy_weight_stream, self.command_stream, self.rollout_stream,
                self.trainer_stream, self.housekeeping_stream, self.session_stream, self.scaling_stream,
                self.eval_stream]

    # --- keys ------------------------------------------------------------------------
    def dedupe(self, stream: str, key: str) -> str:
        """Idempotency key of one publish to ``stream``.

        Named after the whole stream name below the prefix (``stream:batches:<policy>``), not its
        last part, so that a policy called ``rollouts`` does not share dedupe keys with the rollout stream.
        """
        return self._k("dedupe", self._local(stream), key)

    def payload(self, ref: str) -> str:
        return self._k("payload", ref)

    def payload_chunk(self, ref: str, index: int) -> str:
        """Chunk ``index`` of the payload ``ref`` as the redis store splits it: chunk 0 (with the
        batch header) is ``payload(ref)`` itself, chunk ``i`` is ``payload(ref):i``."""
        return self.payload(ref) if index == 0 else self._k("payload", ref, str(index))

    def payload_readers(self, ref: str) -> str:
        """Set of groups that still have to read the payload ``ref``."""
        return self._k("payload-readers", ref)

    @property
    def payload_index(self) -> str:
        """Sorted set of live payload refs by creation time (ms), for ``BatchChannel.delete_expired``."""
        return self._k("payload-index")

    @property
    def payload_stores(self) -> str:
        """Hash ref -> where the payload lives (store kind, root, host), beside ``payload_index``."""
        return self._k("payload-stores")

    def registered_groups(self, stream: str) -> str:
        """Set of consumer groups that must read every entry of ``stream`` (retention, payloads)."""
        return self._k("groups", self._local(stream))

    def group_hosts(self, stream: str) -> str:
        """Hash group -> the host its consumers run on (a same-host store, shm, checks it before a publish)."""
        return self._k("groups", "hosts", self._local(stream))

    def group_beats(self, stream: str) -> str:
        """Sorted set group -> the time (ms, Redis clock) its registration lapses unless a consumer beats."""
        return self._k("group-beats", self._local(stream))

    def group_ttls(self, stream: str) -> str:
        """Hash group -> the TTL (ms) its consumers beat with: the janitor's liveness test uses it."""
        return self._k("group-beats", "ttl", self._local(stream))

    def expired_groups(self, stream: str) -> str:
        """Hash group -> where the janitor found it when it expired it (JSON: ``resume_after``, ``expired_ms``);
        a consumer of that group that comes back resumes there."""
        return self._k("groups", "expired", self._local(stream))

    def _local(self, stream: str) -> str:
        """``stream`` without this namespace's prefix (a foreign name is kept whole)."""
        head = self.prefix + ":"
        return stream[len(head):] if stream.startswith(head) else stream

    @property
    def bus_epoch(self) -> str:
        """A random id written once when the namespace is first used; if it vanishes, Redis lost the run's data."""
        return self._k("epoch")

    @property
    def durability_status(self) -> str:
        """Hash writer -> JSON of a durable write its replicas have not confirmed yet (``rollout-bus status``)."""
        return self._k("durability")

    @property
    def engine_registry(self) -> str:
        """Hash engine_id -> msgpack record (url, state, versions, load), owned by the controller."""
        return self._k("engines")

    @property
    def policy_registry(self) -> str:
        """Hash policy -> msgpack record (published and serving versions)."""
        return self._k("policies")

    @property
    def producer_seqs(self) -> str:
        """Hash ``role/instance`` -> the last sequence number given to that producer's events (the publish
        scripts give out the next one as they append an event; never reset, so a restarted producer of the
        same name goes on)."""
        return self._k("seqs")

    @property
    def controller_lease(self) -> str:
        return self._k("lease", "controller")

    @property
    def controller_fence(self) -> str:
        """The fencing token: incremented by every controller that takes the lease, never reset."""
        return self._k("lease", "controller", "fence")

    @property
    def controller_fence_holder(self) -> str:
        """The owner that got the current fencing token: a registry write of the same token from anyone else is
        refused (two holders of one number, after Redis lost the tail of its log)."""
        return self._k("lease", "controller", "fence", "holder")

    @property
    def controller_fence_run(self) -> str:
        """The run id of the Redis server that handed out the current fencing token: a token taken on another run
        (Redis restarted or failed over, and may have lost its last writes) is folded with the clock
        (``controller.lease``)."""
        return self._k("lease", "controller", "fence", "run")

    def trainer_lease(self, policy: str) -> str:
        """Hash of the trainer ranks holding ``policy`` (one active trainer per policy)."""
        return self._k("lease", "trainer", check_name("policy", policy))

    def data_cursor(self, policy: str, source: str) -> str:
        """Saved state of one executor data source."""
        return self._k("cursor", check_name("policy", policy), source)

    def session(self, sid: str) -> str:
        """One agent session's state and journal (``events.sessions``)."""
        return self._k("session", check_name("session id", sid))

    def session_busy(self, sid: str) -> str:
        """The lock held by the call a session is serving."""
        return self._k("session-busy", check_name("session id", sid))

    def sessions_offered(self, policy: str) -> str:
        """Sessions of ``policy`` waiting for an external agent to claim them."""
        return self._k("sessions-offered", check_name("policy", policy))

    # --- rq queues (rq adds its own ``rq:queue:`` prefix) -------------------------------
    @property
    def rollout_queue(self) -> str:
        return f"rb.{self.namespace}.rollouts"

    @property
    def eval_queue(self) -> str:
        return f"rb.{self.namespace}.eval"


def publication_key(policy: str, version: int) -> str:
    """The idempotency key of ``WeightsPublished`` for ``policy`` v``version`` (one entry per version): a
    trainer restarted mid-publish adds no second entry; the controller drops the key when it refuses the
    version for good, so the version can be announced again once the cause is fixed."""
    return f"weights.{policy}.{version}"


# --- logical stream names: a stream named without its namespace (logs, metrics) ---------------

BATCHES = "batches/"
"""Prefix of the logical name of a policy's batch stream: ``batches/<policy>``."""
WEIGHTS = "weights/"
"""Prefix of the logical name of a policy's weight stream: ``weights/<policy>`` (``weights`` alone is the legacy
stream of every policy, ``Keys.legacy_weight_stream``)."""


def _fixed_streams(keys: Keys) -> dict[str, str]:
    return {
        "engines": keys.engine_stream, "weights": keys.legacy_weight_stream, "commands": keys.command_stream,
        "rollouts": keys.rollout_stream, "trainers": keys.trainer_stream, "dead-letters": keys.dead_letters,
        "housekeeping": keys.housekeeping_stream, "sessions": keys.session_stream, "scaling": keys.scaling_stream,
        "evals": keys.eval_stream,
    }


def logical_stream(keys: Keys, key: str) -> str:
    """The namespace-free name of stream ``key`` (``engines``, ``batches/p0``...)."""
    for name, stream in _fixed_streams(keys).items():
        if stream == key:
            return name
    policy = key.rsplit(":", 1)[-1]
    if name_problem("policy", policy) is None:
        if keys.batch_stream(policy) == key:
            return BATCHES + policy
        if keys.weight_stream(policy) == key:
            return WEIGHTS + policy
    raise ValueError(f"{key!r} is not a stream of namespace {keys.namespace!r}")


def stream_key(keys: Keys, logical: str) -> str:
    """The Redis key of logical stream ``logical`` in ``keys``' namespace."""
    if logical.startswith(BATCHES):
        return keys.batch_stream(logical[len(BATCHES):])
    if logical.startswith(WEIGHTS):
        return keys.weight_stream(logical[len(WEIGHTS):])
    try:
        return _fixed_streams(keys)[logical]
    except KeyError:
        raise ValueError(f"unknown logical stream {logical!r}") from None


def batch_stream_pattern(keys: Keys) -> str:
    """A SCAN pattern matching every batch stream of the namespace."""
    probe = keys.batch_stream("_")
    return probe[: -len("_")] + "*"


def weight_stream_pattern(keys: Keys) -> str:
    """A SCAN pattern matching every policy's weight stream of the namespace (not the legacy one)."""
    probe = keys.weight_stream("_")
    return probe[: -len("_")] + "*"


def weight_stream_policy(keys: Keys, key: str) -> str | None:
    """The policy whose weight stream ``key`` is; None for any other key (the legacy stream included)."""
    head = keys.weight_stream("_")[: -len("_")]
    policy = key[len(head):] if key.startswith(head) else ""
    return policy if name_problem("policy", policy) is None else None
