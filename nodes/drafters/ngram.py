"""Prompt-lookup drafting: continue the longest recent n-gram match in prompt + generated text.

Model-free and nearly free to run, so it pays off whenever the output copies the input (code
edits, extraction, quoting). Longest suffix first (max_n down to min_n), most recent occurrence.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nodes.drafters.base import EMPTY_DRAFT, Drafter, DraftSession
from nodes.engine.errors import BadRequestError
from nodes.engine.sampling import SamplingParams


class NgramSession(DraftSession):
    """Index of n-gram -> most recent end position, excluding the n-gram ending at the tip."""

    def __init__(self, prompt_ids: Sequence[int], min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.extend(prompt_ids)

    def extend(self, delta: Sequence[int]) -> None:
        toks = self.tokens
        for t in delta:
            # the n-grams ending at the old tip are no longer the suffix: index them now
            end = len(toks)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.index[n][tuple(toks[end - n : end])] = end
            toks.append(int(t))

    def draft(self, k: int) -> tuple[np.ndarray, None]:
        toks = self.tokens
        if k <= 0:
            return EMPTY_DRAFT, None
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            end = self.index[n].get(tuple(toks[len(toks) - n :]))
            if end is not None:
                return np.asarray(toks[end : end + k], dtype=np.int32), None
        return EMPTY_DRAFT, None


class NgramDrafter(Drafter):
    """Deterministic, tokenizer-agnostic; returns 0..k tokens.

    Defaults (n from 8 down to 1) were picked by replaying the decode benchmark's greedy outputs
    through the adaptive engine: long n-grams pick the right place in repetitive code, and the
    engine's acceptance tracking already turns junk single-token matches down.
    """

    name = "ngram"
    fingerprint = None

    def __init__(self, min_n: int = 1, max_n: int = 8) -> None:
        if not (1 <= min_n <= max_n):
            raise BadRequestError(f"ngram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> NgramSession:
        return NgramSession(prompt_ids, self.min_n, self.max_n)
