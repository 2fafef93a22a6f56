"""Small real models for tests, built in the test: a random HF Llama (single file or sharded) and
PEFT LoRA adapters for it and for the tiny LM, each with nonzero weights (peft starts lora_B at 0)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from rollout_bus.lm import hf
from rollout_bus.lm.model import ModelConfig, build_model

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY_TARGETS = ("qkv", "proj")


def llama_dir(directory: Path, *, seed: int = 0, shards: bool = False, **kwargs: Any) -> Path:
    """A random Llama with the byte tokenizer as a version directory (4+ shards when ``shards``)."""
    return hf.write_random_llama(directory, seed=seed, max_shard_size="60KB" if shards else None, **kwargs)


def lora(base: torch.nn.Module, targets: tuple[str, ...], *, seed: int, scale: float, rank: int = 4) -> Any:
    """A ``PeftModel`` over ``base`` with random (nonzero) LoRA weights."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(targets), bias="none")
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return model.eval()


def llama_adapter(base_dir: Path, directory: Path, *, seed: int, scale: float = 0.5, rank: int = 4) -> Path:
    model = lora(hf.load_model(base_dir), LLAMA_TARGETS, seed=seed, scale=scale, rank=rank)
    hf.save_version(directory, model)
    return directory


def tiny_adapter(directory: Path, *, seed: int, base_seed: int = 0, scale: float = 0.5,
                 config: ModelConfig | None = None, policy: str | None = None, version: int | None = None) -> Path:
    """A LoRA adapter over the tiny LM; published as ``policy`` v``version`` when they are given."""
    model = lora(build_model(config or ModelConfig(), seed=base_seed), TINY_TARGETS, seed=seed, scale=scale)
    hf.save_version(directory, model, policy=policy, version=version)
    return directory


def copy_dir(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target
