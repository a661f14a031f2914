"""Draft sources: where a step's drafts come from, and how they are told what happened.

The engine asks every source, once per step, "what do you have that extends this committed
prefix?" with `propose(committed, budget)`, answered with a `DraftTree`, and takes whatever
comes back at once (possibly nothing): a source must not block waiting for drafts that have not
arrived. After the verify forward it tells every source, asked or not, what was committed and
how its own proposals fared with `feedback(Feedback)`: explicit, never inferred from the next
prefix. A source whose drafts are in flight may say when they are due (`expected_wait`); the
engine decides whether a bounded wait for them pays (`CostModel.wait_pays`), else it goes on
without them.


A source comes from the caller (`Engine.start(..., sources=[...])`; an empty list is plain
decoding) or, when the caller gives none, from the engine's `SourceOpener` (a drafter), one
per sequence. This is the engine's only draft interface: drafters implement it, nothing here
knows about drafters, and how a drafter keeps its own per-sequence state (`DraftState`,
what a proposer's draft session holds) is the drafter's business.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nodes.engine.errors import TokenizerMismatchError
from nodes.engine.sampling import SamplingParams
from nodes.engine.tree import DraftTree

#: the lower ends of the match-length buckets (`match_class`), longest first
_MATCH_BUCKETS = (9, 5, 3, 2, 1)
#: a class label naming a context match: an optional prefix (the suffix drafter's "l"/"g")
#: then "m" and the bucket's lower end
_MATCH_LABEL = re.compile(r"(?P<prefix>[^#]*?)m(?P<low>[1-9][0-9]{0,2})")


def match_class(length: int) -> str | None:
    """The `DraftSource.draft_class` label of a draft continuing a context match of `length`
    tokens: 1, 2, 3-4, 5-8, 9+ ("m1", "m2", "m3", "m5", "m9"); None for no match. Buckets
    double in width because acceptance rises steeply over the first few tokens of a match and
    little after 8 (docs/engine.md, "Acceptance by match length")."""
    if length <= 0:
        return None
    return next(f"m{low}" for low in _MATCH_BUCKETS if length >= low)


def class_at(label: str, depth: int) -> str:
    """The class of the draft token `depth` places after the first of a chain whose first
    token is of class `label` (depth 0: `label` itself).

    A chain continuing a match of L tokens continues one of L + 1 tokens with its second
    token, if its first was right, and so on: so a label naming a match (`match_class`, after
    any prefix) climbs the buckets along the chain, from the bucket's lower end. Any other
    label (the suffix drafter's "repeat", a model drafter's none) is its own class at every
    depth. Why: a chain judged by its first token's class alone took the acceptance of a
    one-token match's whole chains, 0.8 on prompts whose answers copy them, and drafted 7-12
    tokens at the start of every open-ended answer, where a one-token match's next token is
    right a fifth of the time (docs/engine.md, "Acceptance along the chain")."""
    found = _MATCH_LABEL.fullmatch(label) if depth > 0 else None
    if found is None:
        return label
    return found["prefix"] + (match_class(int(found["low"]) + depth) or "")


def names_match(label: str) -> bool:
    """Whether `label` is a match-length class (`match_class`, after any prefix)."""
    return _MATCH_LABEL.fullmatch(label) is not None


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
    """Per-sequence proposer of draft continuations (a `DraftTree` a step)."""

    name: str = "?"
    #: verifier layers whose hidden states this source reads (EAGLE-3 heads); the engine then
    #: captures them in the verify forwards and hands the committed ones over in `Feedback`
    hidden_layers: tuple[int, ...] | None = None
    #: its drafts are made elsewhere and arrive when they arrive (a remote proposer): asked
    #: and absent from the verified tree, it may have been too late rather than empty-handed
    #: (`CostModel.record_unheard`); an in-process source has what it proposes at once
    streams: bool = False
    #: it answers `propose_after` (a lookup drafter in this process); the default does not
    peeks: bool = False

    @abstractmethod
    def propose(self, committed: Sequence[int], budget: int) -> DraftTree:
        """A draft continuing `committed` (prompt + generated, read-only), at most `budget`
        tokens deep; whatever is available now, possibly nothing (an empty tree). Called
        every step, also with budget 0 (a plain step), so a source can keep its own state in
        sync."""

    def draft_class(self, committed: Sequence[int]) -> str | None:
        """What kind of draft this source would make next from `committed`, as a short label
        (e.g. how long a context match it would continue: "m1", "m5"), when it can tell before
        drafting and for next to nothing; None: it cannot (the default) or has nothing to
        draft. The engine keeps the source's acceptance per label (`Engine._plan`).

        Why: a lookup drafter's drafts are not alike. Continuing a one-token match is right
        about a fifth of the time on chat and a third on code edits, continuing a match of 5-8
        tokens 0.7-0.97 (docs/engine.md, "Acceptance by match length"). One estimate for both
        either drafts junk or turns the source down where its long matches would pay, and a
        turned-down source only comes back through probes every 8-32 steps."""
        return None

    def propose_after(self, committed: Sequence[int], assumed: Sequence[int],
                      budget: int) -> tuple[str | None, DraftTree] | None:
        """What this source would draft (at most `budget` deep) and its `draft_class`, were
        `assumed` committed after `committed`, leaving its state as it was; None where it
        cannot tell for next to nothing (this default: a model's state would have to run on
        the assumed tokens, a remote proposer's state is on another machine). Lookup drafters
        answer it, so the text a grammar forces can be continued by what the lookup knows
        follows it (`nodes/engine/forced_lookup.py`)."""
        return None

    def feedback(self, fb: Feedback) -> None:
        """Called after every step, whether or not this source's draft was used."""
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


class SourceOpener(ABC):
    """What an engine opens one `DraftSource` per sequence from (a drafter): shared and
    long-lived, the per-sequence state lives in the sources it opens."""

    name: str = "?"
    #: tokenizer fingerprint the drafts are in; None means "works on any tokenizer's ids"
    fingerprint: str | None = None

    @abstractmethod
    def open_source(self, prompt_ids: Sequence[int], params: SamplingParams) -> DraftSource:
        """A source for one generation of `prompt_ids` under `params`."""

    def check_compatible(self, verifier_fingerprint: str) -> None:
        """Refuse to draft for a verifier whose token ids mean something else."""
        if self.fingerprint is not None and self.fingerprint != verifier_fingerprint:
            raise TokenizerMismatchError(
                f"drafter {self.name!r} tokenizer {self.fingerprint} does not match the "
                f"verifier's {verifier_fingerprint}; drafts would be meaningless"
            )
