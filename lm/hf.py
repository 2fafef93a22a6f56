"""Hugging Face causal LMs: loading, reading weights by shard, saving versions, a random test model.

Used by the engine (``engine.hf_model``) and by trainers. Imports torch and transformers; the
weights-directory format itself (names, manifest, checks) is ``lm.files`` and needs neither.

- ``is_hf_dir``: a ``config.json`` with ``model_type`` (the tiny LM's config has none).
- ``load_model`` / ``load_tokenizer``: ``AutoModelForCausalLM`` (float32 unless told otherwise)
  and ``AutoTokenizer``, offline.
- ``read_state``: every tensor of a directory, shards read in parallel threads.
- ``save_version``: ``save_pretrained`` of a model (or a ``PeftModel``: its adapter) and a
  tokenizer into a version directory, atomically, with its manifest (``lm.files``).
- ``write_random_llama``: a seeded random Llama with an offline byte-level tokenizer and a ChatML
  template: a real HF directory for tests and benchmarks, built in milliseconds.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from rollout_bus.lm.files import (
    CONFIG_FILE,
    DEFAULT_THREADS,
    WeightsError,
    combine_digest,
    layout_files,
    tensor_line,
    write_weights_dir,
)

log = logging.getLogger(__name__)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def is_hf_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a Hugging Face model directory (its ``config.json`` names a ``model_type``)."""
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "model_type" in data


def quiet() -> None:
    """No progress bars from transformers (they go to the logs of every engine and trainer)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_model(path: str | os.PathLike[str], device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> Any:
    """``AutoModelForCausalLM`` from a local directory (single file or sharded), in eval mode."""
    from transformers import AutoModelForCausalLM

    quiet()
    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model.to(device).eval()


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def read_state(path: str | os.PathLike[str], *, threads: int = DEFAULT_THREADS) -> dict[str, Tensor]:
    """Every tensor of a weights directory (shards read in parallel), or of one safetensors file."""
    path = Path(path)
    files = [path] if path.suffix == ".safetensors" else [path / name for name in layout_files(path)]
    for file in files:
        if not file.is_file():
            raise WeightsError(f"missing shard {file.name} in {file.parent}" if len(files) > 1
                               else f"missing weights file {file}")
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(files)))) as pool:
        parts = list(pool.map(lambda f: load_file(str(f)), files))
    state: dict[str, Tensor] = {}
    for part in parts:
        state.update(part)
    return state


SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fn: "F8_E4M3", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
"""torch dtype -> the safetensors name of it, as ``safetensors.torch`` writes it."""


def state_digest(state: dict[str, Tensor]) -> str:
    """``lm.files.tensors_digest`` of tensors in memory (as ``read_state`` returns them): the same tensors
    written to safetensors files, in any sharding, give the same digest."""
    return combine_digest(state_lines(state))


def state_lines(state: dict[str, Tensor]) -> dict[str, bytes]:
    """Each tensor's line of the digest (``lm.files.tensor_line``): a digest can be built bucket by bucket."""
    lines: dict[str, bytes] = {}
    for name, tensor in state.items():
        dtype = SAFETENSORS_DTYPES.get(tensor.dtype)
        if dtype is None:
            raise WeightsError(f"tensor {name} has dtype {tensor.dtype}, which safetensors does not store")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy() if flat.numel() else b""
        lines[name] = tensor_line(name, dtype, tuple(tensor.shape), data)
    return lines


def save_pretrained(directory: Path, model: Any, tokenizer: Any = None, *,
                    max_shard_size: str | int | None = None) -> None:
    """``save_pretrained`` of ``model`` (a ``PeftModel`` writes its adapter: ``adapter_config.json`` +
    ``adapter_model.safetensors``) and of ``tokenizer`` into ``directory``; sharded with an index when
    bigger than ``max_shard_size``."""
    quiet()
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(directory), **kwargs)
    readme = directory / "README.md"
    if readme.is_file() and (directory / "adapter_config.json").is_file():
        readme.unlink()  # peft's model card template: not weights
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


def save_version(directory: str | os.PathLike[str], model: Any, tokenizer: Any = None, *,
                 max_shard_size: str | int | None = None, replace: bool = False, policy: str | None = None,
                 version: int | None = None) -> str:
    """``save_pretrained`` into a version directory, atomically, with its manifest (naming ``policy`` and
    ``version`` for a publication); return its sha256."""
    return write_weights_dir(Path(directory), lambda tmp: save_pretrained(tmp, model, tokenizer,
                                                                           max_shard_size=max_shard_size),
                             replace=replace, policy=policy, version=version)


def byte_tokenizer() -> Any:
    """An offline byte-level tokenizer: 3 ChatML specials (ids 0-2, as SmolLM2) and the 256 bytes.

    No training, fully deterministic, covers any text; ``<|im_end|>`` is EOS and padding.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    core.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=SPECIAL_TOKENS[1], eos_token=SPECIAL_TOKENS[2],
                                   pad_token=SPECIAL_TOKENS[2], padding_side="left")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def random_llama(vocab_size: int, *, hidden_size: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 intermediate_size: int | None = None, max_positions: int = 512, tie: bool = False,
                 seed: int = 0) -> Any:
    """A seeded random ``LlamaForCausalLM`` (eval mode, float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
                         intermediate_size=intermediate_size or 2 * hidden_size, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                         tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = 2
    return model.eval()


def write_random_llama(directory: str | os.PathLike[str], *, seed: int = 0, max_shard_size: str | int | None = None,
                       **model_kwargs: Any) -> Path:
    """Write a random Llama with the byte tokenizer as a version directory (with a manifest); return it."""
    tokenizer = byte_tokenizer()
    model = random_llama(len(tokenizer), seed=seed, **model_kwargs)
    save_version(directory, model, tokenizer, max_shard_size=max_shard_size)
    return Path(directory)


def tied_names(model: Any) -> set[str]:
    """Parameter names that alias another parameter (``lm_head.weight`` of a tied model)."""
    seen: dict[int, str] = {}
    aliases: set[str] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen:
            aliases.add(name)
        else:
            seen[key] = name
    return aliases


def parameters_by_name(model: Any, names: Iterable[str]) -> dict[str, Tensor]:
    """The live tensors (parameters and buffers) of ``model`` under checkpoint ``names``."""
    live = model.state_dict(keep_vars=True)
    missing = sorted(set(names) - set(live))
    if missing:
        raise WeightsError(f"the served model has no tensors {missing[:4]}")
    return {name: live[name] for name in names}
