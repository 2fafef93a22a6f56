"""The prefix cache: finished sequences' KV kept after they end, so that a request that starts with
tokens already computed prefills only the rest (SGLang's radix cache plays this part there).

Each entry is one finished sequence: its token ids (all but the last output token, which was never fed)
and its keys and values per layer, ``[1, heads, tokens, head_dim]`` tensors of its own. Entries live in
a namespace (the weight version and the adapter that computed them) and in a least-recently-used order
bounded by a token budget. Lookup hashes the request's tokens in blocks of ``BLOCK``, each block's hash
chained to the previous one and to the namespace, and walks the index while the chain is known; the
deepest entry found is then compared token by token (which catches a hash collision) and followed past
the last whole block. A match shorter than one block is not looked for.

A newer entry that extends an older one (a session's turn ``k`` after turn ``k - 1``) replaces it, so
a multi-turn session holds one entry. ``flush`` drops everything and starts a new generation: a sequence
prefilled in an earlier generation (before a weight update, say) is never cached when it ends.
Scheduler thread only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

logger = logging.getLogger(__name__)

BLOCK = 16
"""Tokens per hashed block: a prefix is found to the last whole block it shares, then followed token by token."""
MAX_CANDIDATES = 32
"""Entries followed past the last shared block in one lookup (many samples of one prompt share its blocks)."""

Layers = list[tuple[Tensor, Tensor]]


@dataclass(eq=False)
class Entry:
    namespace: Hashable
    tokens: list[int]
    layers: Layers = field(repr=False)
    hashes: list[int] = field(repr=False)
    nbytes: int = 0


@dataclass(frozen=True)
class Hit:
    """``length`` leading tokens of a request found in ``entry``."""

    entry: Entry
    length: int

    def layers(self) -> Layers:
        """The keys and values of those tokens (views of the entry's tensors: never written to)."""
        n = self.length
        return [(k[:, :, :n], v[:, :, :n]) for k, v in self.entry.layers]


@dataclass
class CacheStats:
    hits: int = 0
    hit_tokens: int = 0
    lookups: int = 0
    looked_up_tokens: int = 0
    inserts: int = 0
    evictions: int = 0
    flushes: int = 0


def _chain(previous: int, block: Sequence[int]) -> int:
    return hash((previous, tuple(block)))


class PrefixCache:
    def __init__(self, max_tokens: int, block: int = BLOCK) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.block = block
        self.generation = 0
        self.tokens = 0
        self.nbytes = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # id(entry) -> entry, least recently used first
        self._index: dict[int, dict[int, Entry]] = {}  # chained block hash -> entries holding that prefix

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, namespace: Hashable, tokens: Sequence[int], limit: int) -> Hit | None:
        """The longest prefix of ``tokens``, at most ``limit`` long, cached in ``namespace``; None if under a block."""
        self.stats.lookups += 1
        self.stats.looked_up_tokens += max(limit, 0)
        b = self.block
        h = hash(namespace)
        holders: dict[int, Entry] | None = None
        blocks = 0
        while (blocks + 1) * b <= limit:
            h = _chain(h, tokens[blocks * b:(blocks + 1) * b])
            found = self._index.get(h)
            if found is None:
                break
            holders, blocks = found, blocks + 1
        if holders is None:
            return None
        start = blocks * b
        best: Entry | None = None
        best_len = -1
        for entry in list(holders.values())[-MAX_CANDIDATES:]:
            end = min(limit, len(entry.tokens))
            j = start
            while j < end and entry.tokens[j] == tokens[j]:
                j += 1
            if j > best_len:
                best, best_len = entry, j
        assert best is not None
        if best.tokens[:start] != list(tokens[:start]):  # a hash collision: no match rather than wrong KV
            logger.warning("prefix cache: hash collision on a %d-token prefix; not reused", start)
            return None
        self._entries.move_to_end(id(best))
        self.stats.hits += 1
        self.stats.hit_tokens += best_len
        return Hit(best, best_len)

    def accepts(self, length: int, generation: int) -> bool:
        """Whether a sequence of ``length`` cached tokens prefilled in ``generation`` would be kept."""
        return generation == self.generation and self.block <= length <= self.max_tokens

    def insert(self, namespace: Hashable, tokens: Sequence[int], layers: Layers, *,
               generation: int, replaces: Entry | None = None) -> bool:
        """Keep ``layers`` (the KV of ``tokens``) unless a flush came since the sequence was prefilled
        (``generation``), it is shorter than a block or longer than the budget. ``replaces``: the entry
        the sequence was prefilled from, dropped when the new one holds all of it."""
        if not self.accepts(len(tokens), generation):
            return False
        if replaces is not None and id(replaces) in self._entries and replaces.namespace == namespace \
                and len(replaces.tokens) <= len(tokens) and replaces.tokens == list(tokens[:len(replaces.tokens)]):
            self._remove(replaces)
        b = self.block
        hashes: list[int] = []
        h = hash(namespace)
        for start in range(0, len(tokens) - b + 1, b):
            h = _chain(h, tokens[start:start + b])
            hashes.append(h)
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        entry = Entry(namespace, list(tokens), layers, hashes, nbytes)
        self._entries[id(entry)] = entry
        for h in hashes:
            self._index.setdefault(h, {})[id(entry)] = entry
        self.tokens += len(entry.tokens)
        self.nbytes += nbytes
        self.stats.inserts += 1
        while self.tokens > self.max_tokens:
            _, oldest = next(iter(self._entries.items()))
            self._remove(oldest)
            self.stats.evictions += 1
        return True

    def flush(self) -> int:
        """Drop every entry and start a new generation; the number dropped."""
        dropped = len(self._entries)
        self._entries.clear()
        self._index.clear()
        self.tokens = self.nbytes = 0
        self.generation += 1
        self.stats.flushes += 1
        return dropped

    def _remove(self, entry: Entry) -> None:
        del self._entries[id(entry)]
        for h in entry.hashes:
            holders = self._index.get(h)
            if holders is not None:
                holders.pop(id(entry), None)
                if not holders:
                    del self._index[h]
        self.tokens -= len(entry.tokens)
        self.nbytes -= entry.nbytes

    def snapshot(self) -> dict[str, int]:
        s = self.stats
        return {"entries": len(self._entries), "tokens": self.tokens, "max_tokens": self.max_tokens,
                "bytes": self.nbytes, "generation": self.generation, "hits": s.hits, "hit_tokens": s.hit_tokens,
                "lookups": s.lookups, "inserts": s.inserts, "evictions": s.evictions, "flushes": s.flushes}
