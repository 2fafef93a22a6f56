"""The tokenizer of a Hugging Face model directory, for executors and tasks: chat prompts in, text out.

``ChatTokenizer(path)`` loads the directory's tokenizer offline (``local_files_only``) and
renders prompts through the model's own chat template, so the token ids an executor sends
to the engines (and later trains on) are exactly what the model was tuned on. It is also an
executor tokenizer plug-in (``encode``/``decode``): ``encode(text)`` is one user turn,
rendered with the generation prompt.

``load(path)`` shares one instance per directory in a process (tokenizers are read-only).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rollout_bus.events.errors import Failure

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

Message = dict[str, str]


class TokenizerError(Failure):
    """A model directory has no usable tokenizer or chat template; the message says what is missing."""


class ChatTokenizer:
    """A model directory's tokenizer with its chat template, end-of-turn ids and decoding up to a stop."""

    def __init__(self, path: str | os.PathLike[str], *, system_prompt: str | None = None) -> None:
        directory = Path(path)
        if not directory.is_dir():
            raise TokenizerError(f"model directory {directory} does not exist")
        present = [f for f in TOKENIZER_FILES if (directory / f).is_file()]
        if not present:
            raise TokenizerError(f"model directory {directory} has no tokenizer (none of "
                                 f"{', '.join(TOKENIZER_FILES)}); save one with tokenizer.save_pretrained(dir)")
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as exc:
            raise TokenizerError(f"cannot load the tokenizer of {directory}: {type(exc).__name__}: "
                                 f"{str(exc)[:300]}") from None
        if not getattr(self.hf, "chat_template", None):
            raise TokenizerError(f"the tokenizer of {directory} has no chat template (chat_template.jinja or "
                                 "chat_template in tokenizer_config.json); an instruct model is needed")
        self.path = directory
        self.system_prompt = system_prompt
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.pad_token_id: int | None = self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_token_id
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(stop_ids(directory, self.eos_token_id)))
        """Ids that end a response: the tokenizer's EOS and the generation config's ``eos_token_id``(s)."""

    def __len__(self) -> int:
        return len(self.hf)

    # --- prompts -------------------------------------------------------------------------------
    def messages(self, user: str, system: str | None = None) -> list[Message]:
        system = system if system is not None else self.system_prompt
        return ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": user}]

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """The chat text of ``messages`` as the model's template writes it."""
        text = self.hf.apply_chat_template(list(messages), tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        return str(text)

    def encode_messages(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat (special tokens as the template writes them, none added)."""
        ids = self.hf(self.render(messages, add_generation_prompt=add_generation_prompt),
                      add_special_tokens=False)["input_ids"]
        return [int(t) for t in ids]

    def encode(self, text: str) -> list[int]:
        """The executor plug-in's ``encode``: ``text`` as one user turn, ready for the assistant's reply."""
        return self.encode_messages(self.messages(text))

    def encode_plain(self, text: str) -> list[int]:
        return [int(t) for t in self.hf(text, add_special_tokens=False)["input_ids"]]

    # --- responses -----------------------------------------------------------------------------
    def until_stop(self, ids: Iterable[int]) -> list[int]:
        """``ids`` up to (not including) the first stop token."""
        out: list[int] = []
        stops = set(self.stop_token_ids)
        for token in ids:
            if token in stops:
                break
            out.append(int(token))
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of a response up to its first stop token."""
        return str(self.hf.decode(self.until_stop(ids), skip_special_tokens=skip_special_tokens))

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "vocab": len(self), "eos_token_id": self.eos_token_id,
                "pad_token_id": self.pad_token_id, "stop_token_ids": list(self.stop_token_ids)}


def stop_ids(directory: Path, eos: int | None) -> set[int]:
    ids = {eos} if eos is not None else set()
    config = directory / "generation_config.json"
    if config.is_file():
        import json

        try:
            value = json.loads(config.read_text()).get("eos_token_id")
        except ValueError:
            value = None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return {i for i in ids if i is not None}


@functools.lru_cache(maxsize=8)
def load(path: str, system_prompt: str | None = None) -> ChatTokenizer:
    """One shared ``ChatTokenizer`` per directory (and system prompt) in this process."""
    return ChatTokenizer(path, system_prompt=system_prompt)
