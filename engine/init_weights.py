"""Write a model directory with random weights.

``python -m rollout_bus.engine.init_weights DIR --seed S`` writes the tiny LM (``config.json`` +
``model.safetensors``); ``--llama`` writes a random Hugging Face Llama with an offline byte-level
tokenizer instead (``--shard-size 100KB`` shards it), as a version directory with its manifest.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from rollout_bus.lm.model import ModelConfig, build_model, save_weights


def init_weights_dir(directory: str | os.PathLike[str], config: ModelConfig | None = None, seed: int = 0) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for a seeded random model; return the directory."""
    directory = Path(directory)
    save_weights(build_model(config or ModelConfig(), seed=seed), directory)
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    defaults = ModelConfig()
    parser = argparse.ArgumentParser(prog="python -m rollout_bus.engine.init_weights", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    for name, value in defaults.to_dict().items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value, help="tiny LM only")
    parser.add_argument("--llama", action="store_true", help="a random Hugging Face Llama instead of the tiny LM")
    parser.add_argument("--hidden-size", type=int, default=64, help="--llama only")
    parser.add_argument("--layers", type=int, default=2, help="--llama only")
    parser.add_argument("--shard-size", default=None, help="--llama only: max_shard_size, e.g. 100KB")
    ns = parser.parse_args(argv)
    if ns.llama:
        from rollout_bus.lm.hf import write_random_llama

        print(write_random_llama(ns.directory, seed=ns.seed, hidden_size=ns.hidden_size, layers=ns.layers,
                                 max_shard_size=ns.shard_size))
        return 0
    config = ModelConfig.from_dict({name: getattr(ns, name) for name in defaults.to_dict()})
    print(init_weights_dir(ns.directory, config, ns.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
