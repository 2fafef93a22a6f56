"""rollout-bus: a Redis-driven rollout service for asynchronous RL post-training of LLMs.

Installed, the project claims this one import name. Its subpackages live in the
repository's top-level folders, each linked here under its name (``rollout_bus/events`` is
a link to ``../events``), so ``rollout_bus.events.names`` is the file ``events/names.py``:

- ``rollout_bus.events``: the bus (names, schema, publish, consume, retention, registry,
  connections) and the batch data plane (batch format, payload stores, train data), and
  the rollout request contract between trainers and executors;
- ``rollout_bus.controller``, ``rollout_bus.executor``, ``rollout_bus.trainer``: the three
  roles, which talk to each other only through ``events``;
- ``rollout_bus.engine`` (the CPU engine speaking SGLang's HTTP API, and the client for
  it), ``rollout_bus.lm`` (the models), ``rollout_bus.tasks`` (verifiable tasks);
- ``rollout_bus.replay``: event logs (export, import, timeline, verify, feed, offline
  retraining);
- ``rollout_bus.launch``: the one-command run (configuration, process supervision,
  following and summarising the run);
- ``rollout_bus.cli``: the ``rollout-bus`` command.
"""

__version__ = "0.2.0"
