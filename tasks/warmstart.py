"""A brief supervised warm start on the arithmetic task, with deliberately noisy labels.

A training target is right with probability ``keep``; with ``format_noise`` it has a
stray ``.`` after the number (``3+4=`` -> ``7.``, which exact match scores 0); otherwise it
is off by ``noise`` (``3+4=`` -> ``8``). The warmed-up model knows the format and the
sums, yet puts only about ``keep`` of its mass on answers that score, so its reward at
temperature 1 sits well below the ceiling.
What the RL steps then add (moving the mass onto the answers that score) is visible in
the reward curve and comes from RL alone. The warm start draws its problems from a seed
of its own, not the data source's.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout_bus.lm.model import ModelConfig, TinyLM, build_model, pad_batch, save_weights, token_logprobs
from rollout_bus.lm.tokenizer import EOS_ID, encode
from rollout_bus.tasks.arithmetic import problem

log = logging.getLogger(__name__)


@dataclass
class WarmStartConfig:
    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-3
    keep: float = 0.25
    """Share of targets that are right."""
    format_noise: float = 0.4
    """Share of targets with a stray ``.`` after the number."""
    noise: int = 1
    """The rest are off by this much."""
    digits: int = 1
    seed: int = 0
    problem_seed: int = 1_000_003
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4


def model_config(config: WarmStartConfig) -> ModelConfig:
    return ModelConfig(d_model=config.d_model, n_layers=config.n_layers, n_heads=config.n_heads,
                       d_ff=4 * config.d_model)


def warm_start(config: WarmStartConfig) -> TinyLM:
    """A TinyLM trained for ``config.steps`` supervised steps on noisy arithmetic."""
    rng = random.Random(config.seed)
    model = build_model(model_config(config), seed=config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    started = time.perf_counter()
    model.train()
    for _ in range(config.steps):
        prompts: list[list[int]] = []
        seqs: list[list[int]] = []
        for _ in range(config.batch_size):
            prompt, answer = problem(rng.randrange(10**9), digits=config.digits, seed=config.problem_seed)
            answer = _corrupt(answer, rng.random(), config)
            ids = encode(prompt, add_bos=True)
            prompts.append(ids)
            seqs.append(ids + encode(answer) + [EOS_ID])
        input_ids, attention = pad_batch(seqs, side="right")
        mask = torch.zeros(len(seqs), input_ids.shape[1] - 1)
        for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
            mask[i, len(p) - 1:len(s) - 1] = 1
        logp = token_logprobs(model, input_ids, attention)
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    log.info("warm start: %d steps in %.1fs, final loss %.3f", config.steps, time.perf_counter() - started,
             float(loss.detach()))
    return model


def _corrupt(answer: str, u: float, config: WarmStartConfig) -> str:
    if u < config.keep:
        return answer
    if u < config.keep + config.format_noise:
        return answer + "."
    return str(int(answer) + config.noise)


def warm_start_cached(root: str | Path, config: WarmStartConfig) -> Path:
    """The warm-started weights for ``config`` under ``root`` (one subdirectory per config), made once."""
    digest = hashlib.sha1(repr(config).encode()).hexdigest()[:12]
    return warm_start_to(Path(root) / f"warm-{digest}", config)


def warm_start_to(directory: str | Path, config: WarmStartConfig) -> Path:
    """Warm-start and save to ``directory`` (config.json + model.safetensors); reuse it if it exists."""
    directory = Path(directory)
    marker = directory / "warmstart.json"
    fingerprint = repr(config)
    if marker.is_file() and marker.read_text() == fingerprint and (directory / "model.safetensors").is_file():
        log.info("warm start: reusing %s", directory)
        return directory
    model = warm_start(config)
    save_weights(model, directory)
    marker.write_text(fingerprint)
    return directory
