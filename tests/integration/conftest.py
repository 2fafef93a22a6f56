"""Fixtures shared by the integration tests of agent sessions (defined in tests/support/gateway.py)."""

from tests.support.gateway import agent_engine, agent_model  # noqa: F401 - fixtures: a tiny LM with room for turns
