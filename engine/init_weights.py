"""Write a weights directory with random TinyLM weights: ``python -m engine.init_weights DIR --seed S``."""

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
    parser = argparse.ArgumentParser(prog="python -m engine.init_weights", description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    for name, value in defaults.to_dict().items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    ns = parser.parse_args(argv)
    config = ModelConfig.from_dict({name: getattr(ns, name) for name in defaults.to_dict()})
    print(init_weights_dir(ns.directory, config, ns.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
