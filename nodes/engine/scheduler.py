"""Who feeds what in one step: `Scheduler.schedule(seqs) -> StepPlan`.

A step feeds started sequences their draft trees and new ones their prompt. Deciding which prompt
rows go in, and how, is a policy of its own, kept apart from drafting and settling so a new
capability (cache shapes, say) changes one small place:

* prefix reuse: a new prompt starts from the cache sharing its longest prefix (a kept one, or a
  batch-mate's), and may wait a step for a batch-mate that computes a long shared prefix now;
* the prefill budget: whole prompts, or `prefill_chunk`-sized chunks, at most so many prompt rows
  a step (first come, first served);
* row packing: what rides in the step's one batched forward, and what is prefilled alone.

The plan only decides; the engine runs it (`nodes/engine/core.py`). Decisions never depend on
what a sequence is batched with in a way that changes its output (docs/engine.md, "Batching").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nodes.engine.state import SequenceState
from nodes.prefixes import as_ids, common_prefix

if TYPE_CHECKING:
    from nodes.backends.base import Backend
    from nodes.engine.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

#: without `prefill_chunk`, the most prompt rows one batched forward takes from whole prompts
#: (a longer prompt is prefilled in a forward of its own)
BATCHED_PROMPT_ROWS = 1024
#: positions of a batch-mate's prompt worth waiting one step for instead of computing them
#: again (`Scheduler._defer_for_prefix`): ~0.25 s of prefill on SmolLM2 here, against a decode
#: step's ~0.1-0.2 s of waiting
PREFIX_DEFER_ROWS = 64
#: without `prefill_chunk`, the most prompt rows a step feeds from whole prompts beyond its
#: first (`Scheduler.prefill_step_rows`): prompts that arrive together start over several
#: steps, first come first, so the median of 8 chat prompts arriving together answers in about
#: half the time, at the same aggregate tok/s (docs/benchmarks.md, "Prompts that arrive
#: together")
PREFILL_STEP_ROWS = 256


@dataclass
class Fill:
    """One new sequence's prompt rows this step: `size` positions, `rows` the tokens fed."""

    index: int  # the sequence's place in the step's batch
    size: int
    #: the whole prompt from position 0 (`Backend.prefill` when alone): not chunked, nothing
    #: reused
    whole: bool
    rows: list[int]


@dataclass
class StepPlan:
    """What one step feeds: the trees of `decode`, the prompt rows of `fills`, in ONE forward
    (`together`: batched), after the `alone` prefills, each in a forward of its own. `waiting`
    sequences commit nothing this step (their turn has not come, or a batch-mate computes
    their prefix now)."""

    size: int  # sequences in the step
    decode: list[int] = field(default_factory=list)
    fills: list[Fill] = field(default_factory=list)
    alone: list[Fill] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    together: bool = False

    @property
    def forward(self) -> bool:
        """Whether there is a shared forward to run at all."""
        return bool(self.decode or self.fills)

    @property
    def sharing(self) -> int:
        """Sequences sharing the forward: an in-process source's drafting makes all of them
        wait (`CostModel.fit_draft_to_batch`)."""
        return len(self.decode) + len(self.fills) if self.together else 1

    @property
    def solo(self) -> bool:
        """One feed in the forward: its time is that sequence's own verify cost."""
        return len(self.decode) + len(self.fills) == 1

    @property
    def prompt_rows(self) -> int:
        return sum(fill.size for fill in self.fills)

    @property
    def new(self) -> int:
        """Sequences not decoding (their prompt in the forward, or waiting)."""
        return self.size - len(self.decode)


class Scheduler:
    """The step's prefill policy (module docstring). Its settings are the engine's: read and
    set through `Engine` (`Engine.prefill_chunk`, ...)."""

    def __init__(self, backend: Backend, *, prefill_chunk: int | None,
                 prefix_cache: PrefixCache | None,
                 batched_prompt_rows: int = BATCHED_PROMPT_ROWS) -> None:
        self.backend = backend
        #: None: a prompt is prefilled in one forward; N: in chunks of N positions, at most
        #: one chunk's worth of prompt rows per step
        self.prefill_chunk = prefill_chunk
        #: without chunks, the prompt rows a step feeds beyond its first prompt (the rest wait)
        self.prefill_step_rows = PREFILL_STEP_ROWS
        #: a new prompt waits a step for a batch-mate's prompt computed in this one when that
        #: gives it at least this many more positions to copy (`_defer_for_prefix`)
        self.prefix_defer_rows = PREFIX_DEFER_ROWS
        self.batched_prompt_rows = batched_prompt_rows
        #: earlier sequences' caches a new prompt starts from (None: every prompt prefilled
        #: whole; `nodes/engine/prefix_cache.py`); shared by engines on the same backend
        self.prefix_cache = prefix_cache

    def schedule(self, seqs: Sequence[SequenceState]) -> StepPlan:
        """The step's plan for `seqs` (distinct, unfinished). New sequences may take a prefix
        here (`_reuse_prefix`: a cache copy, the one thing scheduling does to a sequence)."""
        plan = StepPlan(size=len(seqs), decode=[i for i, s in enumerate(seqs) if s.started])
        fills = self._budget(seqs, plan)
        plan.together = len(plan.decode) + len(fills) > 1 and self.batches_rows()
        if plan.together and self.prefill_chunk is None and fills:
            fills = self._pack(fills, plan)
            plan.together = len(plan.decode) + len(fills) > 1
        if plan.together:
            plan.fills = fills
        else:
            plan.alone += fills
        return plan

    def _budget(self, seqs: Sequence[SequenceState], plan: StepPlan) -> list[Fill]:
        """The new sequences' prompt rows within the step's budget (`prefill_chunk` rows;
        `_prefill_size`), in order; the rest wait (`plan.waiting`)."""
        budget = self.prefill_chunk  # prompt rows this step may still feed (None: any)
        fills: list[Fill] = []
        feeding: list[tuple[list[int], int]] = []  # prompts computed this step, how far
        for i, seq in enumerate(seqs):
            if seq.started:
                continue
            if self._may_reuse(seq):
                self._reuse_prefix(seq, seqs)
                if self._defer_for_prefix(seq, feeding):
                    plan.waiting.append(i)  # a batch-mate computes it now
                    continue
            size = self._prefill_size(seq, budget)
            if not size:
                plan.waiting.append(i)  # the step's prompt rows are spent
                continue
            whole = self.whole(seq)
            rows = seq.prompt if whole else seq.prompt[seq.prefilled:seq.prefilled + size]
            fills.append(Fill(i, size, whole, rows))
            feeding.append((seq.prompt, seq.prefilled + size))
            if budget is not None:
                budget = max(0, budget - size)
        return fills

    def _pack(self, fills: list[Fill], plan: StepPlan) -> list[Fill]:
        """No chunking: whole prompts, first come first, while the step's prompt rows stay
        within `prefill_step_rows` (the first always runs); the rest wait for a later step. A
        prompt too long to pack (packed attention is quadratic in the rows) goes in a forward
        of its own. Returns the fills that join the batched forward."""
        packed, fed, waiting, joined = 0, 0, False, []
        for fill in fills:
            if waiting or (fed and fed + fill.size > self.prefill_step_rows):
                waiting = True  # and so does every later one: first come, first served
                plan.waiting.append(fill.index)
                continue
            fed += fill.size
            if packed + fill.size <= self.batched_prompt_rows:
                joined.append(fill)
                packed += fill.size
            else:
                plan.alone.append(fill)
        return joined

    def advance(self, seq: SequenceState, fill: Fill) -> None:
        """`fill` went in: count the prompt positions now cached (a whole prompt is counted by
        its first token), and show a chunked prefill's progress."""
        if not fill.whole:
            seq.prefilled += fill.size
            if self.prefill_chunk is not None:
                log.info("prefill %d/%d positions", seq.prefilled, len(seq.prompt))

    def batches_rows(self) -> bool:
        """Whether the backend's `forward_batch` feeds several sequences in one call
        (`Backend.batches_rows`): where it does not, prefills run alone."""
        return self.backend.batches_rows()

    def _may_reuse(self, seq: SequenceState) -> bool:
        """Whether `seq` may still start from another cache: a prefix cache is kept, nothing of
        its prompt has been computed for it yet, the backend is not `batch_invariant` (its
        promise is bit for bit solo output) and no source of it reads hidden states (they
        need every prompt row's)."""
        return (self.prefix_cache is not None and not seq.started
                and seq.prefilled == seq.reused and seq.hidden_layers is None
                and not getattr(self.backend, "batch_invariant", False))

    def _reuse_prefix(self, seq: SequenceState, mates: Sequence[SequenceState]) -> None:
        """Start the prompt from the cache sharing its longest prefix, kept (`PrefixCache`) or
        held by a sequence of this batch (running, or prefilled in an earlier step, or given
        a prefix just now): the prefill then feeds only the rest. Looked up again each step
        until the sequence's own prefill starts, so one that waited for a batch-mate's shared
        prefix (`_defer_for_prefix`) takes it."""
        live = []
        for mate in mates:
            if mate is not seq and mate.cache is not None:
                n = self.backend.cache_length(mate.cache)
                if n > seq.reused:
                    live.append((mate.committed[:n], mate.cache))
        hit = self.prefix_cache.lookup(seq.prompt, live, better_than=seq.reused)
        if hit is None:
            return
        src, n = hit
        if seq.reused:
            seq.cache = self.backend.new_cache()
        self.backend.copy_prefix(src, seq.cache, n)
        seq.prefilled = seq.reused = seq.stats.reused = n
        log.info("prompt of %d positions: %d reused from %s", len(seq.prompt), n,
                 "a running sequence" if any(c is src for _, c in live) else "the prefix cache")

    def _defer_for_prefix(self, seq: SequenceState, feeding: list[tuple[list[int], int]]
                          ) -> bool:
        """Whether `seq` should wait a step for a prompt this step computes (`feeding`: its
        tokens and the positions its cache covers after this step) that shares at least
        `prefix_defer_rows` more positions with it than it already has: next step it copies
        them (`_reuse_prefix`) instead of computing them again beside it. Why: requests with
        one long system prompt or tool schema (an agent's parallel calls) arrive together.
        A shorter prompt waits too when the batch-mate computes all of it but its last
        position (and at least the prefix cache's `min_reuse`): the n choices of one request
        (`n` > 1) then share ONE prefill, each of the others feeding only its last position."""
        prompt = as_ids(seq.prompt)
        whole = len(prompt) - 1 - seq.reused  # all a prefix can give it
        want = min(self.prefix_defer_rows, whole)
        for tokens, covered in feeding:
            shared = common_prefix(as_ids(tokens), prompt, min(covered, len(prompt) - 1))
            if want > 0 and shared >= seq.reused + want \
                    and shared >= self.prefix_cache.min_reuse:
                return True
        return False

    def _prefill_size(self, seq: SequenceState, budget: int | None) -> int:
        """Prompt rows `seq` feeds this step: the whole prompt, or with `prefill_chunk` set
        and a prompt longer than it, its next chunk; 0 when `budget` (prompt rows this step
        may still feed) is spent. A step's first prefill always runs.

        Chunk boundaries depend on the prompt alone (multiples of `prefill_chunk`), so a
        sequence's cache, hence its output, is the same whatever it is batched with; the
        budget only decides whether its next chunk runs now. A sequence whose sources read
        hidden states is prefilled whole (they get every prompt row's states in one piece)."""
        prompt, chunk = seq.prompt, self.prefill_chunk
        left = len(prompt) - seq.prefilled
        size = left if chunk is None or self.whole(seq) else min(chunk, left)
        if budget is not None and size > budget and budget < (chunk or 0):
            return 0
        return size

    def whole(self, seq: SequenceState) -> bool:
        """Whether the prompt goes in whole, from position 0 (not in chunks, nothing reused)."""
        if seq.reused:
            return False
        chunk = self.prefill_chunk
        return chunk is None or len(seq.prompt) <= chunk or seq.hidden_layers is not None
