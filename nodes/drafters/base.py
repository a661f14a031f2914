"""Drafters: the engine's `SourceOpener`s, shaped so they can also be served remotely.

A `Drafter` is shared and long-lived. In process, the engine opens one `DraftSource` per
sequence with `open_source` (the engine's one draft interface, nodes/engine/sources.py); a
drafter with trees or hidden-state inputs implements it directly. Behind a proposer node the
same drafter is driven through a `DraftSession` (`open(prompt_ids, params)`): told what was
committed with `extend(delta)`, asked `draft(k)` for up to k tokens, or `draft_ahead(k,
width)` for a chain plus alternatives (`Branch`: a model's runners-up at a position, the
n-gram index's other continuations) with the drafter's probability of each token, which the
verifier uses to rank the nodes of the tree it builds; sessions can roll back (`truncate`).
`draft` returns `(ids int32 [n], probs float32 [n, vocab] | None)` with 0 <= n <= k and never
padding; `probs` is the distribution each token was sampled from (None: a point mass). A
drafter with only a session gets `open_source` for free (`SessionSource`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nodes.engine.sampling import SamplingParams
from nodes.engine.sources import DraftSource, SourceOpener
from nodes.engine.tree import Candidate

EMPTY_DRAFT = np.zeros(0, dtype=np.int32)


@dataclass(frozen=True)
class Branch:
    """An alternative inside a draft: `tokens` continue the draft's first `at` chain tokens
    (so its first token is an alternative to chain token `at`, or extends a chain of `at`)."""

    at: int
    tokens: tuple[int, ...]
    conf: tuple[float, ...] | None = None  # the drafter's probability of each token


@dataclass(frozen=True)
class AheadDraft:
    """What `DraftSession.draft_ahead` drafted: a chain, its tokens' draft probabilities
    (None: the drafter has none) and alternatives."""

    ids: np.ndarray  # int32 [n]
    conf: np.ndarray | None = None  # float32 [n]
    branches: tuple[Branch, ...] = ()


class DraftSession(ABC):
    """Per-generation drafter state."""

    @abstractmethod
    def extend(self, delta: Sequence[int]) -> None:
        """Tokens committed since the last call (or since open)."""

    @abstractmethod
    def draft(self, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Up to k proposed next tokens after everything committed so far."""

    def draft_ahead(self, k: int, width: int = 1) -> AheadDraft:
        """Up to k chain tokens like `draft`, and up to `width - 1` alternatives where the
        drafter has any (this default: none). The session advances by the chain only."""
        ids, _probs = self.draft(k)
        return AheadDraft(np.asarray(ids, dtype=np.int32).reshape(-1))

    def truncate(self, length: int) -> None:
        """Forget every token past the first `length` (prompt + extended), so a proposer that
        drafted ahead on assumed tokens can roll back. Sessions that cannot raise
        NotImplementedError and are reopened from the tokens instead."""
        raise NotImplementedError

    def warm(self) -> None:
        """Optional: do per-session set-up (e.g. prompt prefill) ahead of the first draft."""
        return None

    def features(self, rows: np.ndarray) -> None:
        """The verifier's hidden states ([n, layers x hidden], feed order) of the next n
        positions it cached, for drafters that read them (`Drafter.hidden_layers`)."""
        return None

    def close(self) -> None:
        """Release per-session resources (caches); the session is unusable afterwards."""
        return None


class Drafter(SourceOpener):
    """A source of draft tokens, in process (`open_source`) and behind a proposer (`open`)."""

    #: drafting ahead (proposer role): tokens per streamed chunk; 0 drafts up to the horizon
    #: in one go (cheap drafters), a model drafter streams a few at a time
    ahead_chunk: int = 0
    #: drafting ahead: candidates per position offered to the verifier (1: a chain only)
    tree_width: int = 1
    #: verifier layers whose hidden states this drafter reads (EAGLE-3 heads), and their
    #: width; a proposer's card asks verifiers for them (None: it reads none)
    hidden_layers: tuple[int, ...] | None = None
    hidden_size: int | None = None

    @abstractmethod
    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> DraftSession:
        """Start a session for one generation."""

    def open_source(self, prompt_ids: Sequence[int], params: SamplingParams) -> DraftSource:
        """The session as a chain source; drafters with trees override this."""
        return SessionSource(self.open(prompt_ids, params), len(prompt_ids), name=self.name)


class SessionSource(DraftSource):
    """A `DraftSession` as an engine source: extend(delta) then draft(k) on each step."""

    def __init__(self, session: DraftSession, told: int, *, name: str = "session") -> None:
        self.session = session
        self.told = told  # committed tokens the session has been told about
        self.name = name

    def propose(self, committed: Sequence[int], budget: int) -> list[Candidate]:
        delta = list(committed[self.told :])
        self.told = len(committed)
        self.session.extend(delta)
        if budget <= 0:
            return []
        ids, probs = self.session.draft(budget)
        return [Candidate(ids, probs)]

    def close(self) -> None:
        self.session.close()
