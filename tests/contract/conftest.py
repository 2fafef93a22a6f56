"""The SGLang contract lane: tests that drive the real sglang package (``scripts/sglang_contract.sh``
builds its venv; ``.ci/run`` runs ``tests/contract`` inside it). Outside that venv every module here
skips, naming the missing package.

sglang 0.5.23's routes build ``ORJSONResponse``, which fastapi 0.165 deprecates with a UserWarning, and
its imports warn about kernels missing on this platform: under the project's ``filterwarnings = error``
those would turn into 500s and import errors, so these exact messages are ignored here.
"""

from __future__ import annotations

import pytest

IGNORED = (
    "ignore:ORJSONResponse is deprecated:UserWarning",
    "ignore:Using `httpx` with `starlette.testclient` is deprecated:UserWarning",
    "ignore:Only CUDA:UserWarning",
    "ignore:Triton is not supported:UserWarning",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in IGNORED:
        config.addinivalue_line("filterwarnings", line)
