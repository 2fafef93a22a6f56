"""The cursor every indexed data source shares: items by sequence number, given-back items first.

A source subclasses ``IndexedSource`` and defines ``item(index)``; ``get_samples`` serves the
items given back (``add_samples``, lowest index first) before new ones, and ``save``/``load``
are the executor's cursor state (plain msgpack-able values).
"""

from __future__ import annotations

from typing import Any


class IndexedSource:
    def __init__(self) -> None:
        self._next = 0
        self._requeued: list[dict[str, Any]] = []

    def item(self, index: int) -> dict[str, Any]:
        raise NotImplementedError

    def get_samples(self, n: int) -> list[dict[str, Any]]:
        out = self._requeued[:n]
        self._requeued = self._requeued[n:]
        while len(out) < n:
            out.append(self.item(self._next))
            self._next += 1
        return out

    def add_samples(self, items: list[dict[str, Any]]) -> None:
        self._requeued.extend(items)
        self._requeued.sort(key=lambda it: it["index"])

    def save(self) -> dict[str, Any]:
        return {"next": self._next, "requeued": list(self._requeued)}

    def load(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self._next = int(state.get("next", 0))
        self._requeued = list(state.get("requeued", []))
