"""Draft sources: where a step's candidates come from, and how they are told what happened.

The engine asks every source, once per step, "what do you have that extends this committed
prefix?" with `propose(committed, budget)`, and takes whatever comes back at once (possibly
nothing): a source must not block waiting for drafts that have not arrived. After the verify
forward it tells every source, asked or not, what was committed and how its own proposals
fared with `feedback(Feedback)`: explicit, never inferred from the next prefix. A source whose
drafts are in flight may say when they are due (`expected_wait`); the engine decides whether a
bounded wait for them pays (`CostModel.wait_pays`), else it goes on without them.

`SessionSource` adapts the older `DraftSession` interface (extend(delta)/draft(k)), so remote
sessions and third-party drafters keep working unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nodes.engine.tree import Candidate

if TYPE_CHECKING:
    from nodes.drafters.base import DraftSession


@dataclass(frozen=True)
class Feedback:
    """What one step did, as seen by one source."""

    committed: tuple[int, ...]  # tokens committed by this step (after any stop cut)
    committed_len: int  # prompt + generated after this step
    offered: int  # this source's draft tokens that went into the verified tree
    accepted: int  # leading tokens of the accepted path this source had proposed
    #: for a source with `hidden_layers`: the verifier's hidden states of the positions this
    #: step added to its cache (the committed path: every committed token but the new pending
    #: one), a framework tensor [n, len(hidden_layers), hidden]; None otherwise
    hidden: Any = None


class DraftSource(ABC):
    """Per-sequence proposer of candidate continuations."""

    name: str = "?"
    #: verifier layers whose hidden states this source reads (EAGLE-3 heads); the engine then
    #: captures them in the verify forwards and hands the committed ones over in `Feedback`
    hidden_layers: tuple[int, ...] | None = None

    @abstractmethod
    def propose(self, committed: Sequence[int], budget: int) -> list[Candidate]:
        """Candidates continuing `committed` (prompt + generated, read-only), at most `budget`
        tokens each; whatever is available now, possibly none. Called every step, also with
        budget 0 (a plain step), so a source can keep its own state in sync."""

    def feedback(self, fb: Feedback) -> None:
        """Called after every step, whether or not this source's candidates were used."""
        return None

    def expected_wait(self) -> float | None:
        """Seconds until drafts extending the latest commit are expected to arrive, when this
        source had none to offer and some are on their way (a remote proposer answering the
        commit just pushed); None when nothing is expected. The engine waits only when its cost
        model says the wait pays."""
        return None

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds for the drafts `expected_wait` announced; True when they
        came. Only called after `expected_wait` returned a number."""
        return False

    def close(self) -> None:
        return None


class SessionSource(DraftSource):
    """A `DraftSession` as a source: extend(delta) then draft(k) on each step, as before."""

    def __init__(self, session: DraftSession, told: int, *, owned: bool, name: str = "session"):
        self.session = session
        self.told = told  # committed tokens the session has been told about
        self.owned = owned  # close the session with the source
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
        if self.owned:
            self.session.close()
