"""Prompt-lookup drafting: continue the longest n-gram match in prompt + generated text.

Model-free and nearly free to run, so it pays off whenever the output copies the input (code
edits, extraction, quoting). Longest suffix first (max_n down to min_n). As a chain (`draft`) it
follows the most recent occurrence; as a tree source (`NgramState.propose`) it proposes the distinct
continuations of every earlier occurrence of the matched suffix, most recent first, so the
verifier picks the one the text actually takes. A continuation that runs into the tip of a
text repeating itself (a loop, a run of like items or digits) goes on with the repeat's period
(`copy_on`), as the suffix drafter's does: cut at the tip, a loop of one token drafted one token
a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nodes.drafters.base import (
    EMPTY_DRAFT,
    Drafter,
    DraftState,
    DraftStateSource,
    copy_on,
)
from nodes.engine.errors import BadRequestError
from nodes.engine.sampling import SamplingParams
from nodes.engine.sources import match_class
from nodes.engine.tree import EMPTY_TREE, DraftTree

#: earlier occurrences looked at per tree proposal (most recent first): bounds the work per step
MAX_OCCURRENCES = 16
#: the shortest suffix whose occurrences may add alternatives to a longer match's
ALT_MIN_N = 2


class NgramState(DraftState):
    """Index of n-gram -> end positions (oldest first), excluding the n-gram ending at the tip."""

    def __init__(
        self, prompt_ids: Sequence[int], min_n: int, max_n: int, branches: int = 1
    ) -> None:
        self.min_n, self.max_n, self.branches = min_n, max_n, branches
        self.tokens: list[int] = []
        self.index: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_n + 1)]
        self.extend(prompt_ids)

    def extend(self, delta: Sequence[int]) -> None:
        toks = self.tokens
        for t in delta:
            # the n-grams ending at the old tip are no longer the suffix: index them now
            end = len(toks)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.index[n].setdefault(tuple(toks[end - n : end]), []).append(end)
            toks.append(int(t))

    def truncate(self, length: int) -> None:
        """Undo `extend` past `length`: each n-gram indexed when token e was appended ends at e
        and sits last in its list, so popping from the newest back restores the index."""
        toks = self.tokens
        for end in range(len(toks) - 1, max(length, 0) - 1, -1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(toks[end - n : end])
                ends = self.index[n][key]
                ends.pop()
                if not ends:
                    del self.index[n][key]
        del toks[max(length, 0) :]

    def peek(self, assumed: Sequence[int], k: int,
             width: int = 1) -> tuple[str | None, DraftTree]:
        """`DraftState.peek`: extended by `assumed`, asked, truncated back (both exact)."""
        told = len(self.tokens)
        self.extend(assumed)
        try:
            return self.draft_class(), (self.propose(k, width) if k > 0 else EMPTY_TREE)
        finally:
            self.truncate(told)

    def longest_match(self) -> tuple[int, list[int]]:
        """The longest suffix of the text (at most max_n) that occurred before, and the end
        positions of its earlier occurrences (oldest first); (0, []) when none did."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            ends = self.index[n].get(tuple(toks[len(toks) - n :]))
            if ends:
                return n, ends
        return 0, []

    def draft_class(self) -> str | None:
        """The length of the match the next draft continues (`match_class`)."""
        return match_class(self.longest_match()[0])

    def draft(self, k: int) -> tuple[np.ndarray, None]:
        if k <= 0:
            return EMPTY_DRAFT, None
        n, ends = self.longest_match()
        if not n:
            return EMPTY_DRAFT, None
        return np.asarray(copy_on(self.tokens, ends[-1], k, n), dtype=np.int32), None

    def draft_ahead(self, k: int, width: int = 1) -> DraftTree:
        """The chain `draft` gives and, for width > 1, the other continuations (up to `width`
        in all) as branches off the point where each leaves the chain."""
        if width <= 1:
            return DraftTree.of_chain(self.draft(k)[0])
        return DraftTree.from_paths([(c, None) for c in self.continuations(k, width)])

    def propose(self, budget: int, width: int) -> DraftTree:
        """Several continuations per step (up to `branches`), deterministic."""
        return DraftTree.from_paths([(c, None) for c in self.continuations(budget)])

    def continuations(self, k: int, limit: int | None = None) -> list[list[int]]:
        """Distinct continuations (up to k tokens) of the earlier occurrences of the longest
        matched suffix, most recent first, then of shorter suffixes (down to ALT_MIN_N) as
        alternatives; at most `limit` (default: `branches`), none a prefix of an earlier one."""
        toks = self.tokens
        limit = self.branches if limit is None else limit
        if k <= 0:
            return []
        out: list[list[int]] = []
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            ends = self.index[n].get(tuple(toks[len(toks) - n :]))
            if not ends:
                continue
            if out and n < ALT_MIN_N:
                break
            for end in reversed(ends[-MAX_OCCURRENCES:]):
                cont = copy_on(toks, end, k, n)
                if cont and not any(c[: len(cont)] == cont for c in out):
                    out.append(cont)
                if len(out) >= limit:
                    return out
        return out


class NgramDrafter(Drafter):
    """Deterministic, tokenizer-agnostic; returns 0..k tokens.

    Defaults (n from 8 down to 1) were picked by replaying the decode benchmark's greedy outputs
    through the adaptive engine: long n-grams pick the right place in repetitive code, and the
    engine's acceptance tracking already turns junk single-token matches down. `branches` > 1
    proposes a tree of that many distinct continuations; off by default because on the
    benchmark prompts it committed no more tokens per forward than the chain (the longest
    matched suffix occurs once) while feeding more nodes (see docs/engine.md).
    """

    name = "ngram"
    fingerprint = None

    def __init__(self, min_n: int = 1, max_n: int = 8, branches: int = 1) -> None:
        if not (1 <= min_n <= max_n):
            raise BadRequestError(f"ngram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if not 1 <= branches <= MAX_OCCURRENCES:
            raise BadRequestError(f"ngram branches must be in 1..{MAX_OCCURRENCES}, got {branches}")
        self.min_n, self.max_n, self.branches = min_n, max_n, branches
        self.tree_width = branches

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> NgramState:
        return NgramState(prompt_ids, self.min_n, self.max_n, self.branches)

    def open_source(self, prompt_ids: Sequence[int],
                    params: SamplingParams) -> DraftStateSource:
        return DraftStateSource(self.open(prompt_ids, params), len(prompt_ids), name="ngram")
