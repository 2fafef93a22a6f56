"""Settings of the Hugging Face learner (``trainer.hf_learner``): plain dataclasses, no heavy imports."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_bus.events.errors import InvalidRequest

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class LoraSettings:
    """A LoRA adapter trained on a frozen base (peft's ``LoraConfig``)."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"
    """Module names, or peft's ``all-linear`` (every linear layer but the output head)."""


@dataclass
class HFSettings:
    micro_batch_size: int = 4
    """Sequences per forward/backward; gradients accumulate over the micro-batches of an optimiser step."""
    temperature: float = 1.0
    """The sampling temperature of the rollouts: log-probs are ``log_softmax(logits / temperature)``."""
    device: str = "auto"
    """``auto``: CUDA when present, else CPU."""
    gradient_checkpointing: bool = False
    fused_optimizer: bool = True
    """``AdamW(fused=True)`` where torch offers it (about 3.5x faster steps on CPU)."""
    lora: LoraSettings | None = None

    def validate(self) -> HFSettings:
        problems: list[str] = []
        if not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1:
            problems.append(f"micro_batch_size must be a positive integer, got {self.micro_batch_size!r}")
        if not self.temperature > 0:
            problems.append(f"temperature must be > 0, got {self.temperature!r}")
        if self.device not in DEVICES:
            problems.append(f"device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.lora is not None:
            if self.lora.r < 1 or self.lora.alpha <= 0:
                problems.append(f"lora r must be >= 1 and alpha > 0, got r={self.lora.r}, alpha={self.lora.alpha}")
            if not 0.0 <= self.lora.dropout < 1.0:
                problems.append(f"lora dropout must be in [0, 1), got {self.lora.dropout}")
        if problems:
            raise InvalidRequest("invalid learner settings: " + "; ".join(problems))
        return self
