"""The engine's parts wired together: device, the served model (Hugging Face or tiny LM), scheduler."""

from __future__ import annotations

import logging

import torch

from rollout_bus.engine.args import EngineArgs
from rollout_bus.engine.scheduler import Scheduler, SchedulerConfig
from rollout_bus.engine.served import LoraLimits, ServedModel

logger = logging.getLogger(__name__)

ENGINE_VERSION = "rollout-bus-cpu-engine/0.2.0"


def load_served(args: EngineArgs, device: torch.device) -> ServedModel:
    """A Hugging Face model when ``--model-path`` holds one (``config.json`` with ``model_type``), else the tiny LM."""
    from rollout_bus.lm.hf import is_hf_dir

    lora = LoraLimits(enabled=args.enable_lora, max_rank=args.max_lora_rank,
                      target_modules=frozenset(args.lora_target_modules) if args.lora_target_modules else None,
                      max_per_batch=args.max_loras_per_batch)
    if is_hf_dir(args.model_path):
        from rollout_bus.engine.hf_model import HFServed

        return HFServed(args.model_path, device, args.weight_version, lora, tokenizer=not args.skip_tokenizer_init,
                        packed=not args.no_packed)
    from rollout_bus.engine.tiny_model import TinyServed

    return TinyServed(args.model_path, device, args.weight_version, lora)


class Engine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: CUDA is not available on this machine")
        torch.set_num_threads(args.torch_threads)
        self.model = load_served(args, self.device)
        for name, path in args.adapters_at_start():
            self.model.check_adapter(name, path)
            self.model.attach_adapter(name, path)
        self.scheduler = Scheduler(
            self.model,
            SchedulerConfig(max_batch_size=args.max_batch_size, token_delay_ms=args.token_delay_ms,
                            token_delay_per_seq_ms=args.token_delay_per_seq_ms, seed=args.seed,
                            max_queued_seqs=args.max_queued_seqs, prefix_cache_tokens=args.prefix_cache_tokens),
        )

    def start(self) -> None:
        self.scheduler.start()
        logger.info("engine serving %s (%s, version %s) on %s", self.args.model_path, self.model.kind,
                    self.args.weight_version, self.device)

    def stop(self) -> None:
        self.scheduler.stop()
