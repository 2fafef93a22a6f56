"""Numbers read from environment variables: one parser, and one clear error for a bad value.

A variable that is unset or empty gives the default. Anything else must parse and lie in range, or
``InvalidRequest`` names the variable, what it must be and what it holds: a typo in a deployment's
environment stops the process that reads it instead of being replaced by a default without a word.
"""

from __future__ import annotations

import math
import os

from rollout_bus.events.errors import InvalidRequest


def env_int(name: str, default: int, *, minimum: int) -> int:
    """``name`` as a whole number of at least ``minimum``; ``default`` when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"{name} must be a whole number >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise InvalidRequest(f"{name} must be a whole number >= {minimum}, got {raw!r}")
    return value


def env_seconds(name: str, default: float, *, zero: bool = False, forever: bool = False) -> float:
    """``name`` as a finite number of seconds, above 0 (or also 0 with ``zero``; ``inf`` too with ``forever``);
    ``default`` when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    bound = (">= 0" if zero else "> 0") + (", or inf" if forever else "")
    try:
        value = float(raw)
    except ValueError:
        raise InvalidRequest(f"{name} must be a number of seconds {bound}, got {raw!r}") from None
    if math.isnan(value) or value < 0 or (value == 0 and not zero) or (math.isinf(value) and not forever):
        raise InvalidRequest(f"{name} must be a{'' if forever else ' finite'} number of seconds {bound}, "
                             f"got {raw!r}")
    return value
