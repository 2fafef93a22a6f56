"""Small Hugging Face models built offline in a test: a byte-level tokenizer with a ChatML template, a random Llama.

The tokenizer has the 256 byte symbols and three specials (``<|endoftext|>`` 0,
``<|im_start|>`` 1, ``<|im_end|>`` 2, as SmolLM2), no merges: it covers any text, needs no
training and builds in about a millisecond.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def byte_tokenizer(chat_template: str | None = CHATML) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token=None, padding_side="left")
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def tiny_llama(vocab_size: int, *, seed: int = 0, tie: bool = True, layers: int = 2, hidden: int = 64) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def tiny_model_dir(path: Path, *, seed: int = 0, chat_template: str | None = CHATML, with_model: bool = True) -> Path:
    """A model directory: tokenizer (and chat template), and unless ``with_model`` is False a random Llama."""
    tokenizer = byte_tokenizer(chat_template)
    path.mkdir(parents=True, exist_ok=True)
    if with_model:
        model = tiny_llama(len(tokenizer), seed=seed)
        model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
