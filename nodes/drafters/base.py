"""Drafters: the engine's `SourceOpener`s, shaped so they can also be served remotely.

A `Drafter` is shared and long-lived. In process, the engine opens one `DraftSource` per
sequence with `open_source` (the engine's one draft interface, nodes/engine/sources.py); a
drafter with trees or hidden-state inputs implements it directly. Behind a proposer node the
same drafter is driven through a `DraftState` (`open(prompt_ids, params)`): told what was
committed with `extend(delta)`, asked `draft(k)` for up to k tokens, or `draft_ahead(k, width)`
for a chain plus alternatives (a model's runners-up at a position, the n-gram index's other
continuations) as one `DraftTree` with the drafter's probability of each token, which the
verifier uses to rank the nodes of the tree it builds: one draft type from the drafter through
the wire (`draft_chunk` carries its fields) to the engine's merge; a state can roll back
(`truncate`). ("Session" is the wire's draft session between a verifier and a proposer,
nodes/proposer/role.py: it holds one `DraftState`.)

`draft` returns `(ids int32 [n], probs float32 [n, vocab] | None)` with 0 <= n <= k and never
padding; `probs` is the distribution each token was sampled from (None: a point mass). A
drafter with only a `DraftState` gets `open_source` for free (`DraftStateSource`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from nodes.engine.sampling import SamplingParams
from nodes.engine.sources import DraftSource, Feedback, SourceOpener
from nodes.engine.tree import EMPTY_TREE, DraftTree

EMPTY_DRAFT = np.zeros(0, dtype=np.int32)


def copy_on(tokens: Sequence[int], start: int, size: int, matched: int) -> list[int]:
    """The `size` tokens from `start` on, which a match of `matched` tokens ending at `start`
    predicts to follow the tip. Where they run into the tip and the match is at least as long
    as its distance from the tip (the tail has repeated with that period at least twice: a
    loop, a run of like items, a number's repeated digits), the copy goes on with the period,
    as an LZ77 copy overlapping its source does; else it stops at the tip (never padding)."""
    tip = len(tokens)
    period = tip - start
    chain = list(tokens[start : start + size])
    if len(chain) < size and 0 < period <= matched:
        chain = [tokens[start + i % period] for i in range(size)]
    return chain


class DraftState(ABC):
    """A drafter's state for one sequence (on a proposer: one per draft session)."""

    #: told each step's commit at `feedback` as well as at the next `propose` (the suffix
    #: drafter: so a generation's last block is in the text its index files at `close`)
    extends_at_feedback: bool = False

    @abstractmethod
    def extend(self, delta: Sequence[int]) -> None:
        """Tokens committed since the last call (or since open)."""

    @abstractmethod
    def draft(self, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Up to k proposed next tokens after everything committed so far."""

    def draft_ahead(self, k: int, width: int = 1) -> DraftTree:
        """Up to k chain tokens like `draft` (the tree's chain; the session advances by it),
        then up to `width - 1` alternatives where the drafter has any (this default: none)."""
        ids, _probs = self.draft(k)
        return DraftTree.of_chain(ids)

    def propose(self, budget: int, width: int) -> DraftTree:
        """This step's draft for the engine (`DraftStateSource.propose`), after everything
        committed: `draft`'s chain by default; a tree drafter (n-gram continuations, a model's
        tree, the suffix planner) gives its branches, up to `width` where it takes one."""
        ids, _probs = self.draft(budget)
        return DraftTree.of_chain(ids)

    def draft_class(self) -> str | None:
        """What kind of draft `draft` would make next from everything committed so far
        (`DraftSource.draft_class`: a short label, told for next to nothing); None: the
        session cannot tell (this default). A proposer sends it with each drafted token so
        the verifier judges remote drafts per class as it judges its own."""
        return None

    def peek(self, assumed: Sequence[int], k: int,
             width: int = 1) -> tuple[str | None, DraftTree] | None:
        """`draft_class` and `propose(k, width)` as they would be with `assumed` extended,
        the state left as it was (`DraftSource.propose_after`); None where that is not next
        to free (this default: a model's state would have to run on the assumed tokens)."""
        return None

    def truncate(self, length: int) -> None:
        """Forget every token past the first `length` (prompt + extended), so a proposer that
        drafted ahead on assumed tokens can roll back. Sessions that cannot raise
        NotImplementedError and are reopened from the tokens instead."""
        raise NotImplementedError

    def warm(self) -> None:
        """Optional: do per-session set-up (e.g. prompt prefill) ahead of the first draft."""
        return None

    def for_tokenizer(self, fingerprint: str) -> None:
        """The tokenizer of the verifier this session drafts for (a proposer's session, named
        by the verifier). A drafter that holds other sessions' text drafts from it only where
        it is that tokenizer's (the suffix drafter's global index: `GlobalIndex.pin`)."""
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

    @property
    def takes_grammar(self) -> bool:
        """Whether its states draft under a generation's grammar (`constrain(matcher)`): a
        proposer's card says so, and verifiers then send the grammar with the session (the
        others draft free and the verifier prunes). This default: no."""
        return False

    def grammar_tokenizer(self) -> Any:
        """The tokenizer (ours, `nodes.backends.tokenizer.Tokenizer`) a grammar for its
        states compiles against, where `takes_grammar`."""
        raise NotImplementedError

    @abstractmethod
    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> DraftState:
        """Start drafting for one generation: its `DraftState`."""

    def open_source(self, prompt_ids: Sequence[int], params: SamplingParams) -> DraftSource:
        """The state as a chain source; drafters with trees override this."""
        return DraftStateSource(self.open(prompt_ids, params), len(prompt_ids), name=self.name)


class DraftStateSource(DraftSource):
    """A `DraftState` as an engine source, the one adapter every drafter's state goes through:
    it tells the state what was committed since it last looked (`told`), then asks it for
    this step's draft (`DraftState.propose`)."""

    def __init__(self, state: DraftState, told: int, *, name: str = "session",
                 width: int = 1) -> None:
        self.state = state
        self.told = told  # committed tokens the state has been told about
        #: `propose_after` answers where the state's `peek` is its own (a lookup's)
        self.peeks = getattr(type(state), "peek", DraftState.peek) is not DraftState.peek
        self.name = name
        self.width = width

    def constrain(self, matcher: Any) -> None:
        """The state drafts under the generation's grammar (`Drafter.takes_grammar`)."""
        self.state.constrain(matcher)

    def _sync(self, committed: Sequence[int]) -> None:
        if len(committed) > self.told:
            self.state.extend(committed[self.told :])
            self.told = len(committed)

    def propose(self, committed: Sequence[int], budget: int) -> DraftTree:
        self._sync(committed)
        if budget <= 0:
            return EMPTY_TREE
        own = getattr(self.state, "propose", None)
        if own is None:  # a state not derived from DraftState (duck-typed): its chain
            ids, _probs = self.state.draft(budget)
            return DraftTree.of_chain(ids)
        return own(budget, self.width)

    def propose_after(self, committed: Sequence[int], assumed: Sequence[int],
                      budget: int) -> tuple[str | None, DraftTree] | None:
        peek = getattr(self.state, "peek", None)
        if peek is None:  # (a duck-typed state: it cannot)
            return None
        self._sync(committed)
        return peek(assumed, max(budget, 0), self.width)

    def draft_class(self, committed: Sequence[int]) -> str | None:
        if getattr(type(self.state), "draft_class",
                   DraftState.draft_class) is DraftState.draft_class:
            return None  # names none: its catch-up (a model's forward) stays in `propose`,
            # where the engine times it as drafting
        self._sync(committed)
        return self.state.draft_class()

    def feedback(self, fb: Feedback) -> None:
        if (getattr(self.state, "extends_at_feedback", False) and fb.committed
                and self.told + len(fb.committed) == fb.committed_len):
            self.state.extend(fb.committed)
            self.told = fb.committed_len

    def close(self) -> None:
        self.state.close()
