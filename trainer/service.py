"""The reference trainer: one policy, one consumer group, GRPO on ``lm.TinyLM`` or on a Hugging Face
causal LM (``model_path`` a HF directory: ``trainer.hf_learner``, all weights or a LoRA adapter).

Modes (DESIGN.md section 2):

- ``sync``: request rollout ``r``, wait for its batch, train, publish ``v+1`` and wait
  until the engines serve it; every sample is on-policy (staleness 0).
- ``one-step``: request ``r+1`` before training on ``r``; before publishing the new
  weights, wait for ``r+1``'s batch (miles' ``train_async.py``), so with an update per
  step every batch after the first is exactly one version stale.
- ``async``: keep ``in_flight`` requests queued, train on whichever batch arrives first,
  publish without waiting; groups whose oldest sample is more than ``max_staleness``
  versions behind are dropped or their prompts requeued.

One step: train, save the weights file of ``v+1``, checkpoint (model, optimiser, trained
batch ids, step, version; atomically), then ack the batch (``BatchConsumed``), then
``WeightsPublished`` and ``TrainStepDone``. A batch without signal (every advantage 0: each group all
right or all wrong, or every token masked by ``--off-policy mis``) is a step that publishes nothing: the learner takes no optimiser step, the version
stays, the batch is acked unused (``no signal``) and checkpointed as done, and ``TrainStepDone`` carries
the unchanged version with ``skipped_no_signal`` 1 (so a step count and a version count differ). Every one of these writes is bound to the policy
lease (``trainer.lease``): a trainer paused past it gets ``LeaseLost`` at the next one and stops. A restarted trainer loads the checkpoint,
re-reads its pending batches first, skips-and-acks those the checkpoint lists and
republishes its version if the crash came before the announcement.

Nothing poisons training: a batch the client refuses on the way in (``RolloutClient.refused``:
dead-lettered with its reason) and a step the learner refuses (``trainer.finite.NonFiniteStep``:
a non-finite loss, gradient or result, the weights left as they were) are counted, the batch is
dead-lettered, its rollout asked for again, and the trainer goes on; nothing non-finite is ever
saved, checkpointed or published.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollout_bus.events.connection import Redis
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.rollouts import RequestBounds
from rollout_bus.events.schema import STALENESS_PREFIX, Producer, TrainStepDone
from rollout_bus.events.train_data import TrainData
from rollout_bus.lm.hf import is_hf_dir
from rollout_bus.lm.model import ModelConfig, TinyLM, load_config, load_model
from rollout_bus.trainer import metrics as m
from rollout_bus.trainer.broadcast import WeightSender
from rollout_bus.trainer.checkpoint import Checkpoint, CheckpointStore, TrainerState
from rollout_bus.trainer.client import ClientConfig, ReceivedBatch, RolloutClient
from rollout_bus.trainer.colocate import Colocation
from rollout_bus.trainer.config import ConfigError, TrainerConfig
from rollout_bus.trainer.finite import NonFiniteStep, nonfinite_parameters
from rollout_bus.trainer.learner import Learner
from rollout_bus.trainer.metric_loggers import NEEDED_METRICS, StepLogger
from rollout_bus.trainer.redis_shards import ShardedClient, ShardedWeights, sharded
from rollout_bus.trainer.requeue import stale_items
from rollout_bus.trainer.staleness import split_stale
from rollout_bus.trainer.weights import WeightPublisher

if TYPE_CHECKING:
    from rollout_bus.trainer.hf_learner import HFLearner as HFLearnerType

log = logging.getLogger(__name__)

StepHook = Callable[[TrainerState, dict[str, float]], None]
CheckpointHook = Callable[[TrainerState], None]


@dataclass
class _Timers:
    request_sent: dict[int, float] = field(default_factory=dict)


class Trainer:
    """Explicit ``start`` / ``run`` / ``stop``; see the module docstring for one step."""

    # --- construction ----------------------------------------------------------------------
    def __init__(self, config: TrainerConfig, client: Redis, keys: Keys | None = None) -> None:
        self.config = config.validate()
        if config.dp_size != 1:
            raise ConfigError("the reference trainer runs one data-parallel rank (dp_size 1); the client "
                              "supports ranks (trainer.client, trainer.shards) for trainers that sync gradients")
        self.redis = client
        self.keys = keys or Keys(config.namespace)
        self.producer = Producer("trainer", f"{config.instance}-{config.trainer_id}")
        self.on_step: list[StepHook] = []
        """Called after each step is acked, with the step's metrics."""
        self.after_checkpoint: list[CheckpointHook] = []
        """Called after each step's checkpoint is written and before its batch is acked."""
        # --- set by start() ---
        self.model: Any = None
        """A ``TinyLM``, a Hugging Face model, or a ``PeftModel`` (LoRA)."""
        self.learner: Learner | HFLearnerType | None = None
        self._save_kwargs: dict[str, Any] = {}
        self.state: TrainerState | None = None
        self.client: RolloutClient | ShardedClient | None = None
        self.weights: WeightPublisher | ShardedWeights | None = None
        self.sender: WeightSender | None = None
        self.step_log: StepLogger | None = None
        """Each step's metrics to the backends of ``config.log`` (after the step's version is published)."""
        self.store = CheckpointStore(config.checkpoint_dir) if config.checkpoint_dir else None
        self.publisher = Publisher(client, self.keys, self.producer)
        self._timers = _Timers()
        self._labels = (config.policy, config.trainer_id)
        self._wait_ms = 0.0
        self.colocation: Colocation | None = (
            Colocation(client, self.keys, self.producer, config.policy) if config.schedule.colocate else None)
        self._colocate_ms: dict[str, float] = {}

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> TrainerState:
        """Load the checkpoint (or the initial weights), join the group, make sure the engines serve us."""
        cfg = self.config
        torch.set_num_threads(max(1, cfg.torch_threads))
        torch.manual_seed(cfg.seed)
        checkpoint = self.store.load() if self.store is not None else None
        if cfg.model_path and is_hf_dir(cfg.model_path):
            self._start_hf(checkpoint)
        else:
            self._start_tiny(checkpoint)
        client_config = ClientConfig(
            policy=cfg.policy, trainer_id=cfg.trainer_id, group=cfg.group, consumer_index=cfg.dp_rank,
            dp_size=cfg.dp_size, lease_ttl_s=cfg.lease_ttl_s, rollout=cfg.rollout,
            vocab_size=_vocab_size(self.model))
        if cfg.shards:  # several Redis primaries (trainer.redis_shards): no colocation, weights by disk
            self.client, self.weights = sharded(
                cfg.shards, self.keys, client_config, self.producer, weights_root=cfg.publish.weights_root,
                keep_versions=cfg.publish.keep_versions)
        else:
            self.client = RolloutClient(self.redis, self.keys, client_config, self.producer)
            self.sender = self._sender()
            self.weights = WeightPublisher(self.redis, self.keys, cfg.policy, cfg.publish.weights_root,
                                           self.producer, keep_versions=cfg.publish.keep_versions,
                                           lease=self.client.lease, sender=self.sender)
        self.step_log = StepLogger(cfg)
        self.client.start()
        state = self._st()
        self.weights.adopt(state.version)
        self._ensure_served()
        if state.step > 0:  # a crash may have come between the checkpoint and the announcement
            self._announce_step()
            self._log_recovered_step()
        m.VERSION.labels(*self._labels).set(state.version)
        log.info("trainer %s of %s at step %d, version %d (%s mode, %d in flight)", cfg.trainer_id, cfg.policy,
                 state.step, state.version, cfg.schedule.mode, len(state.in_flight))
        return state

    def _start_tiny(self, checkpoint: Checkpoint | None) -> None:
        cfg = self.config
        temperature = cfg.rollout.temperature
        if checkpoint is not None:
            model = TinyLM(ModelConfig.from_dict(checkpoint.model_config) if checkpoint.model_config
                           else load_config(cfg.model_path))
            model.load_state_dict(checkpoint.model)
            self.learner = Learner(model, cfg.optim, cfg.loss, temperature=temperature)
            self.learner.optimizer.load_state_dict(checkpoint.optimizer)
            self.state = checkpoint.state
        else:
            if not cfg.model_path:
                raise ConfigError("model_path is required when there is no checkpoint to resume")
            model = load_model(cfg.model_path)
            self.learner = Learner(model, cfg.optim, cfg.loss, temperature=temperature)
            self.state = TrainerState(version=cfg.initial_version)
        self.model = model

    def _start_hf(self, checkpoint: Checkpoint | None) -> None:
        """A Hugging Face causal LM from ``model_path`` (full weights, or a LoRA adapter on it); a
        checkpoint holds the trained parameters (the adapter's alone for LoRA) and the optimiser."""
        from rollout_bus.lm import hf
        from rollout_bus.trainer.hf_learner import HFLearner, load_causal_lm

        cfg = self.config
        hf.quiet()
        settings = replace(cfg.hf, temperature=cfg.rollout.temperature)
        learner = HFLearner(load_causal_lm(cfg.model_path), cfg.optim, cfg.loss, settings)
        tokenizer = _tokenizer_of(cfg.model_path)
        if not cfg.rollout.stop_token_ids:
            cfg.rollout.stop_token_ids = stop_ids(cfg.model_path, tokenizer.eos_token_id)
        # a full version is a whole model directory: the tokenizer goes beside the weights
        self._save_kwargs = {} if learner.is_lora else {"tokenizer": tokenizer}
        if checkpoint is not None:
            missing = [n for n in _trainable_state(learner.model) if n not in checkpoint.model]
            if missing:
                raise ConfigError(f"the checkpoint in {cfg.checkpoint_dir} does not fit {cfg.model_path}"
                                  f"{' with LoRA' if learner.is_lora else ''}: it lacks {missing[:3]}")
            learner.model.load_state_dict(checkpoint.model, strict=False)
            learner.optimizer.load_state_dict(checkpoint.optimizer)
            self.state = checkpoint.state
        else:
            self.state = TrainerState(version=cfg.initial_version)
        self.learner = learner
        self.model = learner.model

    def _sender(self) -> WeightSender | None:
        """With ``publish.weight_sync`` broadcast: rank 0 of the engines' weight-update groups (full weights only)."""
        p = self.config.publish
        if p.weight_sync != "broadcast" or (self.learner is not None and getattr(self.learner, "is_lora", False)):
            return None
        sender = WeightSender(self.redis, self.keys, self.config.policy, host=p.group_host, port=p.group_port,
                              bucket_bytes=int(p.bucket_mb * (1 << 20)), timeout_s=p.group_timeout_s,
                              keep=p.group_keep)
        sender.start()
        log.info("offering weights by collective: rendezvous store at %s", sender.address)
        return sender

    def stop(self) -> None:
        if self.sender is not None:
            self.sender.stop(drain_s=5.0)
        if self.client is not None:
            self.client.stop()
        if self.step_log is not None:
            self.step_log.close()

    def _ensure_served(self) -> None:
        """Publish the current version if the controller never got it; wait until it is served."""
        assert self.weights is not None and self.state is not None and self.model is not None
        version = self.state.version
        self.weights.wait_engines(self.config.publish.serving_timeout_s)
        if self.colocation is not None and self.colocation.any_offloaded():  # stopped between offload and onload
            self.colocation.onload()
        if self.weights.serving_version() >= version:
            return
        if self.weights.published_version() < version:
            if nonfinite_parameters(self.model.parameters()):
                raise ConfigError(f"the weights of version {version} hold NaN or infinite values: not published")
            self.weights.publish(self.model, version, **self._save_kwargs)
        self.weights.wait_serving(version, self.config.publish.serving_timeout_s)

    # --- the loop --------------------------------------------------------------------------
    def run(self, steps: int | None = None) -> TrainerState:
        """Train until ``steps`` (default: the configured number) steps are done in total."""
        assert self.state is not None
        target = self.config.steps if steps is None else steps
        mode = self.config.schedule.mode
        while self.state.step < target:
            if mode == "sync":
                self._sync_step()
            elif mode == "one-step":
                self._one_step_ahead(target)
            else:
                self._async_step(target)
        return self.state

    def _sync_step(self) -> None:
        state = self._st()
        if not state.in_flight:
            self._request(state.next_rollout_id)
        rid = min(state.in_flight)
        batch = self._await(rid)
        if self.colocation is None:
            if self._consume(batch):
                self._publish_version(wait=self.config.wait_serving)
            return
        self._colocate_ms = {"offload_ms": self.colocation.offload() * 1000}  # the engines' memory, for training
        if self._consume(batch):
            self._publish_version(wait=True)  # onloads after publishing: the engines come back on the new version
        else:
            self.colocation.onload()  # no step: the rollout is asked again, on the engines as they were

    def _one_step_ahead(self, target: int) -> None:
        state = self._st()
        if not state.in_flight:
            self._request(state.next_rollout_id)
        rid = min(state.in_flight)
        batch = self._await(rid)
        if state.step + 1 < target and len(state.in_flight) < 2:
            self._request(state.next_rollout_id)
        trained = self._consume(batch)
        if not trained:
            return
        ahead = [r for r in state.in_flight if r > rid]
        if ahead and not self._step_published_nothing():  # miles: finish the in-flight rollout before updating
            self._wait_buffered(min(ahead))
        self._publish_version(wait=self.config.wait_serving)

    def _async_step(self, target: int) -> None:
        state = self._st()
        k = self.config.schedule.in_flight
        while len(state.in_flight) < min(k, target - state.step):
            self._request(state.next_rollout_id)
        if self._consume(self._await(None)):
            self._publish_version(wait=self.config.wait_serving)

    # --- requests --------------------------------------------------------------------------
    def _request(self, rollout_id: int, attempt: int = 1) -> None:
        state, client = self._st(), self._cl()
        request_id = client.request_id(state.run_id, rollout_id, attempt)
        cap = RequestBounds().max_returned  # items given back beyond a request's bound wait for the next one
        client.request(rollout_id, request_id, returned=state.returned[:cap])
        state.returned = state.returned[cap:]
        state.in_flight[rollout_id] = request_id
        state.attempts[rollout_id] = attempt
        state.next_rollout_id = max(state.next_rollout_id, rollout_id + 1)
        self._timers.request_sent[rollout_id] = time.monotonic()

    def _resubmit_overdue(self) -> None:
        state = self._st()
        now = time.monotonic()
        for rid, request_id in list(state.in_flight.items()):
            sent = self._timers.request_sent.setdefault(rid, now)
            if now - sent > self.config.rollout.timeout_s:
                attempt = state.attempts.get(rid, 1) + 1
                log.warning("rollout %d (%s) has no batch after %.0fs: asking again (attempt %d)", rid,
                            request_id, now - sent, attempt)
                state.count("rollouts_reasked")
                self._request(rid, attempt)

    def _ours(self, batch: ReceivedBatch) -> bool:
        state = self._st()
        rid = batch.rollout_id
        if rid not in state.in_flight:
            return False
        base = self._cl().request_id(state.run_id, rid)
        return batch.request_id == base or batch.request_id.startswith(base + "-a")

    # --- receiving -------------------------------------------------------------------------
    def _await(self, rollout_id: int | None) -> ReceivedBatch:
        """The batch of ``rollout_id`` (or, for None, the first batch of ours to arrive)."""
        client = self._cl()
        started = time.monotonic()
        deadline = started + self.config.get_timeout_s
        while True:
            self._ack_unneeded()
            batch = client.take(lambda b: self._ours(b) and (rollout_id is None or b.rollout_id == rollout_id))
            if batch is not None:
                if batch.deliveries > 1:  # delivered before: to a trainer that died, or reclaimed
                    self._st().count("redelivered_batches")
                self._wait_ms = (time.monotonic() - started) * 1000
                m.STEP_SECONDS.labels(*self._labels, "wait_batch").observe(self._wait_ms / 1000)
                return batch
            if time.monotonic() > deadline:
                raise TimeoutError(f"no batch for {'rollout ' + str(rollout_id) if rollout_id is not None else 'any'}"
                                   f" after {self.config.get_timeout_s:.0f}s")
            self._resubmit_overdue()
            client.poll()
            self._reask_refused()

    def _wait_buffered(self, rollout_id: int) -> None:
        client = self._cl()
        deadline = time.monotonic() + self.config.get_timeout_s
        while not any(b.rollout_id == rollout_id and self._ours(b) for b in client.buffered()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no batch for rollout {rollout_id} after {self.config.get_timeout_s:.0f}s")
            self._ack_unneeded()
            self._resubmit_overdue()
            client.poll()
            self._reask_refused()

    def _ack_unneeded(self) -> None:
        """Ack what needs no training: batches the checkpoint lists, and batches that are not ours."""
        state, client = self._st(), self._cl()
        done = state.done_batch_ids()
        while True:
            batch = client.take(lambda b: b.batch_id in done or not self._ours(b))
            if batch is None:
                return
            if batch.batch_id in done:
                log.info("batch %s was trained before the restart: skip and ack", batch.batch_id)
                state.count("skipped_already_trained")
                trained = batch.batch_id in {b for _, b in state.trained}
                client.ack(batch, staleness=max(0, state.version - batch.event.min_weight_version),
                           accepted=trained, reason="" if trained else "dropped before the restart")
                continue
            log.warning("batch %s (request %s) is not one this trainer waits for: acked unused",
                        batch.batch_id, batch.request_id)
            state.count("foreign_batches")
            state.dropped.append(batch.batch_id)
            m.BATCHES.labels(*self._labels, "foreign").inc()
            client.ack(batch, staleness=max(0, state.version - batch.event.min_weight_version), accepted=False,
                       reason="foreign: no request of this trainer waits for it")

    def _reask_refused(self) -> None:
        """Ask again for the rollouts whose batches the client dead-lettered (bad payload or values)."""
        state, client = self._st(), self._cl()
        for batch in client.refused():
            state.count("refused_batches")
            m.BATCHES.labels(*self._labels, "refused").inc()
            if self._ours(batch):
                log.warning("batch %s of rollout %d was dead-lettered (%s): asking for it again", batch.batch_id,
                            batch.rollout_id, batch.error)
                state.dropped.append(batch.batch_id)
                self._request(batch.rollout_id, state.attempts.get(batch.rollout_id, 1) + 1)

    # --- one batch -------------------------------------------------------------------------
    def _consume(self, batch: ReceivedBatch) -> bool:
        """Train on ``batch`` (what the staleness budget leaves of it); True when a step was made."""
        state, client, cfg = self._st(), self._cl(), self.config
        rid = batch.rollout_id
        batch_staleness = max(0, state.version - batch.event.min_weight_version)
        data = batch.data
        if data is None:
            log.warning("batch %s has no usable payload (%s): asking for rollout %d again", batch.batch_id,
                        batch.error, rid)
            state.count("payload_missing")
            state.dropped.append(batch.batch_id)
            client.ack(batch, staleness=batch_staleness, accepted=False, reason=f"payload missing: {batch.error}")
            self._request(rid, state.attempts.get(rid, 1) + 1)
            return False
        state.in_flight.pop(rid, None)
        self._timers.request_sent.pop(rid, None)
        budget = cfg.schedule.max_staleness if cfg.schedule.mode == "async" else None
        split = split_stale(data, state.version, budget)
        if split.stale_groups:
            action = cfg.schedule.stale_policy
            state.count("stale_groups", len(split.stale_groups))
            state.count("stale_samples", split.stale_samples)
            m.STALE_GROUPS.labels(*self._labels, action).inc(len(split.stale_groups))
            if action == "requeue":
                items = stale_items(data, split.stale_groups)
                state.returned.extend(items)  # they travel with the next request
                state.count("requeued_groups", len(items))
        fresh = split.fresh
        if fresh is None:
            log.info("batch %s is entirely stale (%d versions behind): not trained", batch.batch_id,
                     batch_staleness)
            state.count("stale_batches")
            state.dropped.append(batch.batch_id)
            m.BATCHES.labels(*self._labels, "stale").inc()
            client.ack(batch, staleness=batch_staleness, accepted=False,
                       reason=f"stale: {batch_staleness} versions behind, budget {budget}")
            return False
        return self._train(batch, fresh, split.staleness, batch_staleness)

    def _train(self, batch: ReceivedBatch, data: TrainData, staleness_all: torch.Tensor,
               batch_staleness: int) -> bool:
        state, client, learner = self._st(), self._cl(), self._ln()
        t0 = time.perf_counter()
        trained_staleness = state.version - data.weight_versions
        try:
            metrics = learner.train_step(data)
            if nonfinite_parameters(self.model.parameters()):  # whatever the learner: never saved or published
                raise NonFiniteStep("the model holds non-finite weights after the step")
        except NonFiniteStep as exc:
            self._refuse_step(batch, str(exc))
            return False
        metrics.setdefault("entropy", math.nan)  # the HF learner does not compute the full-vocabulary entropy
        skipped = bool(metrics.get("skipped_no_signal"))
        state.step += 1
        if skipped:  # no optimiser step was taken: the weights are the current version's, nothing to publish
            state.count("skipped_no_signal")
            state.dropped.append(batch.batch_id)
        else:
            state.version += 1
            state.trained.append((state.step, batch.batch_id))
        for s in trained_staleness.tolist():
            state.staleness_hist[int(s)] = state.staleness_hist.get(int(s), 0) + 1
            m.STALENESS.labels(*self._labels).observe(s)
        reward = float(data.raw_reward.mean())
        state.rewards.append(reward)
        t1 = time.perf_counter()
        metrics.update(
            reward_mean=reward, reward_std=float(data.raw_reward.float().std(correction=0)), reward_batch_mean=float(batch.data.raw_reward.mean()) if batch.data else reward,
            n_samples=float(len(data)), n_samples_batch=float(batch.event.n_samples),
            staleness_max=float(trained_staleness.max()), staleness_mean=float(trained_staleness.float().mean()),
            batch_staleness=float(batch_staleness), batch_staleness_all_max=float(staleness_all.max()),
            rollout_id=float(batch.rollout_id), wait_ms=self._wait_ms, step_ms=(t1 - t0) * 1000,
            in_flight=float(len(state.in_flight)), stale_groups_total=state.counters.get("stale_groups", 0.0),
            stale_samples_total=state.counters.get("stale_samples", 0.0),
            redelivered_batches_total=state.counters.get("redelivered_batches", 0.0),
            skipped_no_signal_total=state.counters.get("skipped_no_signal", 0.0))
        batch_metrics = (batch.data.metadata.get("metrics") if batch.data is not None else None) or {}
        for key in ("correct_frac", "formatted_frac", "response_len_mean", "truncated_frac", "groups_drawn",
                    "groups_filtered"):
            value = batch_metrics.get(key) if isinstance(batch_metrics, dict) else None
            if isinstance(value, int | float) and not isinstance(value, bool):
                metrics[key] = float(value)  # the executors' judgement of the batch's answers
        for s, n in zip(*torch.unique(trained_staleness, return_counts=True), strict=True):
            metrics[f"{STALENESS_PREFIX}{int(s)}"] = float(n)
        state.last_metrics = metrics
        assert self.weights is not None and self.model is not None
        if not skipped:
            self.weights.save(self.model, state.version, **self._save_kwargs)
        metrics["weights_save_ms"] = (time.perf_counter() - t1) * 1000
        if self.store is not None:  # a skipped step is checkpointed too: a restart must not take it again
            self.store.save(state, self.model, learner.optimizer, model_state=None if isinstance(learner, Learner)
                            else _trainable_state(self.model), before_replace=client.lease.verify)
        metrics["save_ms"] = (time.perf_counter() - t1) * 1000
        if self.store is not None:
            metrics["checkpoint_s"] = (metrics["save_ms"] - metrics["weights_save_ms"]) / 1000
        for after in self.after_checkpoint:
            after(state)
        if skipped:
            client.ack(batch, staleness=batch_staleness, accepted=False, reason=_no_signal_reason(metrics))
            m.BATCHES.labels(*self._labels, "no_signal").inc()
        else:
            client.ack(batch, staleness=batch_staleness, accepted=True)
            m.BATCHES.labels(*self._labels, "trained").inc()
        m.STEPS.labels(*self._labels).inc()
        m.REWARD.labels(*self._labels).set(reward)
        m.STEP_SECONDS.labels(*self._labels, "train").observe(t1 - t0)
        for hook in self.on_step:
            hook(state, metrics)
        if skipped:
            log.info("step %d: %s in batch %s (reward %.3f on %d samples), version stays %d", state.step,
                     _no_signal_reason(metrics), batch.batch_id, reward, len(data), state.version)
        else:
            log.info("step %d: reward %.3f on %d samples (staleness max %d), loss %.4f, %.0f ms", state.step, reward,
                     len(data), int(trained_staleness.max()), metrics.get("loss", 0.0), (t1 - t0) * 1000)
        return True

    def _refuse_step(self, batch: ReceivedBatch, reason: str) -> None:
        """A step the learner refused: the batch is dead-lettered with the reason and its rollout asked again."""
        state, client = self._st(), self._cl()
        log.error("batch %s: %s; dead-lettered, asking for rollout %d again", batch.batch_id, reason,
                  batch.rollout_id)
        state.count("refused_steps")
        state.dropped.append(batch.batch_id)
        m.BATCHES.labels(*self._labels, "refused").inc()
        client.refuse(batch, f"batch {batch.batch_id}: {reason}")
        self._request(batch.rollout_id, state.attempts.get(batch.rollout_id, 1) + 1)

    def _step_published_nothing(self) -> bool:
        """Whether the last step took no optimiser step (no signal): it has no new version to publish."""
        return bool(self._st().last_metrics.get("skipped_no_signal"))

    def _publish_version(self, *, wait: bool) -> None:
        state, cfg = self._st(), self.config
        assert self.weights is not None
        if self._step_published_nothing():  # the engines already serve this version: announce the step alone
            timings = {"publish_ms": 0.0, "serving_wait_ms": 0.0}
            self._announce_step(**timings)
            if self.step_log is not None:
                self.step_log.step(state.step, state.version, {**state.last_metrics, **timings})
            return
        t0 = time.perf_counter()
        published = self.weights.publish(None, state.version)
        t1 = time.perf_counter()
        m.VERSION.labels(*self._labels).set(state.version)
        colocated: dict[str, float] = {}
        if self.colocation is not None:
            colocated = {**self._colocate_ms, "onload_ms": self.colocation.onload() * 1000}
            self._colocate_ms = {}
        waited = 0.0
        if wait:
            waited = self.weights.wait_serving(state.version, cfg.publish.serving_timeout_s,
                                               after_id=published.entry_id)
            m.STEP_SECONDS.labels(*self._labels, "wait_serving").observe(waited)
        timings = {"publish_ms": (t1 - t0) * 1000, "serving_wait_ms": waited * 1000, **colocated}
        self._announce_step(**timings)
        if self.step_log is not None:
            self.step_log.step(state.step, state.version, {**state.last_metrics, **timings})

    def _log_recovered_step(self) -> None:
        """Log the checkpointed step when the crash came before its metric line.

        Its publish timings and throughput are unknown (NaN), as is any metric an older
        checkpoint did not record.
        """
        state = self._st()
        if self.step_log is not None and self.step_log.last_step < state.step:
            unknown = dict.fromkeys(NEEDED_METRICS, math.nan)
            self.step_log.step(state.step, state.version, {**unknown, **state.last_metrics}, interval_s=math.nan)

    def _announce_step(self, **extra: float) -> None:
        """``TrainStepDone`` of the current step (once: a restart repeats it under the same key)."""
        state, cfg = self._st(), self.config
        metrics = {**state.last_metrics, **extra}
        self._cl().announce(self.keys.trainer_stream, TrainStepDone(
            producer=self.producer, policy=cfg.policy, trainer_id=cfg.trainer_id, step=state.step,
            weight_version=state.version, metrics=metrics),
            idempotency_key=f"step.{cfg.trainer_id}.{state.run_id}.{state.step}")

    # --- accessors -------------------------------------------------------------------------
    def _st(self) -> TrainerState:
        if self.state is None:
            raise RuntimeError("Trainer.start() first")
        return self.state

    def _cl(self) -> RolloutClient | ShardedClient:
        if self.client is None:
            raise RuntimeError("Trainer.start() first")
        return self.client

    def _ln(self) -> Learner | HFLearnerType:
        if self.learner is None:
            raise RuntimeError("Trainer.start() first")
        return self.learner


def stop_ids(path: str, eos: int | None) -> tuple[int, ...]:
    """The ids that end a response of the model in ``path``: EOS and the generation config's."""
    from rollout_bus.lm import hf_tokenizer

    return tuple(sorted(hf_tokenizer.stop_ids(Path(path), eos)))


def _tokenizer_of(path: str) -> Any:
    """The tokenizer of a Hugging Face model directory; a clear error when it has none."""
    from rollout_bus.lm import hf

    try:
        return hf.load_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model directory {path} has no usable tokenizer ({type(exc).__name__}: {exc}); "
                          "a model directory needs its tokenizer files (tokenizer.json, tokenizer_config.json) "
                          "beside config.json") from None


def _vocab_size(model: Any) -> int:
    """The number of token ids ``model`` embeds (a TinyLM, a HF model or a PeftModel)."""
    return int(model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings")
               else model.tok_emb.num_embeddings)


def _trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """The parameters that train (all of a full fine-tune, the adapter's of a LoRA one), by state-dict name."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: t for name, t in model.state_dict().items() if name in trainable}


def _no_signal_reason(metrics: dict[str, float]) -> str:
    """Why a step took no optimiser step: every advantage 0, or every token masked (``mis``)."""
    if metrics.get("is_masked_frac") == 1.0:
        return "no signal: every token's importance ratio left [1/C, C] (mis masked them all: no optimiser step, " \
               "no new version)"
    return "no signal: every advantage is 0 (no optimiser step, no new version)"
