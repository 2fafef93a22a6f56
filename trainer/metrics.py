"""Prometheus metrics of a trainer process (served by ``events.metrics.serve_metrics``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

STEPS = Counter("rollout_bus_trainer_steps_total", "Training steps done", ["policy", "trainer"])
VERSION = Gauge("rollout_bus_trainer_weight_version", "The trainer's current weight version",
                ["policy", "trainer"])
BATCHES = Counter("rollout_bus_trainer_batches_total", "Batches consumed, by outcome",
                  ["policy", "trainer", "outcome"])
STALE_GROUPS = Counter("rollout_bus_trainer_stale_groups_total", "Prompt groups over the staleness budget",
                       ["policy", "trainer", "action"])
STALENESS = Histogram("rollout_bus_trainer_sample_staleness", "Staleness of trained samples (versions)",
                      ["policy", "trainer"], buckets=(0, 1, 2, 3, 4, 6, 8, 16))
REWARD = Gauge("rollout_bus_trainer_reward_mean", "Mean raw reward of the last trained batch",
               ["policy", "trainer"])
STEP_SECONDS = Histogram("rollout_bus_trainer_step_seconds", "Time per training step, by phase",
                         ["policy", "trainer", "phase"],
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
