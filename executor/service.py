"""The executor service: warm state (event loop, HTTP pool, plug-ins) and the rq worker around it.

``start`` connects, loads the plug-ins (a bad path fails here), starts the event loop
thread and the reaper; ``work`` runs the rq worker loop in the calling (main) thread
until stopped (or, with ``burst``, until the queues are empty); ``stop`` undoes ``start``.

Each job runs in the worker's thread: ``run_job`` hands the rollout coroutine to the
loop thread and waits. The loop thread, with its aiohttp session and the registry
snapshot, lives as long as the service, so nothing is set up per job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from rollout_bus.engine.http_client import close_shared_session
from rollout_bus.events.connection import Redis, abandon, connect
from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import Registry
from rollout_bus.events.rollouts import RolloutRequest
from rollout_bus.events.schema import EvalCompleted, Producer, RolloutCompleted, RolloutStarted
from rollout_bus.events.submit import known_policies, queue_name
from rollout_bus.executor import jobs
from rollout_bus.executor.agents import AgentRunner
from rollout_bus.executor.config import ExecutorConfig
from rollout_bus.executor.cursor import CursorStore
from rollout_bus.executor.engines import EngineCaller, EngineRouter, EngineTime
from rollout_bus.executor.errors import Permanent
from rollout_bus.executor.metrics import ExecutorMetrics
from rollout_bus.executor.output import BatchSink
from rollout_bus.executor.plugins import Plugins
from rollout_bus.executor.rollout import RolloutRunner
from rollout_bus.executor.worker import ExecutorWorker, Reaper, ReliableQueue

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Parts:
    """What ``start`` builds and ``stop`` takes down."""

    client: Redis
    plugins: Plugins
    registry: Registry
    cursor: CursorStore
    sink: BatchSink
    runner: RolloutRunner


class ExecutorService:
    def __init__(self, config: ExecutorConfig) -> None:
        config.validate()
        self.config = config
        self.name = config.name
        self.keys = Keys(config.namespace)
        self.producer = Producer("executor", self.name)
        self.metrics = ExecutorMetrics()
        # set by start()
        self.publisher: Publisher | None = None
        self.worker: ExecutorWorker | None = None
        self._parts: _Parts | None = None
        self._reaper: Reaper | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self.agents: AgentRunner | None = None

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> ExecutorService:
        cfg = self.config
        plugins = Plugins(cfg.plugins)
        client = connect(cfg.redis_url)
        self.publisher = Publisher(client, self.keys, self.producer)
        registry = Registry(client, self.keys)
        cursor = CursorStore(client, self.keys)
        self._parts = _Parts(
            client=client, plugins=plugins, registry=registry, cursor=cursor,
            sink=BatchSink(client, self.keys, self.publisher, store=cfg.payload_store),
            runner=RolloutRunner(plugins, EngineCaller(EngineRouter(registry, cfg.router)), cursor, cfg.rollout))
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="executor-loop", daemon=True)
        self._loop_thread.start()
        if cfg.agent is not None:
            self._start_agents(cfg, client, plugins)
        rq_client = connect(cfg.redis_url, socket_timeout_s=None, retries=3)  # rq does not go through Guard
        queues: list[Queue] = [ReliableQueue(queue_name(self.keys, kind == "eval"), connection=rq_client,
                                             serializer=JSONSerializer) for kind in cfg.queues]
        self.worker = ExecutorWorker(queues, name=self.name, connection=rq_client,
                                     heartbeat_ttl_s=cfg.heartbeat_ttl_s,
                                     heartbeat_interval_s=cfg.heartbeat_interval_s, worker_ttl_s=cfg.worker_ttl_s,
                                     around_job=lambda job: self._bound())
        if cfg.metrics_port is not None:
            self.metrics.serve(cfg.metrics_port)
        self._reaper = Reaper(rq_client, queues, name=self.name, interval_s=cfg.reap_interval_s,
                              on_thread_start=lambda: jobs.bind(self)).start()
        log.info("executor %s started on namespace %s, queues %s", self.name, self.keys.namespace,
                 [q.name for q in queues])
        return self

    def _start_agents(self, cfg: ExecutorConfig, client: Any, plugins: Plugins) -> None:
        """The session gateway on this executor's loop; the agent replaces the generate and reward plug-ins."""
        from rollout_bus.executor.agents import AgentRunner

        assert cfg.agent is not None
        self.agents = AgentRunner(cfg.agent, client, self.keys, instance=self.name, engine_key=cfg.router.api_key)
        self._on_loop(self.agents.start())
        plugins.generate = self.agents.generate
        plugins.reward = self.agents.reward
        plugins.config.generate_path = f"agent {cfg.agent.agent}"
        plugins.config.reward_path = f"agent {cfg.agent.agent} (the episode's reward)"
        plugins.config.group_reward = False

    def work(self, *, burst: bool = False, max_jobs: int | None = None) -> bool:
        """Run the rq worker loop in this (main) thread; True if it processed any job."""
        if self.worker is None:
            raise RuntimeError("start() the service first")
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return bool(self.worker.work(burst=burst, max_jobs=max_jobs, logging_level=self.config.log_level))
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def stop(self) -> None:
        # stopping: no call waits a reconnect budget for a Redis that is gone (the loop's worker threads would
        # hold the process's exit for it)
        for client in (self._parts.client if self._parts is not None else None,
                       self.worker.connection if self.worker is not None else None):
            if client is not None:
                abandon(client)
        if self._reaper is not None:
            self._reaper.stop()
            self._reaper = None
        if self._loop is not None and self._loop_thread is not None:
            if self.agents is not None:
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(self.agents.stop(), self._loop).result(5)
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close_shared_session(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(5)
            self._loop.close()
            self._loop = None
        self.metrics.close()
        if self.worker is not None:
            self.worker.connection.close()
            self.worker = None
        if self._parts is not None:
            self._parts.sink.close()
            self._parts.client.close()
            self._parts = None
        log.info("executor %s stopped", self.name)

    @contextlib.contextmanager
    def _bound(self) -> Iterator[None]:
        token = jobs.bind(self)
        try:
            yield
        finally:
            jobs.unbind(token)

    # --- jobs --------------------------------------------------------------------------------
    def run_job(self, request_json: dict[str, Any], job: Job) -> dict[str, Any]:
        """Serve one request: generate, publish its batch, record the outcome; raise on failure."""
        started = time.perf_counter()
        parts, publisher = self._parts, self.publisher
        if parts is None or publisher is None:
            raise RuntimeError("the executor is not started")
        attempt = jobs.attempt_of(job)
        job.meta.update(attempt=attempt, executor=self.name)
        try:
            request = RolloutRequest.from_json(request_json)
            request.validate(known_policies(parts.registry, request.policy) if self.config.check_policy else None,
                             check_deadline=False, bounds=self.config.request_bounds)
            source = parts.plugins.data_source(request.data)
        except (InvalidRequest, Permanent):
            job.save_meta()
            _no_retry(job)
            raise
        cursor_key = parts.cursor.key(request.policy, source)
        job.meta["cursor_key"] = cursor_key
        job.save_meta()
        publisher.publish(self.keys.rollout_stream, RolloutStarted(
            producer=self.producer, policy=request.policy, rollout_id=request.rollout_id,
            request_id=request.request_id, executor=self.name, attempt=attempt),
            idempotency_key=f"{request.request_id}:started:{attempt}")
        self.metrics.started.inc()
        if not request.eval and parts.sink.published(request):
            log.info("request %s: batch %s is already out (an earlier attempt); finishing up",
                     request.request_id, request.batch_id)
            parts.cursor.finalize(cursor_key, request.request_id)
            return self._completed(request, request.batch_id, request.n_samples, {}, started, attempt)
        timer = EngineTime()
        prepared = time.perf_counter()
        try:
            outcome = self._on_loop(parts.runner.run(request, source=source, cursor_key=cursor_key, timer=timer))
        except Permanent:
            self.metrics.jobs.labels("failed").inc()
            _no_retry(job)
            raise
        except Exception:
            self.metrics.jobs.labels("failed" if not job.retries_left else "retried").inc()
            raise
        generated = time.perf_counter()
        batch_id = ""
        n_samples = 0
        if outcome.train_data is not None:
            parts.cursor.mark_used(cursor_key, request.request_id, outcome.used_indices)
            batch_id = parts.sink.publish(request, outcome.train_data)
            parts.cursor.finalize(cursor_key, request.request_id)
            n_samples = len(outcome.train_data)
        finished = time.perf_counter()
        wall_s = finished - started
        metrics = dict(outcome.metrics, wall_s=wall_s, engine_busy_s=timer.busy_s,
                       outside_engine_frac=max(0.0, 1.0 - timer.busy_s / wall_s) if wall_s > 0 else 0.0,
                       prepare_s=prepared - started, rollout_s=generated - prepared, publish_s=finished - generated)
        self.metrics.job_done(metrics, n_samples, outcome.train_data)
        if request.eval:
            self._eval_completed(request, outcome.problems, outcome.engine_ids, metrics)
        return self._completed(request, batch_id, n_samples, metrics, started, attempt)

    def _eval_completed(self, request: RolloutRequest, problems: list[list[int]], engine_ids: list[str],
                        metrics: dict[str, float]) -> None:
        """``EvalCompleted`` on the eval stream: the metrics with their intervals and the per-problem counts."""
        assert self.publisher is not None
        split = request.data.get("split", "eval")
        self.publisher.publish(self.keys.eval_stream, EvalCompleted(
            producer=self.producer, policy=request.policy, request_id=request.request_id,
            split=split[:32] if isinstance(split, str) else "eval",
            min_weight_version=int(metrics.get("min_weight_version", -1)),
            max_weight_version=int(metrics.get("max_weight_version", -1)), n_problems=len(problems),
            n_samples=int(sum(p[2] for p in problems)), metrics=metrics, problems=problems,
            engine_ids=engine_ids),
            idempotency_key=f"{request.request_id}:eval")

    def _completed(self, request: RolloutRequest, batch_id: str, n_samples: int, metrics: dict[str, float],
                   started: float, attempt: int) -> dict[str, Any]:
        duration_ms = (time.perf_counter() - started) * 1000.0
        assert self.publisher is not None
        self.publisher.publish(self.keys.rollout_stream, RolloutCompleted(
            producer=self.producer, policy=request.policy, rollout_id=request.rollout_id,
            request_id=request.request_id, batch_id=batch_id, n_samples=n_samples, duration_ms=duration_ms,
            metrics=metrics), idempotency_key=f"{request.request_id}:completed")
        return {"batch_id": batch_id, "n_samples": n_samples, "attempt": attempt, "executor": self.name,
                "metrics": metrics}

    def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the service's loop and wait; a timeout or signal here cancels it."""
        if self._loop is None:
            coro.close()
            raise RuntimeError("the executor is not started")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise


def _no_retry(job: Job) -> None:
    """Fail the job at once: rq retries only while ``retries_left`` is positive."""
    job.retries_left = 0
