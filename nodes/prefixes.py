"""Token id sequences that begin the same way: the one comparison behind both the verifier's
prefix cache (nodes/engine/prefix_cache.py: which kept K/V a prompt starts from) and the
cluster client's prefix affinity (nodes/cluster_client/affinity.py: which verifier holds it).

A linear scan with numpy: both keep at most a few hundred sequences, and comparing one is a
vectorised pass over at most a few thousand ids (microseconds), cheaper to keep right than a
radix tree that must also evict.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import numpy as np

K = TypeVar("K")


def as_ids(tokens) -> np.ndarray:
    """Token ids as the int32 array the comparisons take (vocabularies fit; half the memory
    of int64 for what the cluster client remembers)."""
    return np.asarray(tokens, dtype=np.int32)


def common_prefix(a: np.ndarray, b: np.ndarray, limit: int | None = None) -> int:
    """How many leading ids `a` and `b` share (at most `limit`)."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def longest(entries: Iterable[tuple[K, np.ndarray]], want: np.ndarray,
            limit: int) -> tuple[K | None, int]:
    """The key of the entry sharing the longest prefix with `want` (at most `limit` ids) and
    that length; (None, 0) when none shares any."""
    best_key, best = None, 0
    for key, ids in entries:
        if min(limit, len(ids)) <= best:
            continue
        n = common_prefix(ids, want, limit)
        if n > best:
            best_key, best = key, n
    return best_key, best
