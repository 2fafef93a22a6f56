"""The prefix cache on its own (longest match, namespaces, budget, generations, collisions), then on the
engine's scheduler with both model kinds: a multi-turn session gives the tokens and log-probs an engine
without the cache gives, with the earlier turns served from the cache."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rollout_bus.engine import prefix_cache
from rollout_bus.engine.args import DEFAULT_PREFIX_CACHE_TOKENS, parse_args
from rollout_bus.engine.prefix_cache import BLOCK, PrefixCache
from rollout_bus.engine.protocol import SamplingParams, SequenceSpec
from rollout_bus.engine.runtime import Engine
from rollout_bus.engine.sequence import Progress, Seq
from rollout_bus.lm import hf
from rollout_bus.lm.model import ModelConfig
from tests.engine_proc import make_weights_dir

NS = ("0", None)


def kv(tokens: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values whose entries are the token positions, so slices can be checked."""
    t = torch.arange(tokens, dtype=torch.float32).view(1, 1, tokens, 1)
    return [(t.clone(), t.clone() + 0.5) for _ in range(layers)]


def test_the_longest_cached_prefix_is_found_up_to_the_limit_and_its_kv_sliced_to_it() -> None:
    cache = PrefixCache(1000)
    short, long = list(range(40)), [*range(40), *range(100, 130)]
    cache.insert(NS, short, kv(40), generation=0)
    cache.insert(NS, long, kv(70), generation=0)
    query = [*range(40), *range(100, 120), 7, 7]
    hit = cache.match(NS, query, len(query) - 1)
    assert hit is not None and hit.entry.tokens == long and hit.length == 60  # past the last whole block
    assert hit.layers()[1][0].flatten().tolist() == list(range(60))
    assert cache.match(NS, query, 50).length == 50  # type: ignore[union-attr]
    other = cache.match(NS, [*range(35), 9, 9, 9, *range(40)], 60)
    assert other is not None and other.length == 35
    assert cache.match(NS, [5, *range(40)], 40) is None  # the first block differs
    assert cache.match(NS, list(range(BLOCK - 1)), BLOCK - 2) is None  # under a block: not looked for
    assert cache.match(("1", None), query, 60) is None and cache.match(("0", "lora"), query, 60) is None


def test_the_budget_drops_the_least_recently_used_and_a_match_counts_as_a_use() -> None:
    cache = PrefixCache(100)
    a, b, c = ([n * 1000 + i for i in range(40)] for n in range(3))
    cache.insert(NS, a, kv(40), generation=0)
    cache.insert(NS, b, kv(40), generation=0)
    assert cache.match(NS, a, 39) is not None  # a is now the most recently used
    cache.insert(NS, c, kv(40), generation=0)
    assert (len(cache), cache.tokens, cache.stats.evictions) == (2, 80, 1)
    assert cache.match(NS, b, 39) is None and cache.match(NS, a, 39) is not None
    assert not cache.insert(NS, list(range(101)), kv(101), generation=0)  # longer than the budget
    assert cache.nbytes == 2 * sum(k.numel() * 4 + v.numel() * 4 for k, v in kv(40))


def test_a_longer_turn_replaces_the_entry_it_started_from() -> None:
    cache = PrefixCache(1000)
    turn1 = list(range(40))
    cache.insert(NS, turn1, kv(40), generation=0)
    turn2 = [*turn1, *range(200, 230)]
    hit = cache.match(NS, turn2, len(turn2) - 1)
    assert hit is not None and hit.length == 40
    cache.insert(NS, turn2, kv(70), generation=0, replaces=hit.entry)
    assert (len(cache), cache.tokens) == (1, 70)
    branch = [*range(20), *range(500, 540)]  # shares only part of turn2: both are kept
    cache.insert(NS, branch, kv(60), generation=0, replaces=cache.match(NS, branch, 59).entry)  # type: ignore[union-attr]
    assert len(cache) == 2


def test_a_flush_drops_everything_and_refuses_what_was_prefilled_before_it() -> None:
    cache = PrefixCache(1000)
    cache.insert(NS, list(range(40)), kv(40), generation=0)
    generation = cache.generation
    assert cache.flush() == 1 and (len(cache), cache.tokens, cache.nbytes) == (0, 0, 0)
    assert cache.match(NS, list(range(40)), 39) is None
    assert not cache.insert(NS, list(range(50)), kv(50), generation=generation)  # prefilled before the flush
    assert cache.insert(NS, list(range(50)), kv(50), generation=cache.generation)


def test_a_hash_collision_is_no_match_rather_than_another_sequences_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache, "_chain", lambda previous, block: 42)  # every block collides
    cache = PrefixCache(1000)
    cache.insert(NS, list(range(40)), kv(40), generation=0)
    assert cache.match(NS, list(range(100, 140)), 39) is None
    assert cache.match(NS, list(range(40)), 39).length == 39  # type: ignore[union-attr]


def test_the_cache_is_on_by_default_and_its_flags_are_checked() -> None:
    assert parse_args(["--model-path", "m"]).prefix_cache_tokens == DEFAULT_PREFIX_CACHE_TOKENS
    assert parse_args(["--model-path", "m", "--radix-cache-tokens", "64"]).prefix_cache_tokens == 64
    assert parse_args(["--model-path", "m", "--disable-radix-cache"]).prefix_cache_tokens == 0
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--radix-cache-tokens", "0"])


# --- on the scheduler ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"hf": hf.write_random_llama(root / "hf", seed=0),
            "tiny_lm": make_weights_dir(root / "tiny", seed=0, config=ModelConfig(max_seq_len=256))}


@pytest.fixture(params=["hf", "tiny_lm"])
def engines(request: pytest.FixtureRequest, dirs: dict[str, Path]) -> Iterator[tuple[Engine, Engine]]:
    path = str(dirs[request.param])
    cached, plain = Engine(parse_args(["--model-path", path])), Engine(parse_args(["--model-path", path,
                                                                                  "--disable-radix-cache"]))
    assert plain.scheduler.prefix_cache is None and cached.model.kind == request.param
    cached.start()
    plain.start()
    yield cached, plain
    cached.stop()
    plain.stop()


def run(engine: Engine, prompts: list[list[int]], tag: str) -> list[Progress]:
    """Greedy, 10 tokens each, all submitted at once (so prefilled together)."""
    done, finals = threading.Event(), {}
    lock = threading.Lock()

    def sink(progress: Progress) -> None:
        if progress.finish is not None:
            with lock:
                finals[progress.spec.rid] = progress
                if len(finals) == len(prompts):
                    done.set()

    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    seqs = [Seq(SequenceSpec(rid=f"{tag}-{i}", input_ids=tuple(p), params=params, lora=None, seed=0,
                             return_logprob=True, return_text_in_logprobs=False), sink) for i, p in enumerate(prompts)]
    engine.scheduler.submit(seqs).result(30)
    assert done.wait(60)
    return [finals[f"{tag}-{i}"] for i in range(len(prompts))]


def test_sessions_prefilled_after_their_cached_turns_match_an_engine_without_the_cache(
        engines: tuple[Engine, Engine]) -> None:
    cached, plain = engines
    top = 40 if cached.model.kind == "tiny_lm" else 250
    g = torch.Generator().manual_seed(0)

    def words(n: int) -> list[int]:
        return torch.randint(3, top, (n,), generator=g).tolist()

    sessions = [[1, *words(30)], [1, *words(45)], [1, *words(5)]]  # the last one stays under a block at first
    previous: list[int] = []
    for turn in range(4):
        got, want = run(cached, sessions, f"c{turn}"), run(plain, sessions, f"p{turn}")
        for g_, w in zip(got, want, strict=True):
            assert g_.output_ids == w.output_ids
            assert g_.logprobs == pytest.approx(w.logprobs, abs=1e-4)
            assert w.cached_tokens == 0
        if turn:  # all of the previous turn but its last token, once that was a block or more
            assert [p.cached_tokens for p in got] == [n if n >= BLOCK else 0 for n in previous]
        previous = [len(s) + len(p.output_ids) - 1 for s, p in zip(sessions, got, strict=True)]
        sessions = [[*s, *p.output_ids, *words(8 + 5 * i)] for i, (s, p) in enumerate(zip(sessions, got, strict=True))]
    assert cached.scheduler.prefix_cache is not None and len(cached.scheduler.prefix_cache) == 3
