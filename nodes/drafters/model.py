"""A small causal LM as drafter, with its own KV cache rolled back when drafts are rejected.

The session remembers which ids its cache holds; on `draft` it crops back to the longest prefix
shared with the committed tokens (accepted drafts stay cached) and feeds only the new ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from nodes.backends.base import Backend
from nodes.drafters.base import EMPTY_DRAFT, Drafter, DraftSession
from nodes.engine.sampling import SamplingParams, probs_from_logits, sample


class ModelSession(DraftSession):
    def __init__(self, backend: Backend, prompt_ids: Sequence[int], params: SamplingParams):
        self.backend = backend
        self.params = params
        seed = None if params.seed is None else params.seed + 0x5EED
        self.rng = np.random.default_rng(seed)
        self.tokens: list[int] = [int(t) for t in prompt_ids]
        self.cached: list[int] = []  # ids whose keys/values are in the cache, in order
        self.cache: Any = backend.new_cache()

    def extend(self, delta: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in delta)

    def warm(self) -> None:
        """Feed everything but the last token now, so the first `draft` is only decode steps.

        A remote proposer calls this at session open, while the verifier runs its own
        prefill, instead of paying the prompt inside the first draft's deadline.
        """
        if len(self.tokens) > 1 and not self.cached:
            self.backend.forward_last(self.cache, self.tokens[:-1])
            self.cached = self.tokens[:-1]

    def _common_prefix(self) -> int:
        n = min(len(self.cached), len(self.tokens) - 1)
        a = np.asarray(self.cached[:n])
        b = np.asarray(self.tokens[:n])
        diff = np.nonzero(a != b)[0]
        return int(diff[0]) if diff.size else n

    def draft(self, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        if k <= 0 or not self.tokens:
            return EMPTY_DRAFT, None
        keep = self._common_prefix()
        self.backend.crop(self.cache, keep)
        feed = self.tokens[keep:]
        self.cached = self.tokens[:keep] + feed
        ids: list[int] = []
        probs: list[np.ndarray] = []
        for _ in range(k):
            row = self.backend.forward_last(self.cache, feed)
            if self.params.greedy:
                tok = int(np.argmax(row))
            else:
                q = probs_from_logits(row, self.params)[0]
                tok = sample(q, self.rng)
                probs.append(q.astype(np.float32))
            ids.append(tok)
            feed = [tok]
            if len(ids) < k:
                self.cached.append(tok)
        # the last drafted token was never fed: the cache holds self.cached exactly
        out_probs = np.stack(probs) if probs else None
        return np.asarray(ids, dtype=np.int32), out_probs

    def close(self) -> None:
        self.cache = None
        self.cached = []


class ModelDrafter(Drafter):
    """Drafts with a (smaller or cheaper) model sharing the verifier's tokenizer."""

    def __init__(self, backend: Backend, name: str | None = None) -> None:
        self.backend = backend
        self.name = name or f"model:{backend.model_name}"
        self.fingerprint = backend.fingerprint

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> ModelSession:
        return ModelSession(self.backend, prompt_ids, params)
