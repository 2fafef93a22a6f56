"""What every contract module starts with: sglang imported quietly, or the module skipped with why."""

from __future__ import annotations

import warnings

import pytest


def require_sglang() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("sglang.srt.entrypoints.http_server",
                            reason="the SGLang contract lane runs in the venv of scripts/sglang_contract.sh")
