"""What a drafter's proposals allow on a replayed workload: the oracle ceiling of a row.

Why: a measured speedup mixes two things: whether the drafter proposed the right tokens at all
(its content: the sequence itself, the index of earlier answers) and how well the engine judged
when to ask for them and how many (the cost model). With greedy decoding every row writes the
same answer, so once the plain row has written it, a drafter can be replayed over it offline
against an oracle verifier: at every step the drafter is asked for its proposals (chain and
alternatives, `DraftState.draft_ahead`, up to the engine's max draft), the oracle feeds only
the longest proposed path that the answer takes, and pays the verify cost of that many rows
(a plain step where none is right). No engine verifying that drafter's proposals does better at
that max draft, since every real step feeds at least the accepted path. So the measured row
over its ceiling says how much the engine's judging leaves; the ceiling over a target says
whether the drafter's content can reach it at all on this model's answers.

Costs are measured, not learnt: `measure_costs` times the request's own prefill and verify
forwards of 1 to max draft + 1 rows after it on the backend (fastest of a few), so a ratio is
the oracle's whole request (prefill + steps) against a plain one's on that curve. The growth of
the context while the answer is written (64-160 tokens) is left out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from nodes.drafters.base import Drafter
from nodes.engine.sampling import SamplingParams
from nodes.engine.sources import DraftSource, Feedback
from nodes.engine.tree import DraftTree


@dataclass(frozen=True)
class Ceiling:
    """One request's oracle replay: decode seconds plain and with the drafter, the answer's
    length and the tokens each forward committed (accepted drafts + the model's)."""

    plain_s: float
    drafted_s: float
    tokens: int
    committed: tuple[int, ...] = ()

    @property
    def forwards(self) -> int:
        return len(self.committed)

    @property
    def speedup(self) -> float:
        return self.plain_s / self.drafted_s if self.drafted_s > 0 else 1.0


@dataclass(frozen=True)
class CostCurve:
    """A prompt's prefill and verify forwards after it, in seconds (`measure_costs`)."""

    prefill_s: float
    rows_s: dict[int, float]  # rows fed -> seconds, measured sizes only

    def verify(self, rows: int) -> float:
        """Seconds for a forward of `rows` rows: measured, or interpolated between sizes."""
        xs = sorted(self.rows_s)
        return float(np.interp(rows, xs, [self.rows_s[x] for x in xs]))


def measure_costs(backend, prompt: Sequence[int], max_rows: int, repeat: int = 3) -> CostCurve:
    """Time `prompt`'s prefill once, then forwards of 1, 2, 4, ... and `max_rows` rows after
    it, each the fastest of `repeat` (the cache cropped back after each)."""
    prompt = [int(t) for t in prompt]
    sizes = sorted({1, 2, *(2**i for i in range(2, 6) if 2**i < max_rows), max_rows})
    cache = backend.new_cache()
    start = time.perf_counter()
    backend.forward_last(cache, prompt)
    prefill = time.perf_counter() - start
    filler = (prompt * (max_rows // max(len(prompt), 1) + 1))[:max_rows]
    best: dict[int, float] = {}
    for _ in range(repeat):
        for n in sizes:
            start = time.perf_counter()
            backend.forward(cache, filler[:n])
            best[n] = min(best.get(n, float("inf")), time.perf_counter() - start)
            backend.crop(cache, len(prompt))
    return CostCurve(prefill, best)


def oracle_replay(drafter: Drafter, prompt: Sequence[int], answer: Sequence[int],
                  verify_cost: Callable[[int], float], max_k: int) -> Ceiling:
    """Replay `drafter` over `answer` (the greedy continuation of `prompt`) with an oracle
    verifier (module doc), asking its session for its proposals ahead (`draft_ahead`: chain
    and alternatives, at the drafter's tree width) at every step. The session is closed at
    the end, so a drafter that learns from finished answers (the suffix index) has this one
    for the next request."""
    width = max(1, int(getattr(drafter, "tree_width", 1) or 1))
    source = _AheadSource(drafter.open(list(prompt), SamplingParams()), width)
    return replay_sources([source], lambda token: None, prompt, answer, verify_cost, max_k)


def replay_sources(sources: Sequence[DraftSource], advance: Callable[[int], None],
                   prompt: Sequence[int], answer: Sequence[int],
                   verify_cost: Callable[[int], float], max_k: int) -> Ceiling:
    """Replay `sources` over `answer` with an oracle verifier: every step asks each source
    for its proposals and commits the longest proposed path the answer takes, plus the model's
    own token. `advance(token)` moves any state the sources read besides their feedback past
    each committed token (a constrained sequence's grammar matcher, which `GrammarSource`
    drafts from, as the engine's settle does). As in the engine, the first answer token comes
    with the prompt's prefill, and a step drafts at most `max_k` tokens and never past the
    answer's last token. The sources are closed at the end."""
    answer = [int(t) for t in answer]
    committed = [int(t) for t in prompt]
    try:
        if not answer:
            return Ceiling(0.0, 0.0, 0)
        _commit(sources, advance, committed, answer[:1], [0] * len(sources))
        pos, seconds, steps = 1, 0.0, []
        while pos < len(answer):
            room = min(max_k, len(answer) - pos - 1)
            took = [0] * len(sources)
            if room > 0:
                for j, source in enumerate(sources):
                    for toks, _conf in source.propose(committed, room).path_tokens():
                        took[j] = max(took[j], _agrees(toks[:room], answer, pos))
            step = max(took, default=0) + 1
            seconds += verify_cost(step)
            steps.append(step)
            _commit(sources, advance, committed, answer[pos : pos + step], took)
            pos += step
        return Ceiling((len(answer) - 1) * verify_cost(1), seconds, len(answer), tuple(steps))
    finally:
        for source in sources:
            source.close()


def _commit(sources: Sequence[DraftSource], advance: Callable[[int], None],
            committed: list[int], tokens: Sequence[int], took: Sequence[int]) -> None:
    for t in tokens:
        advance(t)
    committed.extend(tokens)
    for source, accepted in zip(sources, took, strict=True):
        source.feedback(Feedback(committed=tuple(tokens), committed_len=len(committed),
                                 offered=accepted, accepted=accepted))


class _AheadSource(DraftSource):
    """A drafter's session as `oracle_replay` asks it: what it drafts ahead of what it was
    told (`DraftState.draft_ahead`), told every commit."""

    name = "ahead"

    def __init__(self, session, width: int) -> None:
        self.session, self.width = session, width

    def propose(self, committed: Sequence[int], budget: int) -> DraftTree:
        return self.session.draft_ahead(budget, self.width)

    def feedback(self, fb: Feedback) -> None:
        self.session.extend(list(fb.committed))

    def close(self) -> None:
        self.session.close()


def _agrees(tokens, answer: Sequence[int], pos: int) -> int:
    """How many leading `tokens` the answer takes from `pos` on."""
    n = 0
    for tok in tokens:
        if pos + n >= len(answer) or int(tok) != answer[pos + n]:
            break
        n += 1
    return n
