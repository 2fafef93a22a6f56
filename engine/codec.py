"""Text <-> token ids for the served model: the tiny LM's characters, or a Hugging Face tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from rollout_bus.lm import tokenizer as chars


class Codec(Protocol):
    vocab_size: int
    """Size of the model's output layer (token ids must be below it)."""
    eos_ids: frozenset[int]
    health_ids: tuple[int, ...]
    """The prompt of the one-token health generation."""
    path: str | None
    """Where the tokenizer was loaded from (``/model_info``'s ``tokenizer_path``)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class CharCodec:
    """The tiny LM's fixed character vocabulary (``lm.tokenizer``)."""

    def __init__(self) -> None:
        self.vocab_size = chars.VOCAB_SIZE
        self.eos_ids = frozenset({chars.EOS_ID})
        self.health_ids: tuple[int, ...] = (chars.BOS_ID,)
        self.path: str | None = None

    def encode(self, text: str) -> list[int]:
        return chars.encode(text, add_bos=True)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return chars.decode(ids, skip_special_tokens=skip_special_tokens)


class HFCodec:
    """A Hugging Face tokenizer. Text is encoded as SGLang does (the tokenizer's own special tokens);
    EOS ids come from the tokenizer and the model's generation config. Without a tokenizer
    (``--skip-tokenizer-init``) there is no text: prompts are token ids and replies carry none."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int], path: str | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_ids.add(int(tokenizer.eos_token_id))
        self.eos_ids = frozenset(eos_ids)
        self.health_ids: tuple[int, ...] = (0,)  # SGLang's health probe sends input_ids [0]
        self.path: str | None = path

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("the engine runs without a tokenizer (--skip-tokenizer-init): send input_ids")
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))
