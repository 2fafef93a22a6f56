from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_bus.lm.tokenizer import BOS_ID, CHARACTERS, EOS_ID, PAD_ID, VOCAB_SIZE, decode, encode


def test_vocabulary_layout_is_fixed() -> None:
    assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert len(" +-*=<>|,.?:()") + 3 + 10 + 26 == VOCAB_SIZE
    assert encode("0") == [3]
    assert encode("a") == [13]
    assert encode(" ") == [39]
    assert encode(")") == [VOCAB_SIZE - 1]


@given(st.text(alphabet=CHARACTERS, max_size=80))
def test_decode_inverts_encode(text: str) -> None:
    assert decode(encode(text)) == text


def test_special_tokens_are_skipped_or_named() -> None:
    ids = encode("12+3=15", add_bos=True, add_eos=True)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    assert decode([PAD_ID, *ids]) == "12+3=15"
    assert decode(ids, skip_special_tokens=False) == "<bos>12+3=15<eos>"


def test_unknown_character_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match="'A' at position 2"):
        encode("abA")


def test_out_of_range_id_is_rejected() -> None:
    with pytest.raises(ValueError, match="token id 53"):
        decode([VOCAB_SIZE])
