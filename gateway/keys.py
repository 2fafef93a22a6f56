"""The gateway's client keys: one per tenant, each with the policies it may open and claim sessions of.

Clients never hold the engines' key (``$ROLLOUT_BUS_ENGINE_API_KEY``): the gateway reaches the engines
with it, and clients authenticate with keys of their own, from ``$ROLLOUT_BUS_GATEWAY_API_KEYS`` and/or
a key file (``rollout-bus gateway --api-keys-file PATH``). Both take the same text, in one of two forms:

- JSON: a list of ``{"tenant": NAME, "key": KEY, "policies": [POLICY, ...]}`` (``policies`` left out, or
  ``["*"]``: every policy);
- lines: ``TENANT KEY [POLICY ...]`` per line (or per ``;``-separated entry, handy in a variable), ``#``
  starting a comment, no policy meaning every policy.

A tenant is a name of the project's grammar (``events.names``); names starting with ``_`` are kept for
the executor's own agents (``EXECUTOR_TENANT``). A key is 16 to 256 printable characters without
spaces, unique across tenants. Keys are compared in constant time (``hmac.compare_digest``), against
every key, and never appear in a message or a log line: errors name the tenant or the line.
"""

from __future__ import annotations

import hmac
import json
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_bus.events.names import name_problem

GATEWAY_API_KEYS_ENV = "ROLLOUT_BUS_GATEWAY_API_KEYS"
"""The gateway's client keys (server side: the whole list)."""
GATEWAY_API_KEY_ENV = "ROLLOUT_BUS_GATEWAY_API_KEY"
"""One client's key (client side), where a client reads it from the environment (verifiers does)."""
ANY_POLICY = "*"
EXECUTOR_TENANT = "_executor"
"""The tenant of an executor's in-process gateway: its own agents, with a random key per process."""
KEY_MIN = 16
KEY_MAX = 256


class KeysError(ValueError):
    """Client keys that cannot be used; the message names the tenant or the line, never a key."""


@dataclass(frozen=True)
class ClientKey:
    tenant: str
    key: str = field(repr=False)
    policies: frozenset[str] | None = None
    """The policies this tenant may open and claim sessions of; None: every policy."""

    def allows(self, policy: str) -> bool:
        return self.policies is None or policy in self.policies


class ClientKeys:
    """Every client key of a gateway."""

    def __init__(self, keys: Iterable[ClientKey]) -> None:
        self.keys: tuple[ClientKey, ...] = tuple(keys)
        tenants: set[str] = set()
        for k in self.keys:
            if k.tenant in tenants:
                raise KeysError(f"tenant {k.tenant!r} has two keys: give each tenant one key")
            tenants.add(k.tenant)
        for i, a in enumerate(self.keys):
            for b in self.keys[i + 1:]:
                if hmac.compare_digest(a.key.encode(), b.key.encode()):
                    raise KeysError(f"tenants {a.tenant!r} and {b.tenant!r} have the same key: each needs its own")
        self._encoded = [(k.key.encode(), k) for k in self.keys]

    def __bool__(self) -> bool:
        return bool(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def tenants(self) -> list[str]:
        return [k.tenant for k in self.keys]

    def match(self, given: str | bytes) -> ClientKey | None:
        """The key ``given`` is, compared in constant time against every key (no early exit)."""
        raw = given.encode() if isinstance(given, str) else given
        found: ClientKey | None = None
        for encoded, key in self._encoded:
            if hmac.compare_digest(raw, encoded):
                found = key
        return found

    def refuse_engine_key(self, engine_key: str | None) -> None:
        """``KeysError`` when a client key is the engines' key: a client would then hold the engines."""
        if not engine_key:
            return
        for key in self.keys:
            if hmac.compare_digest(key.key.encode(), engine_key.encode()):
                raise KeysError(f"the key of tenant {key.tenant!r} is the engines' key "
                                "($ROLLOUT_BUS_ENGINE_API_KEY): a client holding it could pause, abort and "
                                "flush every engine; give clients keys of their own")

    def merged(self, other: ClientKeys) -> ClientKeys:
        return ClientKeys([*self.keys, *other.keys])

    @classmethod
    def parse(cls, text: str, *, source: str) -> ClientKeys:
        """Keys from ``text`` (JSON or lines, see the module docstring); ``source`` names it in errors."""
        stripped = text.strip()
        if not stripped:
            return cls([])
        entries = _from_json(stripped, source) if stripped[0] in "[{" else _from_lines(stripped, source)
        try:
            return cls(entries)
        except KeysError as exc:
            raise KeysError(f"{source}: {exc}") from None

    @classmethod
    def executor(cls) -> ClientKeys:
        """A random key for an executor's own agents (one per process, given to no one else)."""
        return cls([ClientKey(EXECUTOR_TENANT, secrets.token_urlsafe(32))])


def load_client_keys(env: Mapping[str, str], path: str | None) -> ClientKeys:
    """The client keys of ``$ROLLOUT_BUS_GATEWAY_API_KEYS`` and of the key file at ``path``, together."""
    keys = ClientKeys.parse(env.get(GATEWAY_API_KEYS_ENV, ""), source=f"${GATEWAY_API_KEYS_ENV}")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise KeysError(f"cannot read the key file {path}: {exc.strerror or exc}") from None
        keys = keys.merged(ClientKeys.parse(text, source=path))
    return keys


def _from_json(text: str, source: str) -> list[ClientKey]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KeysError(f"{source}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, list):
        raise KeysError(f"{source}: JSON keys are a list of {{\"tenant\", \"key\", \"policies\"}} objects")
    out = []
    for i, entry in enumerate(data):
        where = f"{source}: entry {i}"
        if not isinstance(entry, dict):
            raise KeysError(f"{where} is not an object")
        extra = sorted(set(entry) - {"tenant", "key", "policies"})
        if extra:
            raise KeysError(f"{where}: unknown fields {extra} (tenant, key, policies)")
        policies = entry.get("policies", [ANY_POLICY])
        if not isinstance(policies, list):
            raise KeysError(f"{where}: policies must be a list of policy names")
        out.append(_key(entry.get("tenant"), entry.get("key"), policies, where))
    return out


def _from_lines(text: str, source: str) -> list[ClientKey]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for entry in line.split("#", 1)[0].split(";"):
            parts = entry.split()
            if not parts:
                continue
            where = f"{source}: line {n}"
            if len(parts) < 2:
                raise KeysError(f"{where}: an entry is 'TENANT KEY [POLICY ...]'")
            out.append(_key(parts[0], parts[1], parts[2:] or [ANY_POLICY], where))
    return out


def _key(tenant: Any, key: Any, policies: Sequence[Any], where: str) -> ClientKey:
    problem = name_problem("tenant", tenant)
    if problem is not None:
        raise KeysError(f"{where}: {problem}")
    if tenant.startswith("_"):
        raise KeysError(f"{where}: tenant {tenant!r}: names starting with '_' are kept for the executor's own agents")
    if not isinstance(key, str) or not KEY_MIN <= len(key) <= KEY_MAX or not key.isprintable() or any(
            c.isspace() for c in key):
        raise KeysError(f"{where}: the key of tenant {tenant!r} must be {KEY_MIN}-{KEY_MAX} printable characters "
                        "without spaces (e.g. `openssl rand -hex 32`)")
    if not policies:
        raise KeysError(f"{where}: tenant {tenant!r} allows no policy (leave policies out for every policy)")
    if ANY_POLICY in policies:
        if len(policies) > 1:
            raise KeysError(f"{where}: tenant {tenant!r}: '*' (every policy) stands alone")
        return ClientKey(tenant, key, None)
    for policy in policies:
        problem = name_problem("policy", policy)
        if problem is not None:
            raise KeysError(f"{where}: tenant {tenant!r}: {problem}")
    return ClientKey(tenant, key, frozenset(policies))
