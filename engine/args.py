"""Command-line arguments of ``python -m engine.server`` (kept free of torch, so --help is instant)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_PREFIX_CACHE_TOKENS = 16384
"""Tokens of finished sequences' KV the prefix cache keeps by default (``--radix-cache-tokens``)."""
DEFAULT_DIST_TIMEOUT_S = 60.0
"""Seconds a weight-update group waits for a rank (joining, or in a broadcast) before the call fails."""


@dataclass(frozen=True)
class EngineArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    weight_version: str = "default"
    served_model_name: str | None = None
    token_delay_ms: float = 0.0
    token_delay_per_seq_ms: float = 0.0
    max_batch_size: int = 32
    max_seqs_per_request: int = 4096
    max_queued_seqs: int = 16384
    seed: int = 0
    device: str = "cpu"
    torch_threads: int = 1
    no_packed: bool = False
    skip_tokenizer_init: bool = False
    enable_memory_saver: bool = False
    log_level: str = "info"
    api_key: str | None = None
    enable_lora: bool = False
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] | None = None
    lora_paths: tuple[str, ...] = ()
    weights_root: str | None = None
    disable_radix_cache: bool = False
    radix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS
    dist_timeout: float = DEFAULT_DIST_TIMEOUT_S

    @property
    def prefix_cache_tokens(self) -> int:
        """The prefix cache's token budget; 0 when it is off."""
        return 0 if self.disable_radix_cache else self.radix_cache_tokens

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    def to_dict(self) -> dict[str, Any]:
        """The arguments as ``/server_info`` shows them (the api key is not shown)."""
        out = asdict(self)
        out["api_key"] = None if self.api_key is None else "<set>"
        return out

    def adapters_at_start(self) -> list[tuple[str, str]]:
        """``--lora-paths name=path`` (or a bare path, named after its last part) as (name, path)."""
        out = []
        for item in self.lora_paths:
            name, sep, path = item.partition("=")
            out.append((name, path) if sep else (item.rstrip("/").rsplit("/", 1)[-1], item))
        return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine.server",
        description="CPU engine speaking SGLang's native HTTP API over a Hugging Face causal LM or the tiny LM.",
    )
    parser.add_argument("--model-path", required=True,
                        help="a Hugging Face model directory (config.json, safetensors single or sharded, "
                             "tokenizer files) or a tiny LM directory (config.json + model.safetensors)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--weight-version", default="default", help="version reported for the initial weights")
    parser.add_argument("--served-model-name", default=None, help="defaults to --model-path")
    parser.add_argument("--token-delay-ms", type=float, default=0.0, help="fixed sleep per decode step")
    parser.add_argument("--token-delay-per-seq-ms", type=float, default=0.0,
                        help="more sleep per decode step for each sequence in it (a step cost that grows with "
                             "the batch)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="most sequences decoded together")
    parser.add_argument("--max-seqs-per-request", type=int, default=4096,
                        help="most sequences one /generate may ask for (prompts times n); more is a 400")
    parser.add_argument("--max-queued-seqs", type=int, default=16384,
                        help="most sequences waiting for a batch slot; a request that would pass it is a 429")
    parser.add_argument("--seed", type=int, default=0, help="seeds sampling of requests without sampling_seed")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (tiny models: 1)")
    parser.add_argument("--no-packed", action="store_true",
                        help="run a Hugging Face model's linear layers on plain F.linear instead of oneDNN with "
                             "weights packed once (the CPU default): no packed copies in memory, the trainer's "
                             "summation order, slower decode; to compare or fall back")
    parser.add_argument("--skip-tokenizer-init", action="store_true", help="replies carry no text")
    parser.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="accepted for SGLang compatibility; memory release always works here",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health*, /ready and /metrics")
    parser.add_argument("--enable-lora", action="store_true", default=False, help="serve LoRA adapters")
    parser.add_argument("--max-loras-per-batch", type=int, default=8, help="distinct adapters decoded together")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="refuse adapters of a higher rank")
    parser.add_argument("--lora-target-modules", nargs="+", default=None, help="accepted for SGLang compatibility")
    parser.add_argument("--lora-paths", nargs="+", default=(), help="adapters to load at start: NAME=PATH ...")
    parser.add_argument("--weights-root", default=None,
                        help="load weights and adapters over HTTP only from directories inside DIR (or the "
                             "--model-path it started from); default: any directory the engine can read")
    parser.add_argument("--disable-radix-cache", action="store_true",
                        help="turn the prefix cache off: every prompt is prefilled whole (SGLang's flag)")
    parser.add_argument("--radix-cache-tokens", type=int, default=DEFAULT_PREFIX_CACHE_TOKENS,
                        help="tokens of finished sequences' KV kept for reuse by prompts that start with them "
                             "(least recently used dropped first)")
    parser.add_argument("--dist-timeout", type=float, default=DEFAULT_DIST_TIMEOUT_S,
                        help="seconds a weight-update group (/init_weights_update_group) waits for a rank, "
                             "joining or in a broadcast, before the call fails (SGLang's flag)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> EngineArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.max_batch_size < 1:
        parser.error("--max-batch-size must be >= 1")
    if ns.max_seqs_per_request < 1:
        parser.error("--max-seqs-per-request must be >= 1")
    if ns.max_queued_seqs < ns.max_seqs_per_request:
        parser.error("--max-queued-seqs must be >= --max-seqs-per-request (else a request that fits could never queue)")
    if ns.token_delay_ms < 0:
        parser.error("--token-delay-ms must be >= 0")
    if ns.token_delay_per_seq_ms < 0:
        parser.error("--token-delay-per-seq-ms must be >= 0")
    if ns.torch_threads < 1:
        parser.error("--torch-threads must be >= 1")
    if ns.radix_cache_tokens < 1:
        parser.error("--radix-cache-tokens must be >= 1 (use --disable-radix-cache to turn the cache off)")
    if not ns.dist_timeout > 0:
        parser.error("--dist-timeout must be > 0")
    if ns.max_loras_per_batch < 1:
        parser.error("--max-loras-per-batch must be >= 1")
    if ns.lora_paths:
        ns.enable_lora = True  # as SGLang: adapters given at launch turn LoRA on
    ns.lora_paths = tuple(ns.lora_paths)
    if ns.lora_target_modules is not None:
        ns.lora_target_modules = tuple(ns.lora_target_modules)
    return EngineArgs(**vars(ns))
