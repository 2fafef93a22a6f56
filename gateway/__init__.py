"""The agent session gateway: OpenAI's API per session, exact tokens, sessions pinned to engines.

Modules: ``chat`` (messages, the chat template, incremental rendering, tool calls), ``tito`` (what a call
adds to a session and what a session becomes as a sample; pure), ``engines`` (pinning and one turn's
generate call), ``service`` (open, turn, close, claim; no HTTP), ``app`` (the HTTP routes), ``server``
(running it inside an executor or as ``rollout-bus gateway``), ``metrics``.

Its room in the layers: below the roles (an executor runs it in-process for the agents it runs), above
``engine``, ``lm`` and ``events``; it imports no role, and talks to engines over HTTP and to everything
else through the bus (session state and journal in ``events.sessions``, events on the sessions stream).
"""
