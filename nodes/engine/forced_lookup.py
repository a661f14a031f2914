"""The text a grammar forces, continued by what a lookup drafter knows follows it.

Why: a grammar's forced run (a JSON key and its `":"`, a closing `"}}`) ends where the model
chooses again, and a lookup drafter (ngram, suffix) asked at the committed tip drafts from the
tip's match, which after a value the model chose (an invented amount, a date written before)
is often none. Past the forced run the context is the key the value belongs to, and the lookup
often knows what follows it: an agent loop calls the same tool again with arguments it used
before (`"date":"` -> `2025-03-14","passengers":2}}`). Asked only at the tip, that value's first
tokens wait for the next step: replayed over the structured bench's agent trace with an oracle
verifier (tools/structured_ceiling.py's replay), grammar + suffix needed 65 forwards, and 57
with this source beside them; extraction and tool calls, whose values come from the request's
own text after a key that text does not contain, moved by at most 2 forwards.

`ForcedLookupSource` is one more engine source: its draft is the forced run's first path
(`GrammarMatcher.forced_paths`, the way the model wrote it before first) followed by the
lookup's draft from past it (`DraftSource.propose_after`: extended, asked, truncated back),
judged per the lookup's class there like any source (`draft_class`), so the cost model learns
how often such continuations are right. The forced part is the grammar source's draft as well,
so merged it costs no row twice. Grammar-checked before any row is paid for, like every draft
(`prune_tree`), and accepted only where the verifier's own masked choice agrees: lossless as
every source is.
"""

from __future__ import annotations

from collections.abc import Sequence

from nodes.engine.grammar import GrammarMatcher
from nodes.engine.sources import DraftSource
from nodes.engine.tree import EMPTY_TREE, DraftTree

#: the longest forced run continued (the engine drafts at most its max draft, 16 by default)
MAX_RUN = 32


class ForcedLookupSource(DraftSource):
    """The grammar's forced run, then `lookup`'s draft from past it (module docstring)."""

    def __init__(self, matcher: GrammarMatcher, lookup: DraftSource) -> None:
        self.matcher = matcher
        self.lookup = lookup
        self.name = f"forced+{lookup.name}"
        #: the forced run at ((committed length, tokens the matcher consumed), run)
        self._run: tuple[tuple[int, int], list[int]] | None = None

    def forced_run(self, committed: Sequence[int]) -> list[int]:
        """The forced run from the committed state (its likeliest path), once per state: the
        class is asked before the draft in a step."""
        at = (len(committed), self.matcher.consumed)
        if self._run is None or self._run[0] != at:
            paths = self.matcher.forced_paths(MAX_RUN)
            self._run = (at, [int(t) for t in paths[0]] if paths else [])
        return self._run[1]

    def draft_class(self, committed: Sequence[int]) -> str | None:
        """The lookup's class past the forced run (None: nothing forced, or it cannot say)."""
        run = self.forced_run(committed)
        if not run:
            return None
        got = self.lookup.propose_after(committed, run, 0)
        return got[0] if got is not None else None

    def propose(self, committed: Sequence[int], budget: int) -> DraftTree:
        run = self.forced_run(committed)
        if not run or len(run) >= budget:
            return EMPTY_TREE
        got = self.lookup.propose_after(committed, run, budget - len(run))
        if got is None or not len(got[1]):
            return EMPTY_TREE
        return DraftTree.from_paths([([*run, *(int(t) for t in toks)], None)
                                     for toks, _conf in got[1].path_tokens() if len(toks)])


def continued_by_lookups(matcher: GrammarMatcher,
                         sources: Sequence[DraftSource]) -> list[DraftSource]:
    """One `ForcedLookupSource` per source in `sources` that drafts past assumed tokens for
    next to nothing (`DraftSource.peeks`: the in-process lookup drafters), for a constrained
    sequence drafting with its grammar's forced tokens."""
    return [ForcedLookupSource(matcher, s) for s in sources if s.peeks]
