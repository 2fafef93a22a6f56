"""Errors the engine raises on purpose; the HTTP layer maps each to a status code."""

from __future__ import annotations


class EngineError(Exception):
    """Root of the engine's own errors."""

    status = 500


class BadRequest(EngineError):
    """The request cannot be served as written; the message says what to fix."""

    status = 400


class Unavailable(EngineError):
    """The engine cannot serve this now (stopping, weights released, paused health check)."""

    status = 503


class Overloaded(EngineError):
    """The engine holds as many queued sequences as it is configured for; the message says the bound."""

    status = 429
