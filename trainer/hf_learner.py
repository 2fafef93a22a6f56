"""The learner for Hugging Face causal LMs: GRPO with truncated importance sampling and a PPO clip.

The same loss as the tiny-LM learner (``trainer.grpo.grpo_loss``) on any
``AutoModelForCausalLM``, full weights or a LoRA adapter (peft; only the adapter trains):

- log-probs are recomputed for the response tokens only, as the engine reports them:
  ``log_softmax(logits / T)`` at the sampled token, with ``T`` the rollouts' temperature;
- a batch is laid out as the tiny learner lays it out (``trainer.learner.to_padded``:
  right-padded, column ``t`` is the log-prob of token ``t + 1``), and each forward asks the
  model only for the logits from the shortest prompt's last token on (``logits_to_keep``),
  so the full-vocabulary logits of the prompts are never made;
- an optimiser step's samples go through in micro-batches of ``micro_batch_size`` rows,
  each trimmed to its own longest row, and their gradients accumulate: each micro-batch's
  token-mean loss is weighted by its share of the step's response tokens, so the summed
  gradient is the full batch's;
- the policy's entropy (of ``softmax(logits / T)``) at each response token is reported as a
  metric, and enters the loss (with its gradient) only when ``entropy_coef`` is set.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rollout_bus.events.train_data import TrainData
from rollout_bus.trainer.config import LossSettings, OptimConfig
from rollout_bus.trainer.finite import StepGuard
from rollout_bus.trainer.grpo import NO_SIGNAL_METRICS, LossConfig, grpo_loss, has_signal
from rollout_bus.trainer.hf_config import HFSettings, LoraSettings
from rollout_bus.trainer.learner import Padded, to_padded

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def load_causal_lm(path: str, *, dtype: torch.dtype = torch.float32) -> Any:
    """An ``AutoModelForCausalLM`` from a local model directory (never the network)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)


def with_lora(model: Any, settings: LoraSettings) -> Any:
    """``model`` wrapped by a fresh LoRA adapter; only the adapter's weights require gradients."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=settings.target_modules, task_type="CAUSAL_LM", bias="none")
    with warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


@dataclass
class Layout:
    """A batch in the padded layout, with where each row's response starts."""

    padded: Padded
    starts: Tensor
    """Per row: the log-prob column of its first response token (prompt length - 1)."""


@dataclass
class _Chunk:
    rows: Tensor
    """Row indices into the padded batch."""
    offset: int
    """Position of the chunk's first row among the rows being processed."""
    width: int
    """Columns of ``input_ids`` the chunk needs (its longest row)."""
    start: int
    """First log-prob column with a response token (the shortest prompt's length - 1)."""


def layout(data: TrainData) -> Layout:
    return Layout(to_padded(data), (data.prompt_lengths - 1).clamp(min=0))


class HFLearner:
    """A Hugging Face causal LM, its optimiser and the GRPO step."""

    def __init__(self, model: Any, optim: OptimConfig, loss: LossSettings, settings: HFSettings | None = None) -> None:
        self.settings = (settings or HFSettings()).validate()
        self.device = resolve_device(self.settings.device)
        if self.settings.lora is not None:
            model = with_lora(model, self.settings.lora)
        model.to(self.device)
        if self.settings.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        self.model = model
        self.optim_config = optim
        self.loss_config = LossConfig.of(loss)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("the model has no parameter that requires a gradient")
        self.optimizer = self._optimizer()
        self._keeps_logits = "logits_to_keep" in inspect.signature(_forward_of(model)).parameters
        log.info("HF learner: %s on %s, %s trainable parameters of %s%s", type(_base_of(model)).__name__,
                 self.device, f"{sum(p.numel() for p in self.trainable):,}",
                 f"{sum(p.numel() for p in model.parameters()):,}", " (LoRA)" if self.is_lora else "")

    @property
    def is_lora(self) -> bool:
        return self.settings.lora is not None

    def _optimizer(self) -> torch.optim.Optimizer:
        o = self.optim_config
        kwargs: dict[str, Any] = dict(lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
        if self.settings.fused_optimizer:
            try:
                return torch.optim.AdamW(self.trainable, fused=True, **kwargs)
            except (RuntimeError, TypeError, ValueError) as exc:
                log.info("fused AdamW is not available here (%s); using the default one", exc)
        return torch.optim.AdamW(self.trainable, **kwargs)

    # --- log-probs ---------------------------------------------------------------------------
    def _chunks(self, lay: Layout, rows: Tensor) -> Iterator[_Chunk]:
        lengths = lay.padded.attention_mask.sum(dim=1)
        size = self.settings.micro_batch_size
        for i in range(0, len(rows), size):
            part = rows[i:i + size]
            width = max(int(lengths[part].max()), 2)
            yield _Chunk(part, i, width, min(int(lay.starts[part].min()), width - 2))

    def _logprobs(self, lay: Layout, chunk: _Chunk, temperature: float) -> Tensor:
        """``(rows, width - 1)`` log-probs in the padded layout; columns before ``chunk.start`` are 0."""
        return self._logprobs_and_entropy(lay, chunk, temperature, entropy=False)[0]

    def _logprobs_and_entropy(self, lay: Layout, chunk: _Chunk, temperature: float, *,
                              entropy: bool) -> tuple[Tensor, Tensor | None]:
        """``_logprobs`` and, with ``entropy``, the entropy of the sampling distribution
        (``softmax(logits / T)``) at each position, in the same layout. The entropy keeps its
        gradient only when the loss has an entropy bonus; otherwise it is a metric."""
        batch = lay.padded
        ids = batch.input_ids[chunk.rows, :chunk.width].to(self.device)
        attn = batch.attention_mask[chunk.rows, :chunk.width].to(self.device)
        keep = chunk.width - chunk.start
        if self._keeps_logits:
            logits = self.model(input_ids=ids, attention_mask=attn, logits_to_keep=keep, use_cache=False).logits
        else:
            logits = self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, -keep:]
        logits = logits[:, :-1].float() / temperature
        targets = ids[:, chunk.start + 1:]
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        if not entropy:
            return F.pad(picked, (chunk.start, 0)), None
        bonus = bool(self.loss_config.entropy_coef)
        with torch.set_grad_enabled(torch.is_grad_enabled() and bonus):
            z = logits if bonus else logits.detach()
            h = (lse if bonus else lse.detach()) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
        return F.pad(picked, (chunk.start, 0)), F.pad(h, (chunk.start, 0))

    @torch.no_grad()
    def logprobs(self, data: TrainData, temperature: float | None = None) -> list[Tensor]:
        """Each sample's response-token log-probs under the current weights (eval mode, no gradient)."""
        lay = layout(data)
        temperature = self._temperature(temperature)
        was_training = self.model.training
        self.model.eval()
        try:
            full = self._padded_logprobs(lay, torch.arange(len(data)), temperature)
        finally:
            self.model.train(was_training)
        prompt_lengths = data.prompt_lengths.tolist()
        response_lengths = data.response_lengths.tolist()
        return [full[i, p - 1:p - 1 + r].cpu() for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths,
                                                                                strict=True))]

    def _padded_logprobs(self, lay: Layout, rows: Tensor, temperature: float) -> Tensor:
        """Log-probs of ``rows`` (in that order) in the padded layout, micro-batch by micro-batch."""
        out = torch.zeros(lay.padded.loss_mask[rows].shape, dtype=torch.float32)
        for chunk in self._chunks(lay, rows):
            part = self._logprobs(lay, chunk, temperature).cpu()
            out[chunk.offset:chunk.offset + len(chunk.rows), :part.shape[1]] = part
        return out

    def _temperature(self, temperature: float | None) -> float:
        value = self.settings.temperature if temperature is None else temperature
        if not value > 0:
            raise ValueError(f"temperature must be > 0 to recompute sampling log-probs, got {value!r}")
        return float(value)

    # --- training ----------------------------------------------------------------------------
    def accumulate(self, lay: Layout, rows: Tensor, temperature: float,
                   old_logp: Tensor | None = None) -> dict[str, float]:
        """Forward and backward over ``rows`` in micro-batches; gradients add up to the rows' token-mean loss.

        ``old_logp``: the rows' log-probs at the start of the step (in the order of ``rows``);
        None: the current ones (one optimiser step per batch).
        """
        batch = lay.padded
        total = float(batch.loss_mask[rows].sum())
        sums: dict[str, float] = {"micro_batches": 0.0, "backward_passes": 0.0}
        for chunk in self._chunks(lay, rows):
            cols = chunk.width - 1
            mask = batch.loss_mask[chunk.rows, :cols].to(self.device)
            tokens = float(mask.sum())
            if tokens == 0:
                continue
            logp, entropy = self._logprobs_and_entropy(lay, chunk, temperature, entropy=True)
            old = (logp.detach() if old_logp is None
                   else old_logp[chunk.offset:chunk.offset + len(chunk.rows), :cols].to(self.device))
            out = grpo_loss(logp, old, batch.rollout_logp[chunk.rows, :cols].to(self.device),
                            batch.advantages[chunk.rows].to(self.device), mask, self.loss_config, entropy=entropy)
            share = tokens / total
            if out.has_gradient:  # a micro-batch whose every token mis masked adds nothing to the gradient
                (out.loss * share).backward()
                sums["backward_passes"] += 1
            for key, value in out.metrics.items():
                sums[key] = sums.get(key, 0.0) + value * share
            sums["micro_batches"] += 1
        return sums

    def train_step(self, data: TrainData, temperature: float | None = None) -> dict[str, float]:
        """One GRPO update on ``data`` (``epochs`` x ``minibatches`` optimiser steps); a step with a
        non-finite loss, gradient or result is refused (``trainer.finite.NonFiniteStep``) and leaves the
        trainable weights and the optimiser as they were. A batch without signal (every advantage 0 on
        its trained tokens: ``grpo.has_signal``) takes no forward pass and no optimiser step (Adam's
        momentum would move the weights anyway): ``skipped_no_signal`` is 1 in the metrics. An optimiser step
        whose every micro-batch had every token masked (``mis``) has no gradient and is not taken; when no step
        of the batch is, the batch is reported as one without signal.

        ``old_logp`` is the batch's log-probs under the weights before the first optimiser step, recomputed
        once under no_grad in eval mode, micro-batch by micro-batch, and used by every optimiser step of every
        epoch. With ``decoupled`` that is AReaL's proximal policy, the previous weight version: the trainer
        publishes one version per ``train_step`` (``TrainerService._train``), so the weights before this step
        are the version last given to the engines, full weights or a LoRA adapter alike. With one optimiser step
        and ``tis`` or ``mis`` the training forward's detached log-probs stand in for it."""
        started = time.perf_counter()
        temperature = self._temperature(temperature)
        lay = layout(data)
        batch = lay.padded
        if not has_signal(batch.advantages, batch.loss_mask, self.loss_config):
            return {**NO_SIGNAL_METRICS, "response_tokens": float(batch.loss_mask.sum()), "micro_batches": 0.0,
                    "train_ms": (time.perf_counter() - started) * 1000, "train_tokens_per_s": 0.0}
        guard = StepGuard(self.trainable, self.optimizer)
        n = batch.input_ids.shape[0]
        o = self.optim_config
        old_logp: Tensor | None = None
        if o.epochs > 1 or o.minibatches > 1 or self.loss_config.recomputes_proximal:
            self.model.eval()  # before any optimiser step: the previous version (see the docstring)
            with torch.no_grad():
                old_logp = self._padded_logprobs(lay, torch.arange(n), temperature)
        self.model.train()
        sums: dict[str, float] = {}
        updates = passes = 0
        grad_norm = 0.0
        size = math.ceil(n / o.minibatches)
        for _ in range(o.epochs):
            order = torch.randperm(n) if o.minibatches > 1 else torch.arange(n)
            for begin in range(0, n, size):
                rows = order[begin:begin + size]
                self.optimizer.zero_grad(set_to_none=True)
                metrics = self.accumulate(lay, rows, temperature, None if old_logp is None else old_logp[rows])
                passes += 1
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
                if not metrics.pop("backward_passes"):  # nothing reached the gradient: no optimiser step
                    continue
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, o.grad_clip))
                guard.check_update(metrics.get("loss", 0.0), grad_norm)
                self.optimizer.step()
                updates += 1
        guard.check_weights()
        elapsed = time.perf_counter() - started
        tokens = float(batch.attention_mask.sum())
        micro_batches = sums.pop("micro_batches", 0.0)
        sums.pop("backward_passes", None)
        out = {k: v / max(passes, 1) for k, v in sums.items()}
        out.update(grad_norm=grad_norm, optimizer_steps=float(updates), skipped_no_signal=float(updates == 0),
                   response_tokens=float(batch.loss_mask.sum()),
                   micro_batches=micro_batches, train_ms=elapsed * 1000,
                   train_tokens_per_s=tokens * o.epochs / elapsed if elapsed > 0 else 0.0)
        return out


def _forward_of(model: Any) -> Any:
    base = _base_of(model)
    return base.forward


def _base_of(model: Any) -> Any:
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model
