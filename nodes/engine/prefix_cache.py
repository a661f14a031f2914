"""Prompt prefixes kept across requests: a new prompt starts from an earlier sequence's K/V.

Why: a chat client sends the whole conversation again each turn, an agent its system prompt and
tool schema with every call, a chat template its fixed header with every message; each request
prefilled all of it from scratch. On SmolLM2 here a prompt position costs about 4 ms of one CPU
core, so the tenth turn of a 2,000-token conversation waited 8 s for its first token, of which
all but the last message had been computed before. vLLM (automatic prefix caching), SGLang
(RadixAttention) and llama-server (`cache_prompt`) keep such prefixes; so does this, per
verifier engine.

What is kept: when a sequence ends (finished or cancelled between steps), its cache and the
tokens it holds (prompt + output, up to the cache's length), one entry per sequence. An entry
that is a prefix of a newer one is dropped (a conversation's turns keep one entry, the
latest), and a new one that is a prefix of a kept one is not stored. Memory is bounded by
`budget` bytes: least recently used entries go first, whole.

A lookup takes the longest common prefix of the prompt with any entry, or with a running
sequence's cache the engine hands in (its batch-mates: prompts arriving together; the scan is
`nodes/prefixes.py`, entries are bounded by the budget to a few hundred, microseconds each), at most
all but the prompt's last position (its logits give the first token), and at least
`min_reuse` positions (fewer save nothing worth a different cache); under bounded K/V only
prefixes whose window the cache still holds (`Backend.prefix_floor`: a chat's next turn takes
the whole of the last one; a shorter common prefix is prefilled). The engine copies those
positions into the new sequence's cache (`Backend.copy_prefix`) and prefills the rest.

Lossless as batched prompt rows are (docs/engine.md, "Prefix reuse"): the reused K/V were
computed in a forward of other rows, so they can differ from a fresh prefill's in the last bits;
greedy output changes only where the top two logits tie within that. So the engine never reuses
in `batch_invariant` mode (bit for bit solo output), nor for a sequence whose sources read hidden
states (they need every prompt row's states).

One owner: the engine's (verifier compute) thread; not thread-safe. Its counters are written
there alone.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nodes.prefixes import as_ids, common_prefix

log = logging.getLogger(__name__)

#: fewer reused positions than this are not worth a prompt computed differently from alone
MIN_REUSE = 8


@dataclass
class _Entry:
    tokens: np.ndarray  # int32, the positions the cache holds
    cache: Any
    nbytes: int


@dataclass
class PrefixStats:
    """What the owner thread counts (its only writer)."""

    lookups: int = 0
    hits: int = 0
    reused: int = 0  # prompt positions taken from entries instead of prefilled
    live: int = 0  # hits on a running sequence's cache rather than a kept one
    stored: int = 0
    evicted: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"lookups": self.lookups, "hits": self.hits, "reused": self.reused,
                "live": self.live, "stored": self.stored, "evicted": self.evicted}


class PrefixCache:
    """Ended sequences' caches, looked up by longest common prefix beside the running ones a
    caller hands in (module docstring)."""

    def __init__(self, backend: Any, budget: int, *, min_reuse: int = MIN_REUSE) -> None:
        if budget < 1:
            raise ValueError(f"prefix cache budget must be >= 1 byte, got {budget}")
        if not getattr(backend, "supports_prefix_copy", False):
            raise ValueError(f"backend {getattr(backend, 'name', '?')!r} cannot copy cache "
                             "prefixes")
        self.backend = backend
        self.budget = int(budget)
        self.min_reuse = max(1, int(min_reuse))
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next = 0
        self.nbytes = 0
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int], live: Sequence[tuple[Sequence[int], Any]] = (),
               better_than: int = 0) -> tuple[Any, int] | None:
        """The cache sharing the longest prefix with `prompt`, kept or among `live` (running
        sequences' `(tokens, cache)`, not kept), and how many of its positions to reuse (at
        most all but the prompt's last); None below `min_reuse` or `better_than`."""
        self.stats.lookups += 1
        want = as_ids(prompt)
        entries = [(("kept", k), e.tokens, e.cache) for k, e in self._entries.items()]
        entries += [(("live", i), as_ids(tokens), c) for i, (tokens, c) in enumerate(live)]
        best_key, best = None, 0
        floor = getattr(self.backend, "prefix_floor", lambda _cache: 0)
        for key, ids, cache in entries:
            n = common_prefix(ids, want, len(want) - 1)
            # (bounded K/V: only prefixes whose window the cache still holds)
            if n > best and n >= floor(cache):
                best_key, best = key, n
        if best_key is None or best < max(self.min_reuse, better_than + 1):
            return None
        kind, key = best_key
        self.stats.hits += 1
        self.stats.reused += best - better_than  # (`better_than`: what it replaces)
        if kind == "live":
            self.stats.live += 1
            return live[key][1], best
        self._entries.move_to_end(key)
        return self._entries[key].cache, best

    def store(self, tokens: Sequence[int], cache: Any) -> None:
        """Keep `cache`, which holds `tokens` (the caller hands it over: it must not feed it
        again). Cropped to `tokens` and to storage it needs; not kept when shorter than
        `min_reuse`, larger than the budget, or a prefix of an entry already kept."""
        length = min(len(tokens), self.backend.cache_length(cache))
        if length < self.min_reuse:
            return
        new = as_ids(tokens[:length])
        for key, entry in list(self._entries.items()):
            n = min(length, len(entry.tokens))
            if common_prefix(entry.tokens, new) < n:
                continue
            if len(entry.tokens) >= length:
                self._entries.move_to_end(key)  # it already covers the new one
                return
            self._drop(key)  # the new one extends it
        nbytes = self.backend.settle_cache(cache, length)
        if nbytes > self.budget:
            return
        self._entries[self._next] = _Entry(new, cache, nbytes)
        self._next += 1
        self.nbytes += nbytes
        self.stats.stored += 1
        while self.nbytes > self.budget:
            self._drop(next(iter(self._entries)))
            self.stats.evicted += 1

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
