"""The wire schema of every event: typed, versioned, msgpack-encoded.

An event is a frozen dataclass. On the wire it is one stream field, ``e``, holding a
msgpack map of the common header (``event_id``, ``type``, ``schema_version``,
``ts_ms``, ``producer``, ``seq``) and the event's own fields. ``decode`` checks the type, the
schema version and every field's presence and type, and raises ``DecodeError``
carrying the raw entry for anything else; no other exception escapes it.

``seq`` (schema version 2) numbers the events of one producer (its ``role/instance`` name), from 1,
in the order they were published: the publish script gives it out when it appends the entry
(``seq_slot``; ``events.publish``), so a deduplicated publish takes no number, a producer restarted
under the same name goes on from its last one, and a gap or a repeat in a log is a lost or doubled
event. Entry ids order events of different streams only to the millisecond, and a producer's
sequence numbers order its own events within one. An event not published yet has ``seq`` 0, and
so do events of schema version 1 (no ``seq``), which still decode. Fields that name
things other roles turn into keys or paths (policy, batch, request, trainer, engine, group)
must be safe names (``SAFE_ID``) or empty; anything else is a ``DecodeError``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union

import msgpack

from rollout_bus.events.errors import DecodeError, InvalidRequest
from rollout_bus.events.names import NAME_PATTERN, name_fault, name_problem

SCHEMA_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
FIELD = b"e"
_FIELD_STR = FIELD.decode()
MAX_EVENT_BYTES = 1 << 20

E = TypeVar("E", bound="Event")
_REGISTRY: dict[str, type[Event]] = {}
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}

SAFE_ID = NAME_PATTERN
"""The one name grammar (``events.names``): safe as a key part, a path component, an adapter name."""
ID_FIELDS = frozenset({"policy", "batch_id", "request_id", "trainer_id", "engine_id", "group", "session_id"})
"""Event fields that other roles may turn into keys or file names: ``SAFE_ID`` or empty, checked at decode."""


@dataclass(frozen=True)
class Producer:
    role: str
    instance: str

    def __str__(self) -> str:
        return f"{self.role}/{self.instance}"


def _new_id() -> str:
    """128 random bits as 32 hex digits, like ``uuid4().hex`` at a third of the cost (no UUID object)."""
    return os.urandom(16).hex()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, kw_only=True)
class Event:
    """Common header; subclasses add their own fields.

    ``seq`` is 0 until the event is published, when the publish script gives it the producer's next
    number in the stored entry; a decoded event has the one it was published with (0 for schema
    version 1).
    """

    producer: Producer
    event_id: str = field(default_factory=_new_id)
    ts_ms: int = field(default_factory=_now_ms)
    seq: int = 0
    schema_version: ClassVar[int] = SCHEMA_VERSION
    since_version: ClassVar[int] = 1
    """The first schema version that has this event type."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.__name__] = cls

    def __post_init__(self) -> None:
        if self.seq < 0:
            raise ValueError(f"seq must be >= 0, got {self.seq}")

    @property
    def type(self) -> str:
        return type(self).__name__

    def to_dict(self) -> dict[str, Any]:
        cls = type(self)
        names = _FIELD_NAMES.get(cls)
        if names is None:
            names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(self))
        # ``seq`` first: the publish script finds its value at a fixed place (``seq_slot``)
        out: dict[str, Any] = {"seq": 0, "type": cls.__name__, "schema_version": self.schema_version}
        values = self.__dict__  # a plain dataclass: every field is in it
        for name in names:
            out[name] = values[name]
        producer = self.producer
        out["producer"] = {"role": producer.role, "instance": producer.instance}
        return out


# --- engines ---------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class EngineLaunching(Event):
    engine_id: str
    url: str
    backend: str
    managed: bool = True


@dataclass(frozen=True, kw_only=True)
class EngineReady(Event):
    """The engine answers health checks; it still has to receive weights before serving."""

    engine_id: str
    url: str


@dataclass(frozen=True, kw_only=True)
class EngineServing(Event):
    """The engine serves the latest weights of every policy and takes rollout traffic."""

    engine_id: str
    url: str
    versions: dict[str, int]


@dataclass(frozen=True, kw_only=True)
class EngineUnhealthy(Event):
    engine_id: str
    reason: str
    failures: int


@dataclass(frozen=True, kw_only=True)
class EngineRestarting(Event):
    engine_id: str
    attempt: int


@dataclass(frozen=True, kw_only=True)
class EngineStopped(Event):
    engine_id: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class EngineDraining(Event):
    """The engine left the serving set (executors stop choosing it); it stops once its requests in flight end."""

    engine_id: str
    reason: str
    since_version: ClassVar[int] = 2


@dataclass(frozen=True, kw_only=True)
class EnginesScaled(Event):
    """A change of a pool's size, asked for by ``requested_by`` (a producer, ``role/instance``): ``started``
    when the controller begins it, ``done`` once every started engine serves and every stopped one is gone,
    ``failed`` when some did not (``reason``), ``refused`` for a bad ``ScaleEngines`` (``reason`` says what to
    fix; the counts are the pool's, unchanged). ``engine_ids``: the engines started or stopped."""

    policy: str
    requested_by: str
    from_count: int
    to_count: int
    outcome: str
    reason: str = ""
    engine_ids: list[str] = field(default_factory=list)
    request_id: str = ""
    since_version: ClassVar[int] = 2


@dataclass(frozen=True, kw_only=True)
class EngineOffloaded(Event):
    engine_id: str
    tags: list[str]


@dataclass(frozen=True, kw_only=True)
class EngineOnloaded(Event):
    engine_id: str
    tags: list[str]


# --- controller commands (imperative) -----------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class OffloadEngines(Event):
    """Release engine memory by tag: the engines ``engine_ids``, else those of ``policy``'s pool, else every
    one. With a ``request_id`` the controller answers with a ``CommandDone`` on the engine stream."""

    tags: list[str]
    engine_ids: list[str] | None = None
    policy: str = ""
    request_id: str = ""


@dataclass(frozen=True, kw_only=True)
class OnloadEngines(Event):
    """Resume released engine memory by tag (targets and answer as ``OffloadEngines``)."""

    tags: list[str]
    engine_ids: list[str] | None = None
    policy: str = ""
    request_id: str = ""


@dataclass(frozen=True, kw_only=True)
class CommandDone(Event):
    """The controller's answer to an offload or onload command that carried a ``request_id``: ``outcome``
    ``ok`` (every targeted engine did it, or had nothing to do), ``refused`` (the command was bad, or an
    engine refused: ``reason``) or ``failed``; ``results``: engine id -> what happened there."""

    request_id: str
    command: str
    outcome: str
    reason: str = ""
    results: dict[str, str] = field(default_factory=dict)
    duration_ms: float = 0.0
    since_version: ClassVar[int] = 2


@dataclass(frozen=True, kw_only=True)
class ScaleEngines(Event):
    """Start or stop engines of ``policy``'s pool while the run goes on: ``count`` is ``N`` (to N engines),
    ``+K`` or ``-K`` (see ``scale_target``). The controller answers with ``EnginesScaled`` events carrying
    ``request_id`` on the engine stream."""

    policy: str
    count: str
    request_id: str = ""
    since_version: ClassVar[int] = 2


def scale_target(count: str, current: int) -> int:
    """The pool size ``count`` asks for when the pool has ``current`` engines: ``N`` is N, ``+K`` is
    current + K, ``-K`` is current - K (may be negative: the caller checks bounds). ``InvalidRequest``
    for anything else."""
    text = count.strip() if isinstance(count, str) else ""
    sign, digits = (text[0], text[1:]) if text[:1] in ("+", "-") else ("", text)
    if not digits.isascii() or not digits.isdigit() or len(digits) > 6:
        raise InvalidRequest(f"count {count!r} is malformed: give N (the pool's new size), +K or -K, "
                             "with N and K whole numbers (e.g. 3, +1, -2)")
    n = int(digits)
    return current + n if sign == "+" else current - n if sign == "-" else n


@dataclass(frozen=True, kw_only=True)
class CheckWeights(Event):
    """Compare the digest of the weights each engine serves with the published one (None: every engine).
    The controller answers with one ``WeightsChecked`` per engine and policy, carrying ``request_id``."""

    request_id: str
    engine_ids: list[str] | None = None


# --- weights -------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class WeightsPublished(Event):
    """A version directory (``uri``, its manifest's ``sha256``). With ``group_address`` (``host:port``) the
    trainer also offers the version by collective: it is rank 0 of weight-update groups whose rendezvous
    store listens there (``group_backend``: ``gloo`` or ``nccl``), and sends the tensors in ``buckets`` (names,
    in order) once the controller asks (``WeightBroadcastRequested``). The directory stays the fallback."""

    policy: str
    version: int
    uri: str
    sha256: str
    group_address: str = ""
    group_backend: str = ""
    buckets: list[list[str]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class WeightBroadcastRequested(Event):
    """The controller asks the trainer that offered ``policy`` v``version`` by collective to broadcast it, as rank
    0 of group ``group_name`` of ``world_size`` ranks (the engines are ranks 1..); ``new_group``: join it first
    (a group stays open across versions until the engines change). The engines receive it meanwhile."""

    policy: str
    version: int
    group_name: str
    world_size: int
    new_group: bool
    since_version: ClassVar[int] = 2


@dataclass(frozen=True, kw_only=True)
class WeightUpdateStarted(Event):
    policy: str
    version: int
    engine_ids: list[str]


@dataclass(frozen=True, kw_only=True)
class WeightsApplied(Event):
    policy: str
    version: int
    engine_id: str
    duration_ms: float


@dataclass(frozen=True, kw_only=True)
class WeightUpdateFailed(Event):
    policy: str
    version: int
    engine_id: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class WeightsChecked(Event):
    """The controller compared an engine's digest of ``policy`` v``version`` (the version the engine says it
    runs) with the published directory's. ``outcome``: ``match``, ``mismatch`` (the engine left the serving
    set) or ``unchecked`` (``reason`` says why), ``refused`` (the ``CheckWeights`` itself was bad: ``reason`` says why, no
    engine) or ``done`` (no engine: the last answer to that request); ``request_id`` is the ``CheckWeights``' (empty: after an update)."""

    engine_id: str
    policy: str
    version: int
    outcome: str
    expected: str
    actual: str
    reason: str
    request_id: str = ""


@dataclass(frozen=True, kw_only=True)
class WeightVersionServing(Event):
    policy: str
    version: int
    engine_ids: list[str]


# --- rollouts ------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class RolloutRequested(Event):
    policy: str
    rollout_id: int
    request_id: str
    n_groups: int
    n_samples_per_group: int
    eval: bool = False


@dataclass(frozen=True, kw_only=True)
class RolloutStarted(Event):
    policy: str
    rollout_id: int
    request_id: str
    executor: str
    attempt: int


@dataclass(frozen=True, kw_only=True)
class RolloutCompleted(Event):
    policy: str
    rollout_id: int
    request_id: str
    batch_id: str
    n_samples: int
    duration_ms: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RolloutFailed(Event):
    policy: str
    rollout_id: int
    request_id: str
    reason: str
    attempts: int


@dataclass(frozen=True, kw_only=True)
class BatchReady(Event):
    """A sample batch is in the payload store; ``payload`` is its claim check."""

    policy: str
    batch_id: str
    rollout_id: int
    request_id: str
    n_samples: int
    min_weight_version: int
    max_weight_version: int
    bytes: int
    payload: dict[str, Any]


# --- trainers ------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class TrainerJoined(Event):
    policy: str
    trainer_id: str
    group: str


@dataclass(frozen=True, kw_only=True)
class BatchConsumed(Event):
    policy: str
    batch_id: str
    trainer_id: str
    staleness: int
    accepted: bool
    reason: str = ""
    """Why a batch was not trained (``stale``, ``foreign``, ``payload_missing``...); empty when trained."""


@dataclass(frozen=True, kw_only=True)
class TrainStepDone(Event):
    policy: str
    trainer_id: str
    step: int
    weight_version: int
    metrics: dict[str, float]
    """Free-form step metrics; ``staleness_n<k>`` counts the step's samples ``k`` versions behind."""


@dataclass(frozen=True, kw_only=True)
class EvalCompleted(Event):
    """A held-out evaluation of ``policy`` (an eval request, ``RolloutRequest.eval``), scored by an executor.

    ``metrics`` holds the sample figures (``reward_mean``, ``correct_frac``...) and each share with its 95%
    Wilson interval (``accuracy``, ``accuracy_lo``, ``accuracy_hi``; ``pass_at_n`` likewise, over problems).
    ``problems`` is ``[index, correct, samples]`` per problem, so two evals of the same problems can be
    compared pairwise. ``min_weight_version`` and ``max_weight_version`` are the versions the samples came from.
    """

    policy: str
    request_id: str
    split: str
    min_weight_version: int
    max_weight_version: int
    n_problems: int
    n_samples: int
    metrics: dict[str, float]
    problems: list[list[int]] = field(default_factory=list)
    engine_ids: list[str] = field(default_factory=list)
    """The engines that generated the samples."""
    since_version: ClassVar[int] = 2


STALENESS_PREFIX = "staleness_n"
"""``TrainStepDone.metrics`` key prefix of the staleness histogram (``staleness_n0``, ``staleness_n1``...)."""


# --- housekeeping (the janitor in the active controller) -------------------------------------

@dataclass(frozen=True, kw_only=True)
class StreamsTrimmed(Event):
    """Entries removed by the retention policy, by logical stream name (``engines``, ``batches/p0``...)."""

    entries: dict[str, int]
    since_version: ClassVar[int] = 2


@dataclass(frozen=True, kw_only=True)
class PayloadsSwept(Event):
    """Payloads deleted because they outlived ``max_age_s``, whatever their readers; counts by store kind."""

    payloads: dict[str, int]
    max_age_s: float
    since_version: ClassVar[int] = 2


@dataclass(frozen=True, kw_only=True)
class GroupExpired(Event):
    """A consumer group whose consumers stopped beating was unregistered and destroyed, ``lapsed_s`` after its
    registration lapsed; ``payloads_released`` payloads lost it as a reader."""

    stream: str
    group: str
    lapsed_s: float
    payloads_released: int
    since_version: ClassVar[int] = 2


# --- agent sessions (the session gateway, in executors or on its own) --------------------------

@dataclass(frozen=True, kw_only=True)
class SessionStarted(Event):
    """A session was opened for an episode (``request_id`` empty for one opened by hand)."""

    policy: str
    session_id: str
    request_id: str
    attempt: int
    external: bool = False
    since_version: ClassVar[int] = 2


@dataclass(frozen=True, kw_only=True)
class SessionTurn(Event):
    """One call of a session completed: ``new_tokens`` appended (mask 0), ``output_tokens`` generated;
    ``from_journal``: answered from the session's journal without an engine (a retried episode)."""

    policy: str
    session_id: str
    turn: int
    engine_id: str
    new_tokens: int
    output_tokens: int
    cached_tokens: int
    oldest_version: int
    newest_version: int
    finish: str
    gen_ms: float
    env_ms: float
    from_journal: bool = False
    since_version: ClassVar[int] = 2


@dataclass(frozen=True, kw_only=True)
class SessionClosed(Event):
    """A session ended: ``status`` closed, failed, abandoned or overflow (``reason`` says why). ``digest``
    is the xxh3-64 of its token ids and loss mask, as its sample carries them (``gateway.tito.digest``)."""

    policy: str
    session_id: str
    request_id: str
    status: str
    reason: str
    turns: int
    tokens: int
    model_tokens: int
    reward: float
    oldest_version: int
    newest_version: int
    engine_switches: int
    digest: str
    since_version: ClassVar[int] = 2


# --- fleet scaling ---------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ExecutorsScaled(Event):
    """The run's autoscaler changed its executor count from ``current`` to ``target`` (``reason``: ``backlog``,
    ``age``, ``idle``, ``min``, ``max``), from these inputs: ``depth`` jobs waiting in the executors' queues, the
    oldest for ``oldest_age_s``, ``busy`` jobs running; bounds ``min_executors``..``max_executors``."""

    depth: int
    oldest_age_s: float
    busy: int
    current: int
    target: int
    reason: str
    min_executors: int
    max_executors: int
    since_version: ClassVar[int] = 2


# --- encoding --------------------------------------------------------------------------------

def event_types() -> dict[str, type[Event]]:
    return dict(_REGISTRY)


def encode(event: Event) -> dict[bytes, bytes]:
    """Stream fields for ``event``; ``InvalidRequest`` when it is too large for any consumer to accept."""
    return {FIELD: encode_bytes(event)}


_PACKERS = threading.local()


def encode_bytes(event: Event) -> bytes:
    """The value of the ``FIELD`` stream field for ``event`` (see ``encode``)."""
    try:
        packer = _PACKERS.packer
    except AttributeError:  # one Packer per thread, reused: ``packb`` builds (and frees) one per call
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True)
    try:
        raw: bytes = packer.pack(event.to_dict())
    except BaseException:
        packer.reset()  # a failed pack may leave a partial buffer behind
        raise
    if len(raw) > MAX_EVENT_BYTES:
        raise InvalidRequest(f"{event.type} of {len(raw)} bytes exceeds the {MAX_EVENT_BYTES}-byte event limit; "
                             "put large data in the payload store and send a reference")
    return raw


_SEQ_KEY = b"\xa3seq"  # msgpack's "seq"


def seq_slot(raw: bytes) -> int:
    """Where the publish script writes the producer's next number into ``raw`` (an ``encode_bytes``
    result): the 1-based position of its ``seq`` value while that is 0 (one byte, replaced by the
    number's msgpack encoding), or 0 when the event already has a number (an imported one)."""
    head = raw[0] if raw else 0
    width = 1 if 0x80 <= head <= 0x8F else 3 if head == 0xDE else 5 if head == 0xDF else 0
    if width and raw[width:width + 4] == _SEQ_KEY and raw[width + 4] == 0:
        return width + 5
    return 0


def decode(fields: Any) -> Event:
    """The event held by a stream entry's fields; ``DecodeError`` for anything malformed."""
    try:
        return _decode(fields)
    except DecodeError:
        raise
    except Exception as exc:  # a decoder must never let a malformed entry escape as anything else
        raise DecodeError(f"undecodable entry: {type(exc).__name__}: {exc}", fields) from None


def decode_as(cls: type[E], fields: Any) -> E:
    event = decode(fields)
    if not isinstance(event, cls):
        raise DecodeError(f"expected {cls.__name__}, got {event.type}", fields)
    return event


def _decode(fields: Any) -> Event:
    if not isinstance(fields, dict):
        raise DecodeError(f"entry fields must be a map, got {type(fields).__name__}", fields)
    raw = fields.get(FIELD)
    if raw is None:
        raw = fields.get(_FIELD_STR)
    if raw is None:
        raise DecodeError(f"entry has no {FIELD.decode()!r} field", fields)
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise DecodeError("event field is not bytes", fields)
    if len(raw) > MAX_EVENT_BYTES:
        raise DecodeError(f"event of {len(raw)} bytes exceeds the {MAX_EVENT_BYTES}-byte limit", fields)
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:
        raise DecodeError(f"not msgpack: {exc}", fields) from None
    if not isinstance(data, dict):
        raise DecodeError("event is not a msgpack map", fields)
    type_name = data.get("type")
    cls = _REGISTRY.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise DecodeError(f"unknown event type {type_name!r}", fields)
    version = data.get("schema_version")
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS or version < cls.since_version:
        raise DecodeError(f"{type_name}: schema_version {version!r}, expected "
                          f"{' or '.join(str(v) for v in SUPPORTED_VERSIONS if v >= cls.since_version)}", fields)
    if version == 1:
        if "seq" in data:
            raise DecodeError(f"{type_name}: schema_version 1 has no field 'seq'", fields)
        data["seq"] = 0
    elif "seq" not in data:
        raise DecodeError(f"{type_name}: missing field 'seq'", fields)
    fast = _FAST_DECODERS.get(cls)
    if fast is None:
        fast = _FAST_DECODERS[cls] = _compile_decoder(cls)
    event = fast(data, fields)
    return event if event is not None else _decode_fields(cls, data, fields, str(type_name))


def _decode_fields(cls: type[Event], data: dict[str, Any], fields: Any, type_name: str) -> Event:
    """The checked fields of ``data`` as a ``cls`` instance; ``DecodeError`` naming the first bad field."""
    kwargs: dict[str, Any] = {}
    for name, hint, check, required, exact in _fast_specs(cls):
        if name not in data:
            if required:
                raise DecodeError(f"{type_name}: missing field {name!r}", fields)
            continue
        value = data[name]
        if exact is not None and type(value) in exact and name not in _SPECIAL_FIELDS:
            kwargs[name] = value  # a plain value of an exactly expected type: nothing more to check
            continue
        if name == "producer":
            value = _producer(value, str(type_name), fields)
        elif not check(value):
            raise DecodeError(f"{type_name}: field {name!r} has {type(value).__name__}, expected {hint}", fields)
        elif name in ID_FIELDS and value and not SAFE_ID.fullmatch(value):
            raise DecodeError(f"{type_name}: field {name!r} is {value[:80]!r}: {name_fault(value)}", fields)
        elif name == "seq" and value < 0:
            raise DecodeError(f"{type_name}: field 'seq' is {value}, must be >= 0", fields)
        kwargs[name] = value
    return _build(cls, kwargs)


_FAST_DECODERS: dict[type[Event], Callable[[dict[str, Any], Any], Event | None]] = {}


def _compile_decoder(cls: type[Event]) -> Callable[[dict[str, Any], Any], Event | None]:
    """``_decode_fields`` for ``cls`` as straight-line code, built once per class: the same checks,
    field by field, without the loop and its per-field branching. It returns None on the first
    field that fails a check; ``_decode_fields`` then runs and raises the error that names it."""
    env: dict[str, Any] = {"_producer": _producer, "_build": _build, "_SAFE": SAFE_ID.fullmatch, "cls": cls,
                           "_MISSING": _UNSET, "_type_name": cls.__name__}
    lines = ["def decode_fields(data, fields):", "    kw = {}", "    get = data.get"]
    for i, (name, _hint, check, required, exact) in enumerate(_fast_specs(cls)):
        env[f"C{i}"], env[f"E{i}"] = check, exact or ()
        lines += [f"    v = get({name!r}, _MISSING)", "    if v is _MISSING:",
                  "        return None" if required else "        pass", "    else:"]
        if name == "producer":
            lines.append("        v = _producer(v, _type_name, fields)")
        elif name in ID_FIELDS:
            lines.append(f"        if not C{i}(v) or (v and not _SAFE(v)): return None")
        elif name == "seq":
            lines.append(f"        if not C{i}(v) or v < 0: return None")
        else:
            lines.append(f"        if type(v) not in E{i} and not C{i}(v): return None")
        lines.append(f"        kw[{name!r}] = v")
    lines.append("    return _build(cls, kw)")
    exec("\n".join(lines), env)  # noqa: S102  # source built above from the class's own field names
    fn: Callable[[dict[str, Any], Any], Event | None] = env["decode_fields"]
    return fn


_DEFAULTS: dict[type[Event], Any] = {}
_UNSET = object()


def _build(cls: type[E], kwargs: dict[str, Any]) -> E:
    """``cls(**kwargs)`` for checked values, without the frozen dataclass ``__init__`` (one
    ``object.__setattr__`` per field): the instance's dict is filled directly, defaults and
    default factories for absent fields as ``__init__`` would. A class with its own
    ``__post_init__`` goes through ``__init__``."""
    defaults = _DEFAULTS.get(cls, _UNSET)
    if defaults is _UNSET:
        defaults = _DEFAULTS[cls] = None if cls.__post_init__ is not Event.__post_init__ else tuple(
            (f.name, f.default, f.default_factory) for f in dataclasses.fields(cls)
            if not (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING))
    if defaults is None:
        return cls(**kwargs)
    for name, default, factory in defaults:
        if name not in kwargs:
            kwargs[name] = factory() if default is dataclasses.MISSING else default
    if kwargs.get("seq", -1) < 0:
        return cls(**kwargs)
    obj = object.__new__(cls)
    obj.__dict__.update(kwargs)
    return obj


_Spec = tuple[str, Any, Callable[[Any], bool], bool]
_SPECS: dict[type[Event], tuple[_Spec, ...]] = {}


def _field_specs(cls: type[Event]) -> tuple[_Spec, ...]:
    """(name, type hint, its checker, required) of each field, worked out once per class.

    Resolving the hints costs ~60 us and walking them per value several more: a decoder runs per entry.
    """
    specs = _SPECS.get(cls)
    if specs is None:
        hints = typing.get_type_hints(cls)
        specs = _SPECS[cls] = tuple(
            (f.name, hints[f.name], _checker(hints[f.name]),
             f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls))
    return specs


_SPECIAL_FIELDS = ID_FIELDS | {"producer", "seq"}
"""Fields checked beyond their type (safe names, the producer map, a non-negative ``seq``)."""
_EXACT: dict[Any, tuple[type, ...]] = {str: (str,), bytes: (bytes,), int: (int,), float: (int, float), bool: (bool,)}
_FastSpec = tuple[str, Any, Callable[[Any], bool], bool, tuple[type, ...] | None]
_FAST: dict[type[Event], tuple[_FastSpec, ...]] = {}


def _fast_specs(cls: type[Event]) -> tuple[_FastSpec, ...]:
    """``_field_specs`` plus, for a field of a plain scalar type, the exact types that pass its check
    without calling it (``type(v) in`` them; msgpack makes exact types, and ``bool`` is not in int's)."""
    specs = _FAST.get(cls)
    if specs is None:
        specs = _FAST[cls] = tuple((*spec, _EXACT.get(spec[1])) for spec in _field_specs(cls))
    return specs


def _checker(hint: Any) -> Callable[[Any], bool]:
    """A predicate: does a decoded msgpack value conform to the type ``hint``? (bool is not an int.)"""
    origin = typing.get_origin(hint)
    if hint is Any:
        return lambda v: True
    if origin in (Union, types.UnionType):
        options = [_checker(h) for h in typing.get_args(hint)]
        return lambda v: any(c(v) for c in options)
    if hint is type(None):
        return lambda v: v is None
    if hint is float:
        return lambda v: isinstance(v, int | float) and not isinstance(v, bool)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if origin is list:
        (item_t,) = typing.get_args(hint)
        item = _checker(item_t)
        return lambda v: isinstance(v, list) and all(item(x) for x in v)
    if origin is dict:
        key_t, val_t = typing.get_args(hint)
        key, val = _checker(key_t), _checker(val_t)
        return lambda v: isinstance(v, dict) and all(key(k) and val(x) for k, x in v.items())
    if isinstance(hint, type):
        return lambda v: isinstance(v, hint)
    return lambda v: False


_PRODUCERS: dict[tuple[str, str], Producer] = {}
"""Producers decoded so far (a stream has few): one immutable ``Producer`` each, not one per event."""


def _producer(value: Any, type_name: str, fields: Any) -> Producer:
    if (not isinstance(value, dict) or not isinstance(role := value.get("role"), str)
            or not isinstance(instance := value.get("instance"), str)):
        raise DecodeError(f"{type_name}: producer must be {{role, instance}} strings", fields)
    key = (role, instance)
    producer = _PRODUCERS.get(key)
    if producer is None:
        problem = name_problem("producer role", role) or name_problem("producer instance", instance, host=True)
        if problem is not None:
            raise DecodeError(f"{type_name}: {problem}", fields)
        if len(_PRODUCERS) >= 4096:  # bounded whatever the entries say
            _PRODUCERS.clear()
        producer = _PRODUCERS[key] = Producer(role, instance)
    return producer
