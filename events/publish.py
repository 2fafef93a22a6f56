"""Idempotent publishing: the dedupe key and the XADD in one Lua script."""

from __future__ import annotations

import logging
from typing import Any

import redis
from redis.exceptions import NoScriptError

from events.connection import Guard
from events.names import Keys
from events.schema import FIELD, Event, Producer, encode

log = logging.getLogger(__name__)

# KEYS[1] stream, KEYS[2] dedupe key (absent for none); ARGV[1] dedupe ttl s, ARGV[2] maxlen (0 = none),
# ARGV[3..] field, value pairs. Returns the id of the entry, the existing one on a repeat.
_PUBLISH = """
if KEYS[2] then
  local prev = redis.call('GET', KEYS[2])
  if prev then return prev end
end
local id
if tonumber(ARGV[2]) > 0 then
  id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 3))
else
  id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
end
if KEYS[2] then
  redis.call('SET', KEYS[2], id, 'EX', tonumber(ARGV[1]))
end
return id
"""


class Publisher:
    """Appends events to streams; a repeated idempotency key never adds a second entry.

    One round trip per event: ``EVALSHA`` of the publish script (loaded again if the server
    lost its script cache, e.g. after a restart).
    """

    def __init__(self, client: redis.Redis, keys: Keys, producer: Producer, *,
                 dedupe_ttl_s: int = 7 * 86400, guard: Guard | None = None) -> None:
        self.client = client
        self.keys = keys
        self.producer = producer
        self.dedupe_ttl_s = dedupe_ttl_s
        self.guard = guard or Guard(client, name=f"publisher {producer}")
        self._script = client.register_script(_PUBLISH)
        self._dedupe_prefix: dict[str, str] = {}

    def publish(self, stream: str, event: Event, *, idempotency_key: str | None = None,
                maxlen: int = 0) -> str:
        """Append ``event``; the idempotency key defaults to the event id, so a retry is safe."""
        fields = encode(event)
        return self._publish([stream, self._dedupe_key(stream, idempotency_key or event.event_id)],
                             [self.dedupe_ttl_s, maxlen, FIELD, fields[FIELD]])

    def publish_fields(self, stream: str, fields: dict[bytes, bytes], *, idempotency_key: str | None = None,
                       maxlen: int = 0) -> str:
        # no empty key name when there is no dedupe key: every key a script names must hash to one slot
        script_keys = [stream, self._dedupe_key(stream, idempotency_key)] if idempotency_key else [stream]
        args: list[Any] = [self.dedupe_ttl_s, maxlen]
        for k, v in fields.items():
            args += [k, v]
        return self._publish(script_keys, args)

    def _dedupe_key(self, stream: str, key: str) -> str:
        prefix = self._dedupe_prefix.get(stream)
        if prefix is None:
            prefix = self._dedupe_prefix[stream] = self.keys.dedupe(stream, "")
        return prefix + key

    def _publish(self, script_keys: list[str], args: list[Any]) -> str:
        entry_id = self.guard.call(lambda c: self._evalsha(c, script_keys, args))
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    def _evalsha(self, c: redis.Redis, script_keys: list[str], args: list[Any]) -> Any:
        try:
            return c.execute_command("EVALSHA", self._script.sha, len(script_keys), *script_keys, *args)
        except NoScriptError:  # a restarted or flushed server has an empty script cache
            self._script.sha = c.script_load(self._script.script)
            return c.execute_command("EVALSHA", self._script.sha, len(script_keys), *script_keys, *args)
