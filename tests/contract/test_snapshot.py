"""The installed sglang against the checked-in snapshot of what the project uses of it: a release that
changes a field, a default, a sampling key, a launch flag or a route fails the test named after it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.contract.lane import require_sglang

require_sglang()

from tests.contract.snapshot import take  # noqa: E402

SNAPSHOT: dict[str, Any] = json.loads((Path(__file__).parent / "sglang_snapshot.json").read_text())
LIVE: dict[str, Any] = take()
ENTRIES = sorted(k for k in SNAPSHOT if k != "sglang")


@pytest.mark.parametrize("entry", ENTRIES)
def test_what_the_project_uses_is_unchanged(entry: str) -> None:
    if LIVE.get(entry) != SNAPSHOT[entry]:
        pytest.fail(f"sglang {LIVE['sglang']} changed {entry} (snapshot of {SNAPSHOT['sglang']}): "
                    f"{SNAPSHOT[entry]!r} -> {LIVE.get(entry)!r}")


def test_the_snapshot_covers_everything_the_project_lists() -> None:
    assert set(LIVE) == set(SNAPSHOT), sorted(set(LIVE) ^ set(SNAPSHOT))
