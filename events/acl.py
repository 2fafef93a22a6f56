"""What each role sends to Redis, as the ACL users of ``deploy/users.acl`` grant it.

Each role's grants below were derived from what its code sends (the module named beside each
grant) and checked by running every role's real process under its user with nothing refused
(``tests/integration/test_deploy_acl.py``, which also tries what each must not do). Every role
reads every ``rb:{*}:`` key (``%R~``, read commands only); writes are granted per key pattern and
per command, in selectors, so that a command allowed on one key is not allowed on another.
Lua scripts are called with ``EVALSHA`` on any key of the bus (``SCRIPTS``): Redis checks every
command a script runs against the same user, so a script can do nothing its caller could not.

``render()`` writes the ACL file (``render("default", "p1")``: a trainer user per policy); its passwords are ``#${VAR}`` placeholders that
``deploy/render-acl.sh`` replaces with the SHA-256 of each password when Redis starts (a user
whose optional password is not given is ``off``). ``python -m rollout_bus.events.acl`` prints it.

No user here writes ``keys.scaling_stream``: its only writer is the executor autoscaler of ``rollout-bus run``
(``launch/fleet.py``), which runs with the run's own Redis URL (the run also creates the bus epoch and holds
payloads for its export: an admin's work). On a cluster KEDA scales the executors and writes nothing to the bus
(``deploy/k8s/``); it reads queue lengths and pending counts as the ``status`` user.

What Redis ACLs cannot express, and is therefore not prevented here:
- arguments: a role that may ``XADD`` to a stream may also pass ``MAXLEN 0`` and empty it;
- event types: a colocated trainer sends offload and onload commands, so every trainer user may add any
  command (a scale, a weights check, another policy's offload) to the commands stream;
- one stream shared by writers: ``rollouts`` and ``trainers`` take any event from any trainer, and any
  executor may add to every policy's batch stream. Weights are not shared: each policy has its own stream
  (``Keys.weight_stream``) and a trainer user may add to its own policy's alone; on it, it may still add any
  event type (the controller refuses a publication of another policy there, and checks every publication
  against its policy's lease holder);
- rq: a role that queues requests writes ``rq:job:`` hashes, so it names the function to run (the
  executor's worker refuses all but the rollout job, ``executor/rqjob.py``), and it may queue
  requests for any policy.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

from rollout_bus.events.names import Keys, publication_key

_NS = "NS"
_ANY = "ANY"
_K = Keys(_NS)
TRAINER_POLICY = "default"
"""The policy of the ``trainer`` user (compose's trainer)."""


def _pattern(key: str) -> str:
    """A key of ``Keys(_NS)`` as a pattern over every namespace (and every policy or id for ``_ANY``)."""
    return key.replace(_K.prefix, "rb:{*}").replace(_ANY, "*")


@dataclass(frozen=True)
class Grant:
    """``commands`` on keys matching ``keys`` (one selector), and which code sends them."""

    keys: tuple[str, ...]
    commands: tuple[str, ...]
    sent_by: str

    def selector(self) -> str:
        return "(" + " ".join([*(f"~{k}" for k in self.keys), *(c if c.startswith("-") else f"+{c}" for c in self.commands)]) + ")"


@dataclass(frozen=True)
class Role:
    user: str
    password_var: str
    grants: tuple[Grant, ...]
    reads: tuple[str, ...] = (_pattern(_K.prefix + ":*"),)
    keyless: tuple[str, ...] = ()
    channels: tuple[str, ...] = ()
    required: bool = True


CONNECTION = ("@connection", "-@dangerous", "time", "script|load", "script|exists")
"""Every role: HELLO/AUTH/PING/CLIENT SETNAME (not CLIENT LIST or KILL), TIME, loading its scripts."""
SCRIPTS = Grant((_pattern(_K.prefix + ":*"), "rq:*"), ("evalsha",), "every Lua script (events/*.py, executor/worker.py)")


def _own(key: str) -> str:
    """A key of one policy as a pattern over every namespace, the policy kept as it is (a policy may be called
    ``ANY``: ``_pattern`` would widen it to every policy)."""
    return key.replace(_K.prefix, "rb:{*}")


def _stream_any(stream_of: str) -> str:
    return _pattern(_K.dedupe(stream_of, _ANY))


def _consumer(stream: str, sent_by: str, pattern: Callable[[str], str] = _pattern) -> tuple[Grant, ...]:
    """A consumer group on ``stream`` (events/consume.py): read, ack, claim, and its registration and beat."""
    return (
        Grant((pattern(stream),), ("xreadgroup", "xack", "xautoclaim", "xclaim", "xgroup|create"), sent_by),
        Grant((pattern(_K.registered_groups(stream)), pattern(_K.group_hosts(stream))), ("sadd", "hset"),
              "register_group (events/consume.py)"),
        Grant((pattern(_K.group_beats(stream)), pattern(_K.group_ttls(stream))), ("zadd", "hset"),
              "the group's beat and its TTL, from the consumer's beat thread (events/consume.py, events/groups.py)"),
        Grant((pattern(_K.expired_groups(stream)),), ("hdel",),
              "a consumer that recreated its expired group clears the janitor's record (events/consume.py)"),
    )


def _publisher(streams: tuple[str, ...], dedupe: tuple[str, ...], sent_by: str,
               pattern: Callable[[str], str] = _pattern) -> tuple[Grant, ...]:
    """Publishing (events/publish.py, events/batches.py): XADD, the dedupe key and the producer's sequence
    number, in one script; a durable write that waits for its replicas says so in the durability status."""
    return (Grant(tuple(pattern(s) for s in streams), ("xadd",), sent_by),
            Grant(dedupe, ("set",), "the dedupe key of each publish (events/publish.py)"),
            Grant((_pattern(_K.producer_seqs),), ("hset",), "each producer's last sequence number (events/publish.py)"),
            Grant((_pattern(_K.durability_status),), ("hset", "hdel"),
                  "a durable write waiting for its replicas (events/connection.py status_hook)"))


def _sessions(sent_by: str) -> tuple[Grant, ...]:
    """Serving agent sessions (events/sessions.py): their state and call locks, the offers to external
    agents, and the session events."""
    k = _K
    return (
        *_publisher((k.session_stream,), (_stream_any(k.session_stream),), f"session events ({sent_by})"),
        Grant((_pattern(k.session(_ANY)),), ("hsetnx", "hset", "expire", "del"),
              "session state and journal (events/sessions.py)"),
        Grant((_pattern(k.session_busy(_ANY)),), ("set", "get", "del", "pexpire"),
              "a session's call lock (events/sessions.py)"),
        Grant((_pattern(k.sessions_offered(_ANY)),), ("rpush", "lpop", "lrem", "expire"),
              "sessions offered to external agents (events/sessions.py)"),
    )


def controller() -> Role:
    k = _K
    weights = k.weight_stream(_ANY)
    return Role("controller", "CONTROLLER_PASSWORD", (
        *_publisher((k.engine_stream, weights, k.housekeeping_stream, k.dead_letters),
                    (_stream_any(k.engine_stream), _stream_any(weights), _stream_any(k.housekeeping_stream)),
                    "engine and weight outcomes (controller/bus.py), the janitor's report (events/janitor.py), "
                    "dead letters (events/consume.py)"),
        *_consumer(weights, "publications on every policy's weight stream (controller/bus.py)"),
        *_consumer(k.legacy_weight_stream, "publications an event log from before holds (controller/bus.py)"),
        *_consumer(k.command_stream, "offload and onload commands (controller/bus.py)"),
        Grant((_pattern(k.engine_registry), _pattern(k.policy_registry)), ("hset", "hdel", "hincrby"),
              "the engine and policy registry (events/registry.py)"),
        Grant((_pattern(k.controller_lease), _pattern(k.controller_fence), _pattern(k.controller_fence_holder),
               _pattern(k.controller_fence_run)), ("set", "del", "pexpire", "incr"),
              "the controller lease, its fencing counter, the counter's holder and the server run that handed it "
              "out (controller/lease.py)"),
        Grant((_pattern(k.bus_epoch),), ("set",), "the bus epoch, created once (events/epoch.py, controller/cli.py)"),
        Grant((_stream_any(weights),), ("del",),
              "a publication refused for good may be announced again (controller/bus.py forget_publication)"),
        Grant((_pattern(k.prefix + ":stream:*"),), ("xtrim", "xgroup|destroy"),
              "the janitor: retention and expired groups (events/janitor.py, events/retention.py)"),
        Grant((_pattern(k.registered_groups(k.prefix + ":" + _ANY)), _pattern(k.group_beats(k.prefix + ":" + _ANY)),
               _pattern(k.group_ttls(k.prefix + ":" + _ANY))),
              ("srem", "zrem", "hdel"), "the janitor unregisters expired groups (events/janitor.py)"),
        Grant((_pattern(k.expired_groups(k.prefix + ":" + _ANY)),), ("hset",),
              "the janitor records where an expired group stood (events/groups.py)"),
        Grant((_pattern(k.payload(_ANY)), _pattern(k.payload_readers(_ANY))), ("del", "srem"),
              "the janitor's payload sweep and dropped readers (events/batches.py)"),
        Grant((_pattern(k.payload_index),), ("zrem",), "the payload sweep (events/batches.py)"),
        Grant((_pattern(k.payload_stores),), ("hdel",), "the payload sweep (events/batches.py)"),
        SCRIPTS), keyless=(*CONNECTION, "info", "multi", "exec", "discard"))  # INFO: the run id, controller/lease.py


def executor() -> Role:
    k = _K
    return Role("executor", "EXECUTOR_PASSWORD", (
        *_publisher((k.rollout_stream, k.batch_stream(_ANY), k.eval_stream),
                    (_stream_any(k.rollout_stream), _stream_any(k.batch_stream(_ANY)), _stream_any(k.eval_stream)),
                    "rollout outcomes (executor/service.py, executor/jobs.py), batches (events/batches.py), "
                    "held-out evaluations (executor/service.py)"),
        Grant((_pattern(k.payload(_ANY)), _pattern(k.payload_readers(_ANY))), ("set", "del", "sadd", "expire"),
              "batch payloads and their readers (events/payload/redis.py, events/batches.py)"),
        Grant((_pattern(k.payload_index),), ("zadd", "zrem"), "the payload index (events/batches.py)"),
        Grant((_pattern(k.payload_stores),), ("hset", "hdel"), "where each payload lives (events/batches.py)"),
        Grant((_pattern(k.data_cursor(_ANY, _ANY)),), ("hset", "hdel", "watch"),
              "data-source cursors (executor/cursor.py)"),
        Grant(("rq:*",), ("@hash", "@list", "@set", "@sortedset", "@string", "@keyspace", "@stream",
                          "@transaction", "-@dangerous"),
              "the rq worker, its registries and the reaper (executor/worker.py, rq)"),
        *_sessions("the executor's own gateway, executor/agents.py"),
        SCRIPTS), keyless=(*CONNECTION, "info", "multi", "exec", "discard", "subscribe", "unsubscribe"),
        channels=("rq:pubsub:*",))


def gateway() -> Role:
    """``rollout-bus gateway``: sessions and their events, nothing else."""
    return Role("gateway", "GATEWAY_PASSWORD", (*_sessions("gateway/service.py"), SCRIPTS),
                keyless=(*CONNECTION, "multi", "exec", "discard"), required=False)


def trainer(policy: str = TRAINER_POLICY) -> Role:
    """The trainer user of ``policy``: ``trainer`` (``$TRAINER_PASSWORD``) for compose's, else ``trainer-<policy>``
    (``$TRAINER_<POLICY>_PASSWORD``, optional: the user is off without it)."""
    k = _K
    batches = k.batch_stream(policy)
    own = policy == TRAINER_POLICY
    var = "TRAINER_PASSWORD" if own else f"TRAINER_{re.sub('[^A-Z0-9]', '_', policy.upper())}_PASSWORD"
    return Role("trainer" if own else f"trainer-{policy}", var, (
        *_publisher((k.weight_stream(policy), k.trainer_stream, k.rollout_stream, k.dead_letters, k.command_stream),
                    (_own(k.dedupe(k.weight_stream(policy), publication_key(policy, 0)[:-1])) + "*",
                     _stream_any(k.trainer_stream), _stream_any(k.rollout_stream), _stream_any(k.command_stream)),
                    "publications on its policy's weight stream (trainer/weights.py), trainer events (trainer/client.py, "
                    "trainer/service.py), rollout requests (events/submit.py), dead letters (events/consume.py), "
                    "offload and onload commands of a colocated trainer (trainer/colocate.py)", _own),
        *_consumer(batches, "its policy's batches (trainer/client.py, trainer/recorder.py)", _own),
        Grant((_own(k.payload(f"{policy}:")) + "*", _own(k.payload_readers(f"{policy}:")) + "*"),
              ("del", "srem"), "releasing its policy's payloads once read (events/batches.py)"),
        Grant((_pattern(k.payload_index),), ("zrem",), "releasing a payload (events/batches.py)"),
        Grant((_pattern(k.payload_stores),), ("hdel",), "releasing a payload (events/batches.py)"),
        Grant((_own(k.trainer_lease(policy)),), ("hset", "hdel", "del", "pexpire"),
              "its policy's trainer lease (trainer/lease.py)"),
        Grant(("rq:job:*",), ("hset",), "queueing a rollout request (events/submit.py, rq)"),
        Grant((f"rq:queue:{_pattern(k.rollout_queue).replace(_NS, '*')}",), ("rpush",),
              "queueing a rollout request (events/submit.py, rq)"),
        Grant(("rq:queues",), ("sadd",), "rq's set of queues (rq)"),
        SCRIPTS), reads=(_pattern(k.prefix + ":*"), "rq:job:*", "rq:results:*"),
        keyless=(*CONNECTION, "info", "multi", "exec", "discard"))


def status() -> Role:
    return Role("status", "STATUS_PASSWORD", (), reads=(_pattern(_K.prefix + ":*"), "rq:*"),
                keyless=(*CONNECTION[:3],))


ROLES = (controller, executor, trainer, status, gateway)


def _rules(role: Role) -> tuple[list[str], list[str], list[str]]:
    """A role's ACL rules in three parts: its key patterns, its channels, its commands (with the selectors)."""
    parts = ["-@all", "+@read" if role.reads else "", "-@dangerous"]
    parts += [c if c.startswith("-") else f"+{c}" for c in role.keyless]
    parts += [g.selector() for g in role.grants]
    return [f"%R~{r}" for r in role.reads], [f"&{c}" for c in role.channels], [p for p in parts if p]


def _user(role: Role) -> str:
    keys, channels, commands = _rules(role)
    return " ".join(["user", role.user, "on", f"#${{{role.password_var}}}", "resetkeys", "resetchannels", *keys,
                     *channels, *commands])


def role_users(*trainer_policies: str) -> list[Role]:
    """The role users of the ACL file: controller, executor, status, gateway, and a trainer per policy (default:
    compose's)."""
    return [controller(), executor(), status(), gateway(),
            *(trainer(p) for p in (trainer_policies or (TRAINER_POLICY,)))]


def render(*trainer_policies: str) -> str:
    """The ACL file (``deploy/users.acl``), its passwords as ``#${VAR}`` placeholders; one trainer user per
    policy in ``trainer_policies`` (default: compose's)."""
    lines = ["user default off resetpass resetkeys resetchannels -@all",
             "user admin on #${ADMIN_PASSWORD} ~* &* +@all",
             "user replication on #${REPLICATION_PASSWORD} resetkeys resetchannels -@all +psync +replconf +ping",
             "user sentinel on #${SENTINEL_PASSWORD} resetkeys &__sentinel__:hello -@all +multi +slaveof +ping "
             "+exec +subscribe +config|rewrite +role +publish +info +client|setname +client|kill +script|kill"]
    lines += [_user(role) for role in role_users(*trainer_policies)]
    return "\n".join(lines) + "\n"


def chart_users(*trainer_policies: str) -> list[dict[str, str]]:
    """The same role users as the Bitnami redis chart's ``auth.acl.users`` (``deploy/k8s/redis/values.yaml``): the
    chart writes ``user <username> <enabled> #<sha256 of the userSecret's key of that name> <keys> <channels>
    <commands>``. No part is ever empty: the chart fills an empty one with ``~*``, ``&*`` or ``+@all``."""
    out = []
    for role in role_users(*trainer_policies):
        keys, channels, commands = _rules(role)
        out.append({"username": role.user, "enabled": "on", "keys": " ".join(["resetkeys", *keys]),
                    "channels": " ".join(["resetchannels", *channels]), "commands": " ".join(commands)})
    return out


if __name__ == "__main__":
    sys.stdout.write(render(*sys.argv[1:]))
