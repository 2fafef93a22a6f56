"""The trainer side of rollout-bus: an SDK for trainers on the bus, and the reference GRPO trainer.

Nothing is imported here, so that light modules (``trainer.config``) stay light; import from
the modules:

- ``trainer.client.RolloutClient``: request rollouts, ``get(rollout_id)`` / ``next()`` their
  batches (consumer group per trainer, stable consumer name), ``ack`` after the step;
- ``trainer.weights.WeightPublisher``: version directories (tiny LM, Hugging Face, sharded, or a
  PEFT adapter) with their manifest, ``WeightsPublished``, ``wait_serving``;
- ``trainer.checkpoint.CheckpointStore`` / ``TrainerState``: atomic checkpoints with the
  trained batch ids;
- ``trainer.staleness.split_stale``, ``trainer.requeue.stale_items``, ``trainer.shards.shard``;
- ``trainer.service.Trainer`` (config ``trainer.config.TrainerConfig``): the reference trainer,
  modes ``sync``, ``one-step`` and ``async``; ``trainer.learner`` / ``trainer.grpo``: its GRPO
  step with truncated importance sampling;
- ``trainer.metric_loggers``: each step's metrics through one ``MetricLogger`` interface to
  JSONL, TensorBoard and W&B (``StepLogger``, ``STEP_SCALARS``);
- ``trainer.recorder.Recorder`` / ``read_recording``: a passive subscriber;
- ``trainer.cli``: ``rollout-bus trainer`` and ``rollout-bus record``.

The rollout request a trainer sends is part of the bus contract (``events.rollouts``,
``events.submit``); the trainer never touches executor state.
"""
