"""The backend interface the engine and model drafters drive.

A backend owns one causal LM and its tokenizer. The engine never touches framework objects: it
asks for a cache, feeds token ids, gets float32 logits rows back as numpy, and crops the cache to
the committed length after each block. Caches are opaque per-sequence objects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from nodes.backends.tokenizer import Tokenizer
from nodes.engine.errors import BadRequestError

BACKENDS = ("torch", "mlx")


class Backend(ABC):
    """One loaded causal LM. Not thread-safe: one forward at a time."""

    name: str = "?"
    model_name: str
    tokenizer: Tokenizer
    vocab_size: int  # rows of logits (may exceed len(tokenizer) when the embedding is padded)

    @property
    def fingerprint(self) -> str:
        """Tokenizer fingerprint; drafters must match it."""
        return self.tokenizer.fingerprint

    @abstractmethod
    def new_cache(self) -> Any:
        """An empty KV cache for one sequence."""

    @abstractmethod
    def forward(self, cache: Any, token_ids: Sequence[int]) -> np.ndarray:
        """Append `token_ids` to the cache; return logits float32 [len(token_ids), vocab]."""

    def forward_last(self, cache: Any, token_ids: Sequence[int]) -> np.ndarray:
        """Like `forward` but only the last row, float32 [vocab]; skips the LM head elsewhere
        (for a 200-token prompt that head is most of the prefill cost)."""
        return self.forward(cache, token_ids)[-1]

    def prefill(self, cache: Any, token_ids: Sequence[int]) -> np.ndarray:
        """Process a whole prompt; return the logits row for the next token, float32 [vocab].

        Backends override this to split the prompt the way their reference generator does, so
        greedy output stays bit-identical to it.
        """
        return self.forward_last(cache, token_ids)

    #: whether `forward_tree` works; without it the engine verifies one path per step
    supports_tree: bool = False

    @property
    def rows_independent(self) -> bool:
        """Whether a row's logits (and K/V) are bit for bit the same whatever else its forward
        carries, a prompt's rows included (the quantized forward: docs/engine/quantized.md, "Row
        independence"). Then a prompt's last rows and a draft tree may share one forward
        (`forward_tree_after`, `Engine`'s first block). This default: no (torch's float32
        matmuls over a long prompt take other kernels than a step's few rows)."""
        return False

    def forward_tree_after(self, cache: Any, prompt_rows: Sequence[int],
                           token_ids: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Append `prompt_rows` (a chain; their logits are not wanted) and then a token tree
        (`parents` as `forward_tree`'s, -1: after the last prompt row) in one forward; the
        tree's logits float32 [len(token_ids), vocab]. This default: two forwards."""
        if prompt_rows:
            self.forward_last(cache, prompt_rows)
        return self.forward_tree(cache, token_ids, parents)

    def forward_tree(
        self, cache: Any, token_ids: Sequence[int], parents: Sequence[int]
    ) -> np.ndarray:
        """Append a token tree to the cache in one forward; logits float32 [n, vocab].

        `parents[i] < i` is node i's parent in this batch (-1: the cached prefix). Node i sees
        the cached prefix, its ancestors and itself, at position prefix + depth. Afterwards the
        cache holds all n nodes in feed order until `compact` keeps one path.
        """
        raise NotImplementedError(f"backend {self.name!r} cannot verify token trees")

    def forward_batch(self, caches: Sequence[Any],
                      feeds: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[np.ndarray]:
        """Feed several sequences at once: `feeds[b] = (token_ids, parents)` is appended to
        `caches[b]` as by `forward_tree` (a chain, `parents[i] == i - 1`, as by `forward`);
        returns each sequence's logits float32 [len(token_ids), vocab].

        This default runs one sequence at a time (what a backend without a batched forward,
        MLX today, does): exact, with no batching gain. A backend that batches overrides it."""
        out = []
        for cache, (ids, parents) in zip(caches, feeds, strict=True):
            if is_chain(parents):
                out.append(self.forward(cache, ids))
            else:
                out.append(self.forward_tree(cache, ids, parents))
        return out

    def batches_rows(self) -> bool:
        """Whether `forward_batch` feeds several sequences in one call (torch, outside
        `batch_invariant`); the default one at a time (MLX) gains nothing from prompt rows
        beside the others and loses `prefill`'s own split (the engine's scheduler asks)."""
        return (type(self).forward_batch is not Backend.forward_batch
                and not getattr(self, "batch_invariant", False))

    def compact(self, cache: Any, base: int, keep: Sequence[int]) -> None:
        """After a tree forward at cache length `base`: keep the fed nodes `keep` (ascending
        feed indices, one root-to-node path), moved to positions base.., and drop the rest."""
        keep = list(keep)
        if keep != list(range(len(keep))):
            raise NotImplementedError(f"backend {self.name!r} cannot compact a token tree")
        self.crop(cache, base + len(keep))

    def capture_hidden(self, cache: Any, layers: Sequence[int]) -> None:
        """From now on, every forward on `cache` also keeps the hidden states entering the
        decoder layers `layers` (EAGLE-3's convention: id i is layer i's input, 0 the
        embeddings) for every fed position, from the same forward; `take_hidden` returns them.
        Opt-in per cache so that decoding without a head that reads them costs nothing."""
        raise BadRequestError(f"backend {self.name!r} cannot capture hidden states; "
                              "use the torch backend for an eagle drafter")

    def take_hidden(self, cache: Any) -> Any:
        """The hidden states captured by the last forward on `cache` ([n fed, layers, hidden],
        a framework tensor, feed order) and forget them; None when nothing was captured."""
        return None

    #: whether `copy_prefix` / `settle_cache` work (a verifier's prefix cache needs them)
    supports_prefix_copy: bool = False

    def copy_prefix(self, src: Any, dst: Any, length: int) -> None:
        """Append the first `length` positions of cache `src` to the empty cache `dst`, as if
        `dst` had been fed the same tokens (`src` is left as it was)."""
        raise NotImplementedError(f"backend {self.name!r} cannot copy cache prefixes")

    def prefix_floor(self, cache: Any) -> int:
        """The fewest positions `copy_prefix` can take from `cache` (0: any prefix; a cache
        that dropped positions, bounded K/V, gives only the longer ones)."""
        return 0

    def settle_cache(self, cache: Any, length: int) -> int:
        """Crop `cache` to `length` positions held in no more memory than they need (a crop
        may leave a view on larger storage) before it is kept; return its bytes."""
        raise NotImplementedError(f"backend {self.name!r} cannot copy cache prefixes")

    @abstractmethod
    def cache_length(self, cache: Any) -> int:
        """Number of positions held in the cache."""

    @abstractmethod
    def crop(self, cache: Any, length: int) -> None:
        """Drop cached positions beyond `length` (rolls back rejected draft tokens)."""


def is_chain(parents: Sequence[int]) -> bool:
    """Whether a fed token tree is one chain (each node the child of the one before it)."""
    return all(p == i - 1 for i, p in enumerate(parents))


def tree_layout(parents: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """A token tree's depths and visibility: `parents[i] < i` (-1: the cached prefix); node i
    sits at depth[i] and sees the batch nodes visible[i] (its ancestors and itself)."""
    n = len(parents)
    visible = np.eye(n, dtype=bool)
    depth = np.zeros(n, dtype=np.int64)
    for i, p in enumerate(parents):
        if p >= 0:
            visible[i] |= visible[p]
            depth[i] = depth[p] + 1
    return depth, visible

