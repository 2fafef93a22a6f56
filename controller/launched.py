"""The engines this controller process launched, known outside Redis.

The registry and the engine log say which engines exist, but they live in Redis: after Redis lost
its data, a controller that trusted them alone would launch new engines beside the ones it still
runs, and leak those. ``Launched`` keeps every engine it launched (id, url, pid) in memory for the
life of the process, shared by each service the leader runner starts, and with a log directory in
``launched-<instance>.json`` there too, so a controller of that instance restarted on that directory
knows them as well (a standby instance sharing the directory keeps a file of its own).

A service that takes over adds each one whose process still runs and that the registry does not
list, and adopts it (or stops it when it is no longer wanted) like any other. A leader that lost
the lease hands an engine over only when the registry lists it with its pid, since that is where
the next leader finds it; one the registry does not list is stopped (``LeaderRunner.hand_over``).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from rollout_bus.controller.backends import pid_alive
from rollout_bus.events.registry import EngineRecord

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class LaunchedEngine:
    engine_id: str
    url: str
    pid: int

    def alive(self) -> bool:
        """Whether the process still runs and is still this engine (its command line names its port)."""
        port = urlsplit(self.url).port
        return pid_alive(self.pid, port)

    def listed_in(self, records: dict[str, EngineRecord]) -> bool:
        record = records.get(self.engine_id)
        return record is not None and record.pid == self.pid


class Launched:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._engines: dict[str, LaunchedEngine] = {}
        if path is not None:
            self._engines = _load(path)

    @classmethod
    def in_dir(cls, log_dir: str | None, instance: str) -> Launched:
        """The record of ``instance`` in ``log_dir``; only in memory without a log directory."""
        return cls(Path(log_dir) / f"launched-{_safe(instance)}.json" if log_dir else None)

    def add(self, engine_id: str, url: str, pid: int) -> None:
        self._engines[engine_id] = LaunchedEngine(engine_id, url, pid)
        self._save()

    def drop(self, engine_id: str, pid: int | None = None) -> None:
        """Forget ``engine_id`` (only if it is still the process ``pid``, when given)."""
        engine = self._engines.get(engine_id)
        if engine is not None and (pid is None or engine.pid == pid):
            del self._engines[engine_id]
            self._save()

    def engines(self) -> list[LaunchedEngine]:
        return list(self._engines.values())

    def alive(self) -> list[LaunchedEngine]:
        """The launched engines whose process still runs; the others are forgotten."""
        gone = [e for e in self._engines.values() if not e.alive()]
        for engine in gone:
            self.drop(engine.engine_id, engine.pid)
        return list(self._engines.values())

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".launched-", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump([asdict(e) for e in self._engines.values()], f)
            os.replace(tmp, self.path)
        except OSError as exc:  # the in-memory record still serves this process
            log.warning("cannot record launched engines in %s: %s", self.path, exc)


def _safe(instance: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in instance) or "_"


def _load(path: Path) -> dict[str, LaunchedEngine]:
    """The engines recorded in ``path``; entries that are not well formed are skipped with a warning."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return {}
    out: dict[str, LaunchedEngine] = {}
    for item in raw if isinstance(raw, list) else []:
        if (isinstance(item, dict) and isinstance(item.get("engine_id"), str) and isinstance(item.get("url"), str)
                and isinstance(item.get("pid"), int) and not isinstance(item.get("pid"), bool) and item["pid"] > 0):
            out[item["engine_id"]] = LaunchedEngine(item["engine_id"], item["url"], item["pid"])
        else:
            log.warning("ignoring a malformed entry of %s: %r", path, item)
    return out
