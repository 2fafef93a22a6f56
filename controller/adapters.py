"""Adapters reconciled with what an engine really holds, on every health round.

SGLang keeps every adapter name it ever loaded (``TokenizerManager.lora_ref_cache``) and loads one
again, from its path, when a request names it after it was unloaded: an executor holding a stale
registry snapshot can bring back ``p@v2`` after the controller retired it, and SGLang keeps it loaded
without telling anyone. Each round compares ``/v1/models`` with the engine's record
(``EngineRecord.adapters``, the one name per policy executors are given):

- a name of the controller's scheme (``<policy>@v<version>``) that the record does not give out is a
  stray; seen in two rounds in a row (so a name retired a moment ago, or loaded by a push that has not
  switched the record yet, is left alone), it is unloaded;
- a name the record gives out that the engine does not list is gone (an LRU eviction, a restart the
  controller missed): the policy's version is dropped from the record, so the next weight round pushes
  it again.

Names of any other form are not the controller's and are left alone. Requests already running on a
stray finish first (SGLang's unload waits for them); a sample's version is the one in the name it was
generated under, so a reloaded stray never mislabels a sample.
"""

from __future__ import annotations

import logging

from rollout_bus.controller.core import Core
from rollout_bus.controller.state import EngineHandle
from rollout_bus.controller.versions import loaded_adapters
from rollout_bus.engine.http_client import EngineHTTPError
from rollout_bus.events.registry import EngineState

log = logging.getLogger(__name__)


class AdapterReconciler:
    def __init__(self, core: Core) -> None:
        self.core = core
        self._suspects: dict[str, set[str]] = {}
        """engine id -> strays seen in the last round."""

    async def reconcile(self, h: EngineHandle) -> list[str]:
        """One round for one serving engine: the policies whose adapters are gone (to push again)."""
        cfg = self.core.config
        if not cfg.enable_lora:
            return []
        gone: list[str] = []
        async with self.core.operate(h):  # read under the lock: no push loads or switches a name meanwhile
            if h.state != EngineState.SERVING:
                return []
            try:
                listed = loaded_adapters(await h.client.models(timeout_s=cfg.request_timeout_s))
            except EngineHTTPError as exc:
                log.info("engine %s: /v1/models unreadable (%s); adapters not reconciled", h.engine_id, exc.message)
                return []
            names = {name for versions in listed.values() for _, name in versions}
            given = set(h.record.adapters.values())
            strays = names - given
            confirmed = sorted(strays & self._suspects.get(h.engine_id, set()))
            self._suspects[h.engine_id] = strays - set(confirmed)
            for name in confirmed:
                try:
                    await h.client.unload_lora_adapter(name, timeout_s=cfg.update_timeout_s)
                    log.warning("engine %s held adapter %s, which no record gives out: unloaded", h.engine_id, name)
                except EngineHTTPError as exc:
                    log.warning("engine %s: unloading stray adapter %s failed: %s", h.engine_id, name, exc.message)
            for policy, name in sorted(h.record.adapters.items()):
                if name not in names:
                    log.warning("engine %s no longer holds adapter %s: %s will be loaded again", h.engine_id,
                                name, policy)
                    del h.record.adapters[policy]
                    h.record.versions.pop(policy, None)
                    gone.append(policy)
            if gone:
                await self.core.save(h)
        return gone

    def forget(self, engine_id: str) -> None:
        self._suspects.pop(engine_id, None)
