"""A fixed character-level vocabulary: three special tokens, then digits, letters and a few symbols.

Ids are stable by construction (the order below is the wire format of every saved model), so the
engine, the executors and the trainer can tokenize independently and agree.
"""

from __future__ import annotations

from collections.abc import Iterable

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")
CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyz +-*=<>|,.?:()"
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)

_CHAR_TO_ID: dict[str, int] = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(CHARACTERS)}


def encode(text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Token ids of ``text``; raises ValueError naming the first character outside the vocabulary."""
    ids = [BOS_ID] if add_bos else []
    for position, char in enumerate(text):
        token = _CHAR_TO_ID.get(char)
        if token is None:
            raise ValueError(
                f"character {char!r} at position {position} is not in the vocabulary "
                f"(allowed: special tokens and {CHARACTERS!r})"
            )
        ids.append(token)
    if add_eos:
        ids.append(EOS_ID)
    return ids


def decode(ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Text of ``ids``; special tokens are skipped, or written as ``<bos>`` etc. when not skipped."""
    parts: list[str] = []
    for token in ids:
        if not 0 <= token < VOCAB_SIZE:
            raise ValueError(f"token id {token} is outside the vocabulary [0, {VOCAB_SIZE})")
        if token < len(SPECIAL_TOKENS):
            if not skip_special_tokens:
                parts.append(SPECIAL_TOKENS[token])
            continue
        parts.append(CHARACTERS[token - len(SPECIAL_TOKENS)])
    return "".join(parts)

