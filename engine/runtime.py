"""The engine's parts wired together: device, weight store with the base set, scheduler."""

from __future__ import annotations

import logging

import torch

from rollout_bus.engine.args import EngineArgs
from rollout_bus.engine.protocol import BASE_WEIGHT_SET
from rollout_bus.engine.scheduler import Scheduler, SchedulerConfig
from rollout_bus.engine.weights import WeightStore, WeightUpdate, read_weights

logger = logging.getLogger(__name__)

ENGINE_VERSION = "rollout-bus-cpu-engine/0.1.0"


class Engine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: CUDA is not available on this machine")
        torch.set_num_threads(args.torch_threads)
        self.store = WeightStore(self.device)
        state, config = read_weights(args.model_path)
        if config is None:
            raise FileNotFoundError(f"--model-path {args.model_path} has no config.json beside the weights")
        self.store.put(WeightUpdate(BASE_WEIGHT_SET, state, config, args.weight_version, args.model_path))
        self.scheduler = Scheduler(
            self.store,
            SchedulerConfig(
                max_batch_size=args.max_batch_size, token_delay_ms=args.token_delay_ms, seed=args.seed
            ),
        )

    def start(self) -> None:
        self.scheduler.start()
        logger.info(
            "engine serving %s (version %s) on %s", self.args.model_path, self.args.weight_version, self.device
        )

    def stop(self) -> None:
        self.scheduler.stop()
