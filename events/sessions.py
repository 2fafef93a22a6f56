"""Agent sessions on the bus: each session's state and journal, its one-call-at-a-time lock, offers to
external agents.

A session is one multi-turn episode served through the session gateway (``rollout_bus.gateway``). Its
whole state lives here, not in any gateway process, so any gateway instance serves any session and a
restart loses nothing:

- ``session(sid)``: a hash with ``rev`` (bumped by every commit), ``writer`` (the lock token of the call
  whose commit wrote the state), ``state`` (one msgpack map: the session's header and its journal of turns,
  each with the exact token ids the engine saw and made) and ``tenant`` (the gateway client key's tenant
  the session is bound to: the one that opened it, or for a session offered to external agents, "" until
  one claims it; a caller of another tenant finds no session);
- ``session_busy(sid)``: the lock a call holds while it runs (``SET NX PX``), so that a second concurrent
  call on the session is refused instead of interleaving turns; it expires on its own if the gateway
  holding it dies;
- ``sessions_offered(policy)``: a list of session ids waiting for an external agent to claim them.

A call ``begin``s (takes the lock and reads the state in one script), works, then ``commit``s (writes the
new state only if it still holds the lock and the revision did not move, and frees the lock, in one
script; a gateway's turn appends its ``SessionTurn`` event in that same script, only if the commit goes
through: two round trips a turn). A caller that kept the state its own last commit wrote passes it to
``begin`` as ``known``: while the session's revision and writer are still that commit's, the state is not
sent, read or checked again (anything else that wrote since, another gateway, a takeover, a re-created
session, moves the revision or the writer, and the state is read whole). The state read back is
untrusted: ``check_state`` validates every field a gateway turns into a token, a key or a number before it
is used.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import redis

from rollout_bus.events.connection import Guard, ReconnectPolicy, as_str
from rollout_bus.events.errors import BusUnavailable, Failure, RedisCommandError
from rollout_bus.events.names import Keys, check_name, name_problem
from rollout_bus.events.publish import PUBLISH_BODY, SEQ_LUA

STATE_VERSION = 1
OPEN = "open"
CLOSED = "closed"
FAILED = "failed"
ABANDONED = "abandoned"
OVERFLOW = "overflow"
STATUSES = (OPEN, CLOSED, FAILED, ABANDONED, OVERFLOW)
"""A session is ``open`` until it ends: ``closed`` with a reward, ``failed`` (the agent raised),
``abandoned`` (no close within the timeout), or ``overflow`` (its context outgrew the model's)."""
DEFAULT_TTL_S = 24 * 3600
"""How long a session's keys live after their last write."""
STORE_WAIT_S = 1.0
"""How long a session call waits for Redis to answer again before it fails (503) instead. The gateway calls the
store from its event loop, so this bounds how long an outage holds the loop per call; a reply lost without the
connection closing is noticed only at the socket timeout."""
MAX_STATE_BYTES = 64 << 20

_BEGIN = """
if ARGV[3] == '1' and (redis.call('HGET', KEYS[1], 'tenant') or '') ~= ARGV[4] then
  return {'missing'}
end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) == false then
  if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {'busy'} end
  redis.call('PEXPIRE', KEYS[2], ARGV[2])  -- this very call, sent again (its reply was lost): the lock is its own
end
local found = redis.call('HMGET', KEYS[1], 'rev', 'writer', 'tenant')
if found[1] == false then
  redis.call('DEL', KEYS[2])
  return {'missing'}
end
if ARGV[5] ~= '' and found[1] == ARGV[5] and found[2] == ARGV[6] then
  return {'same', found[1], false, found[3] or ''}
end
return {'ok', found[1], redis.call('HGET', KEYS[1], 'state'), found[3] or ''}
"""
"""ARGV[3] '1': only a session of tenant ARGV[4] is found (checked before the lock is taken, so a caller of
another tenant never holds up the session's own calls). ARGV[5], ARGV[6]: the revision and writer of the state
the caller holds already (``known``); when the session is still at that revision, written by that call, the
state is not sent again. A call's lock token is its own: the same call sent again after a lost reply finds the lock
its own and goes on."""

_BIND = """
if redis.call('HEXISTS', KEYS[1], 'state') == 0 then return 0 end
local tenant = redis.call('HGET', KEYS[1], 'tenant') or ''
if tenant ~= '' and tenant ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'tenant', ARGV[1])
return 1
"""

_COMMIT = """
local rev, writer = unpack(redis.call('HMGET', KEYS[1], 'rev', 'writer'))
if writer == ARGV[1] and rev == tostring(tonumber(ARGV[2]) + 1) then
  -- this call's token wrote the revision after the one it held: the same commit sent again (its reply lost) if it
  -- carries the same state, else a stale one of that call
  if redis.call('HGET', KEYS[1], 'state') ~= ARGV[3] then return 'rev' end
  if ARGV[5] == '1' and redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
  return 'ok'
end
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 'lock' end
if rev ~= ARGV[2] then return 'rev' end
redis.call('HSET', KEYS[1], 'rev', tostring(tonumber(rev) + 1), 'state', ARGV[3], 'writer', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
if ARGV[5] == '1' then redis.call('DEL', KEYS[2]) else redis.call('PEXPIRE', KEYS[2], ARGV[6]) end
return 'ok'
"""

_COMMIT_PUBLISH = SEQ_LUA + f"""
local function commit(KEYS, ARGV)
{_COMMIT}
end
local function publish(KEYS, ARGV)
{PUBLISH_BODY}
end
local done = commit({{KEYS[1], KEYS[2]}}, {{unpack(ARGV, 1, 6)}})
if done ~= 'ok' then return {{done}} end
return {{done, publish({{unpack(KEYS, 3)}}, {{unpack(ARGV, 7)}})}}
"""
"""The commit, then, only if it went through, an event's publish (``events.publish``): one round trip. The same
commit sent again after a lost reply (its call's token wrote the revision after the one it held) is answered 'ok'
without writing again, and its event's publish finds its dedupe key: neither happens twice."""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class SessionError(Failure):
    """A session call that cannot go on; ``code`` is the OpenAI-style error code, ``status`` the HTTP one."""

    def __init__(self, message: str, *, code: str, status: int) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


class SessionNotFound(SessionError):
    def __init__(self, sid: str) -> None:
        super().__init__(f"session {sid!r} does not exist (it was never opened, or it expired)",
                         code="session_not_found", status=404)


class SessionBusy(SessionError):
    def __init__(self, sid: str) -> None:
        super().__init__(f"session {sid!r} is serving another call: a session takes one call at a time "
                         "(wait for the previous reply before sending the next turn)",
                         code="session_busy", status=409)


class SessionStoreUnavailable(SessionError):
    def __init__(self, why: str) -> None:
        super().__init__(f"the session store (Redis) does not answer: {why}; this call may or may not have taken "
                         "effect: send it again once Redis is back (a session then found busy is held by this call's "
                         "lock until it expires)", code="session_store_unavailable", status=503)


class SessionConflict(SessionError):
    def __init__(self, sid: str, why: str) -> None:
        super().__init__(f"session {sid!r} changed under this call ({why}); send the call again",
                         code="session_conflict", status=409)


class BadState(SessionError):
    def __init__(self, sid: str, why: str) -> None:
        super().__init__(f"session {sid!r} has a malformed state on the bus: {why}", code="bad_session_state",
                         status=500)


def new_state(sid: str, policy: str, *, max_context: int, request_id: str = "", sample_index: int = -1,
              item: Mapping[str, Any] | None = None, sampling: Mapping[str, Any] | None = None,
              per_turn: bool = False) -> dict[str, Any]:
    """The state of a session that has had no call yet."""
    check_name("session id", sid)
    check_name("policy", policy)
    return {
        "v": STATE_VERSION, "id": sid, "policy": policy, "status": OPEN, "reason": "",
        "created_ms": _now_ms(), "closed_ms": 0, "attempt": 1, "position": 0, "engine_id": "",
        "switches": 0, "reward": None, "max_context": int(max_context), "request_id": request_id,
        "sample_index": int(sample_index), "item": dict(item or {}), "sampling": dict(sampling or {}),
        "per_turn": bool(per_turn), "turns": [], "last_ms": 0, "engine_calls": 0, "engine_tokens": 0,
    }


_INT_LISTS = ("new_ids", "output_ids")
UNKNOWN_VERSION = -1
"""A token's weight version when neither the engine (SGLang's ``"default"``) nor the registry knew it."""


def check_state(sid: str, state: Any, *, from_turn: int = 0) -> dict[str, Any]:
    """``state`` when it is a well-formed session state, else ``BadState`` saying what is wrong.
    ``from_turn``: the turns before it are known to be well formed (checked before), so only the header and
    the later turns are checked."""
    def bad(why: str) -> BadState:
        return BadState(sid, why)

    if not isinstance(state, dict):
        raise bad(f"a map was expected, got {type(state).__name__}")
    if state.get("v") != STATE_VERSION:
        raise bad(f"state version {state.get('v')!r}, this gateway reads {STATE_VERSION}")
    if state.get("id") != sid:
        raise bad(f"it names session {state.get('id')!r}")
    for key in ("policy", "engine_id", "request_id"):
        value = state.get(key)
        if not isinstance(value, str) or (value and name_problem(key, value) is not None):
            raise bad(f"{key} {str(value)[:80]!r} is not a valid name")
    if not state["policy"]:
        raise bad("it has no policy")
    if state.get("status") not in STATUSES:
        raise bad(f"status {state.get('status')!r} is none of {STATUSES}")
    for key in ("max_context", "attempt", "position", "switches", "sample_index", "engine_calls", "engine_tokens"):
        if not _is_int(state.get(key)):
            raise bad(f"{key} must be an integer")
    if state["max_context"] <= 0:
        raise bad("max_context must be positive")
    reward = state.get("reward")
    if reward is not None and (not isinstance(reward, int | float) or isinstance(reward, bool)
                               or not math.isfinite(reward)):
        raise bad("reward must be a finite number or nil")
    turns = state.get("turns")
    if not isinstance(turns, list):
        raise bad("turns must be a list")
    if not 0 <= state["position"] <= len(turns):
        raise bad(f"position {state['position']} is outside its {len(turns)} turns")
    for i in range(max(from_turn, 0), len(turns)):
        turn = turns[i]
        if not isinstance(turn, dict):
            raise bad(f"turn {i} is not a map")
        for key in _INT_LISTS:
            if not _is_id_list(turn.get(key)):
                raise bad(f"turn {i}: {key} must be a list of non-negative integers")
        if not _is_version_list(turn.get("versions")):
            raise bad(f"turn {i}: versions must be a list of integers, each a version or {UNKNOWN_VERSION} (unknown)")
        logprobs = turn.get("logprobs")
        if not isinstance(logprobs, list) or not set(map(type, logprobs)) <= _NUMBER_TYPES:
            raise bad(f"turn {i}: logprobs must be a list of numbers")
        n_out = len(turn["output_ids"])
        if len(logprobs) != n_out or len(turn["versions"]) != n_out:
            raise bad(f"turn {i}: {n_out} output ids but {len(logprobs)} log-probs and "
                      f"{len(turn['versions'])} versions")
        if not isinstance(turn.get("messages"), list):
            raise bad(f"turn {i}: messages must be a list")
        engine = turn.get("engine_id")
        if not isinstance(engine, str) or (engine and name_problem("engine_id", engine) is not None):
            raise bad(f"turn {i}: engine_id is not a valid name")
    for key in ("item", "sampling"):
        if not isinstance(state.get(key), dict):
            raise bad(f"{key} must be a map")
    return state


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_INT_TYPES = frozenset({int})
_NUMBER_TYPES = frozenset({int, float})


def _is_id_list(ids: Any) -> bool:
    """A list of non-negative ints (no bools). Checked in C (``map``, ``set``, ``min``): a session's every
    token is validated on every call, so this runs over the whole journal each turn."""
    return isinstance(ids, list) and set(map(type, ids)) <= _INT_TYPES and (not ids or min(ids) >= 0)


def _is_version_list(versions: Any) -> bool:
    return (isinstance(versions, list) and set(map(type, versions)) <= _INT_TYPES
            and (not versions or min(versions) >= UNKNOWN_VERSION))


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class Held:
    """A session read under its lock: commit the new state with ``SessionStore.commit``."""

    sid: str
    token: str
    rev: bytes
    state: dict[str, Any]
    tenant: str = ""


class SessionStore:
    """Session state on Redis (see the module docstring)."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int = DEFAULT_TTL_S,
                 lock_ms: int = 600_000, guard: Guard | None = None) -> None:
        self.client = client
        self.guard = guard or Guard(client, ReconnectPolicy(max_wait_s=STORE_WAIT_S, base_s=0.02, cap_s=0.25),
                                    name="sessions")
        """A call's scripts (``begin``, ``commit``, ``release``) are sent again through a lost connection or reply:
        each is idempotent for its call's token (a commit: for its token and state). Past the budget:
        ``SessionStoreUnavailable`` (503)."""
        self.keys = keys
        self.ttl_s = int(ttl_s)
        self.lock_ms = int(lock_ms)
        """How long a call's lock lives if its gateway dies without freeing it (renewed by each commit)."""
        self._begin = client.register_script(_BEGIN)
        self._commit = client.register_script(_COMMIT)
        self._commit_publish = client.register_script(_COMMIT_PUBLISH)
        self._release = client.register_script(_RELEASE)
        self._bind = client.register_script(_BIND)

    # --- whole sessions -----------------------------------------------------------------------
    def create(self, state: Mapping[str, Any], *, tenant: str = "") -> bool:
        """Store a new session, bound to ``tenant`` ("": none yet); False (nothing written) when
        ``state['id']`` exists already."""
        sid = check_name("session id", state["id"])
        if tenant:
            check_name("tenant", tenant)
        key = self.keys.session(sid)
        pipe = self.client.pipeline(transaction=True)
        pipe.hsetnx(key, "rev", b"0")
        pipe.hsetnx(key, "state", _pack(state))
        pipe.hsetnx(key, "tenant", tenant)
        pipe.expire(key, self.ttl_s)
        created, _, _, _ = pipe.execute()
        return bool(created)

    def get(self, sid: str, *, tenant: str | None = None) -> dict[str, Any] | None:
        """The session's state, or None when there is none (or, with ``tenant``, none of that tenant)."""
        raw, bound = self.client.hmget(self.keys.session(check_name("session id", sid)), ["state", "tenant"])
        if raw is None or (tenant is not None and _text(bound) != tenant):
            return None
        return check_state(sid, _unpack(sid, raw if isinstance(raw, bytes) else str(raw).encode()))

    def tenant(self, sid: str) -> str:
        """The tenant the session is bound to ("": none, or no such session)."""
        return _text(self.client.hget(self.keys.session(check_name("session id", sid)), "tenant"))

    def bind(self, sid: str, tenant: str) -> bool:
        """Bind the session to ``tenant`` (a session offered to external agents, claimed): False when it is
        gone or bound to another tenant."""
        check_name("tenant", tenant)
        return bool(self._bind(keys=[self.keys.session(check_name("session id", sid))], args=[tenant]))

    def delete(self, sid: str) -> None:
        self.client.delete(self.keys.session(check_name("session id", sid)),
                           self.keys.session_busy(sid))

    # --- one call ------------------------------------------------------------------------------
    def begin(self, sid: str, token: str, *, tenant: str | None = None, known: Held | None = None) -> Held:
        """Take the session's lock and read its state: ``SessionBusy`` / ``SessionNotFound`` otherwise
        (with ``tenant``, a session bound to another tenant is not found, and its lock is never taken).

        ``known``: the ``Held`` of this caller's last commit on the session (its state as committed, never
        changed since). While the session is still at that commit (same revision, same writer), the new
        ``Held`` carries that very state object and nothing more crosses the wire; otherwise the state is
        read and checked as without it."""
        keys, args = self._begin_call(sid, token, tenant, known)
        return self._begun(sid, token, self._run(self._begin, keys, args), known)

    def send_begin(self, sid: str, token: str, *, tenant: str | None = None,
                   known: Held | None = None) -> PendingBegin:
        """``begin``, sent without waiting for its reply: the caller works while Redis runs the script, then
        takes the outcome with ``PendingBegin.held()`` (which it must call, whatever its work did)."""
        keys, args = self._begin_call(sid, token, tenant, known)
        return PendingBegin(self, sid, token, tenant, known, self._send(self._begin, keys, args))

    def _begin_call(self, sid: str, token: str, tenant: str | None, known: Held | None) -> tuple[list[str], list[Any]]:
        check_name("session id", sid)
        mark = [known.rev, known.token] if known is not None and known.sid == sid else ["", ""]
        return ([self.keys.session(sid), self.keys.session_busy(sid)],
                [token, self.lock_ms, "0" if tenant is None else "1", tenant or "", *mark])

    def _begun(self, sid: str, token: str, reply: Any, known: Held | None) -> Held:
        tag = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        if tag == "busy":
            raise SessionBusy(sid)
        if tag == "missing":
            raise SessionNotFound(sid)
        if tag == "same" and known is not None:
            return Held(sid, token, reply[1], known.state, _text(reply[3]))
        rev, raw = reply[1], reply[2]
        if raw is None:
            self.release(sid, token)
            raise BadState(sid, "it has a revision but no state")
        try:
            state = check_state(sid, _unpack(sid, raw))
        except BadState:
            self.release(sid, token)
            raise
        return Held(sid, token, rev, state, _text(reply[3]))

    def commit(self, held: Held, state: Mapping[str, Any], *, release: bool = True,
               publish: tuple[list[Any], list[Any]] | None = None, turns_packed: list[bytes] | None = None) -> None:
        """Write ``state`` if ``held`` still holds the lock and nobody wrote since; frees the lock (unless
        ``release`` is False: a call that goes on, as a stream between its engine calls). ``publish``: an
        event (``Publisher.prepared``) appended in the same round trip, only if the commit went through.
        ``turns_packed``: ``pack_turn`` of each of ``state["turns"]``, in order, packed before (the state is
        then packed around them, to the same bytes)."""
        keys, args = self._commit_call(held, state, release, publish, turns_packed)
        if publish is None:
            reply = self._run(self._commit, keys, args)
        else:
            reply = self._run(self._commit_publish, keys, args)[0]
        self._committed(held, state, reply)

    def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """``script`` through the guard (sent again after a lost connection or reply: the scripts a call runs are
        idempotent for its token); ``SessionStoreUnavailable`` once Redis stayed away past the budget."""
        try:
            return self.guard.call(lambda c: script(keys=keys, args=args, client=c))
        except BusUnavailable as exc:
            raise SessionStoreUnavailable(str(exc)) from None

    def send_commit(self, held: Held, state: Mapping[str, Any], *, publish: tuple[list[Any], list[Any]],
                    turns_packed: list[bytes] | None = None) -> PendingCommit:
        """``commit`` (with its event, freeing the lock), sent without waiting for its reply: the caller works
        while Redis runs the script, then ``PendingCommit.done()`` (which it must call, whatever its work did)
        raises what ``commit`` raises; until then nothing is known to be written."""
        keys, args = self._commit_call(held, state, True, publish, turns_packed)
        conn = self._send(self._commit_publish, keys, args)
        return PendingCommit(self, held, state, publish, turns_packed, conn)

    def _send(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """A connection with ``script`` sent on it (its reply for the caller to read), or None for a client
        that is not a plain pooled ``redis.Redis``."""
        pool = getattr(self.client, "connection_pool", None)
        if not (isinstance(self.client, redis.Redis) and isinstance(pool, redis.ConnectionPool)
                and self.client.connection is None):
            return None
        try:
            conn = pool.get_connection()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return None  # the plain call, through the guard
        try:
            conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            pool.release(conn)  # disconnected by the failed send; the plain call goes through the guard
            return None
        except BaseException:
            pool.release(conn)
            raise
        return conn

    def _read(self, conn: Any) -> tuple[bool, Any]:
        """The reply on ``conn`` (sent by ``_send``), the connection given back: (False, None) when Redis did
        not know the script (nothing ran: the caller makes the plain call, which loads it) or the reply was lost
        (it may have run: the plain call, sent again through the guard, is idempotent for the call's token)."""
        pool = self.client.connection_pool
        try:
            reply = conn.read_response()
        except redis.exceptions.NoScriptError:
            pool.release(conn)
            return False, None
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            conn.disconnect()
            pool.release(conn)
            return False, None
        except redis.ResponseError as exc:  # as the plain call, through the guard, raises it
            pool.release(conn)
            raise RedisCommandError(str(exc)) from None
        except BaseException:
            pool.release(conn)  # a connection error disconnected it already
            raise
        pool.release(conn)
        return True, reply

    def _commit_call(self, held: Held, state: Mapping[str, Any], release: bool,
                     publish: tuple[list[Any], list[Any]] | None,
                     turns_packed: list[bytes] | None) -> tuple[list[str], list[Any]]:
        keys = [self.keys.session(held.sid), self.keys.session_busy(held.sid)]
        packed = _pack(state) if turns_packed is None else pack_state(state, turns_packed)
        args: list[Any] = [held.token, held.rev, packed, self.ttl_s, "1" if release else "0", self.lock_ms]
        if publish is None:
            return keys, args
        return keys + publish[0], args + publish[1]

    def _committed(self, held: Held, state: Mapping[str, Any], reply: Any) -> None:
        tag = reply.decode() if isinstance(reply, bytes) else str(reply)
        if tag == "lock":
            raise SessionConflict(held.sid, "its call lock expired or was taken over")
        if tag == "rev":
            raise SessionConflict(held.sid, "another writer committed first")
        held.rev = str(int(held.rev) + 1).encode()
        held.state = dict(state)

    def unlock(self, sid: str) -> None:
        """Break the session's call lock, whoever holds it (its owner is known dead)."""
        self.client.delete(self.keys.session_busy(check_name("session id", sid)))

    def release(self, sid: str, token: str) -> None:
        self._run(self._release, [self.keys.session_busy(sid)], [token])

    def update(self, sid: str, token: str, change: Any, *, tenant: str | None = None) -> dict[str, Any]:
        """``change(state) -> state`` under the lock, committed; the new state (``tenant``: as ``begin``)."""
        held = self.begin(sid, token, tenant=tenant)
        try:
            new = change(dict(held.state))
        except BaseException:
            self.release(sid, token)
            raise
        self.commit(held, new)
        return new

    # --- external agents -----------------------------------------------------------------------
    def offer(self, policy: str, sids: list[str]) -> None:
        """Put sessions where external agents of ``policy`` claim them (``claim``)."""
        if sids:
            key = self.keys.sessions_offered(policy)
            pipe = self.client.pipeline(transaction=False)
            pipe.rpush(key, *[check_name("session id", s) for s in sids])
            pipe.expire(key, self.ttl_s)
            pipe.execute()

    def claim(self, policy: str) -> str | None:
        """The oldest offered session of ``policy`` still open, taken off the list; None when none is."""
        key = self.keys.sessions_offered(policy)
        while True:
            raw = self.client.lpop(key)
            if raw is None:
                return None
            sid = raw.decode() if isinstance(raw, bytes) else str(raw)
            if name_problem("session id", sid) is not None:
                continue
            state = self.get(sid)
            if state is not None and state["status"] == OPEN and not state["turns"]:
                return sid

    def withdraw(self, policy: str, sids: list[str]) -> None:
        """Take sessions off the offered list (the executor stopped waiting for them)."""
        if sids:
            key = self.keys.sessions_offered(policy)
            pipe = self.client.pipeline(transaction=False)
            for sid in sids:
                pipe.lrem(key, 0, sid)
            pipe.execute()


class PendingBegin:
    """A ``SessionStore.begin`` sent (``send_begin``), its reply not read yet."""

    def __init__(self, store: SessionStore, sid: str, token: str, tenant: str | None, known: Held | None,
                 conn: Any) -> None:
        self._store = store
        self._call = (sid, token, tenant, known)
        self._conn = conn

    def held(self) -> Held:
        """The reply: the ``Held`` session, or what ``begin`` raises (the plain ``begin`` where nothing was sent,
        or Redis did not know the script yet)."""
        sid, token, tenant, known = self._call
        conn, self._conn = self._conn, None
        if conn is not None:
            ran, reply = self._store._read(conn)
            if ran:
                return self._store._begun(sid, token, reply, known)
        return self._store.begin(sid, token, tenant=tenant, known=known)


class PendingCommit:
    """A ``SessionStore.commit`` sent (``send_commit``), its reply not read yet."""

    def __init__(self, store: SessionStore, held: Held, state: Mapping[str, Any],
                 publish: tuple[list[Any], list[Any]], turns_packed: list[bytes] | None, conn: Any) -> None:
        self._store = store
        self._call = (held, state, publish, turns_packed)
        self._conn = conn

    def done(self) -> None:
        """The reply: returns once the state is written (``held`` updated as by ``commit``), else raises what
        ``commit`` raises."""
        held, state, publish, turns_packed = self._call
        conn, self._conn = self._conn, None
        if conn is not None:
            ran, reply = self._store._read(conn)
            if ran:
                return self._store._committed(held, state, reply[0])
        self._store.commit(held, state, publish=publish, turns_packed=turns_packed)


def _text(value: Any) -> str:
    """A reply value as text, nil as ""."""
    return "" if value is None else as_str(value)


def _pack(state: Mapping[str, Any]) -> bytes:
    raw = msgpack.packb(dict(state), use_bin_type=True)
    if len(raw) > MAX_STATE_BYTES:
        raise SessionError(f"session {state.get('id')!r} would grow past {MAX_STATE_BYTES} bytes",
                           code="context_length_exceeded", status=400)
    return bytes(raw)


def pack_turn(turn: Mapping[str, Any]) -> bytes:
    """One turn of a state as ``_pack`` writes it inside the state."""
    return bytes(msgpack.packb(dict(turn), use_bin_type=True))


def pack_state(state: Mapping[str, Any], turns_packed: list[bytes]) -> bytes:
    """``_pack(state)`` with its turns given packed (``pack_turn`` of each of ``state["turns"]``): the same
    bytes (a map is its header, then each key and value packed in order), without packing the journal
    again on every commit."""
    if len(turns_packed) != len(state["turns"]):
        raise ValueError(f"{len(turns_packed)} packed turns for a state of {len(state['turns'])}")
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_map_header(len(state))]
    for key, value in state.items():
        parts.append(packer.pack(key))
        if key == "turns":
            parts.append(packer.pack_array_header(len(turns_packed)))
            parts.extend(turns_packed)
        else:
            parts.append(packer.pack(value))
    raw = b"".join(parts)
    if len(raw) > MAX_STATE_BYTES:
        raise SessionError(f"session {state.get('id')!r} would grow past {MAX_STATE_BYTES} bytes",
                           code="context_length_exceeded", status=400)
    return raw


def _unpack(sid: str, raw: bytes) -> Any:
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as exc:
        raise BadState(sid, f"not msgpack ({exc})") from None
