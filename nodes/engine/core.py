"""The speculative-decoding engine as a step machine: plan -> one forward -> commit.

Invariant between steps: the verifier cache holds every committed token except the last one
(the *pending* token, whose logits are not computed yet). A step asks every draft source for
its draft tree, merges them into one token tree rooted at the pending token, feeds the whole tree
in one forward (a chain is a tree with one branch), accepts the deepest correct path, takes the
correction (or bonus) token from the last accepted node's row, moves the accepted path's K/V
into place and crops the rest. No second forward is ever needed. An empty tree is a plain
decode step, which is how a slow, absent or unhelpful drafter degrades to decoding alone.

All per-sequence state lives in one `SequenceState` (committed ids, cache, sources, acceptance
and cost estimates; `nodes/engine/state.py`), never in generator locals, so `Engine.step_batch`
steps several sequences in one forward (each plans, accepts and commits on its own);
`Engine.step` is a batch of one and `Engine.stream` a thin loop over it.

A step is named parts, each in a module of its own (as mlx-lm's `speculative_generate_step` and
vLLM v1's `EngineCore.step` read): the scheduler (`scheduler.py`: which prompt rows go in, prefix
reuse, packing) -> the draft planner (`planner.py`: each sequence's tree, from the cost model it
owns) -> ONE forward (here) -> accept (here: the verification rule) -> the planner observes ->
settle (`settle.py`: commit, stop rules, feedback to the sources). This module assembles them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from nodes.engine import settle
from nodes.engine.errors import BadRequestError
from nodes.engine.forced_lookup import continued_by_lookups
from nodes.engine.grammar import GrammarMatcher, Grammars, GrammarSource
from nodes.engine.planner import DraftPlanner, Verified
from nodes.engine.sampling import (
    accept_tree_greedy,
    accept_tree_keyed,
    accept_tree_masked,
)
from nodes.engine.scheduler import BATCHED_PROMPT_ROWS, Fill, Scheduler, StepPlan
from nodes.engine.settle import Settler, needs_full_mask, noise, row_rules
from nodes.engine.sources import DraftSource, SourceOpener
from nodes.engine.state import (
    Block,
    GenerationParams,
    GenerationResult,
    SequenceState,
    Slot,
    Stats,
)
from nodes.engine.tree import TokenTree

if TYPE_CHECKING:
    from nodes.backends.base import Backend
    from nodes.engine.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

#: rows a sequence at which `Engine.learn_batch_cost` times batched forwards
BATCH_COST_ROWS = (1, 4)


class _Part:
    """An engine setting that one of its parts owns (`scheduler`, ...), read and set through
    the engine as before (`engine.prefill_chunk = 8`, `engine.prefix_cache = ...`)."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: Any, owner: type | None = None) -> Any:
        return self if engine is None else getattr(getattr(engine, self.part), self.name)

    def __set__(self, engine: Any, value: Any) -> None:
        setattr(getattr(engine, self.part), self.name, value)


class Engine:
    """Verifier backend + optional drafter (a `SourceOpener`), or caller-given sources.
    Steps one sequence (`step`) or several in one forward (`step_batch`); the verify costs it
    learns (solo and batched) carry over between sequences, acceptance starts afresh with each.

    `fixed_k` pins the draft node budget (tests); otherwise the cost model picks it per step.
    `tree=False` verifies only the best source's chain (what a backend without tree
    attention does anyway). `grammar_drafts`: a constrained sequence gets the grammar's forced
    tokens as one more draft source (`grammar.GrammarSource`), and the forced run continued by
    each in-process lookup source (`forced_lookup.ForcedLookupSource`).
    """

    def __init__(
        self,
        backend: Backend,
        drafter: SourceOpener | None = None,
        *,
        max_draft: int = 16,
        fixed_k: int | None = None,
        tree: bool = True,
        prefill_chunk: int | None = None,
        prefix_cache: PrefixCache | None = None,
        grammar_drafts: bool = True,
    ) -> None:
        if drafter is not None:
            drafter.check_compatible(backend.fingerprint)
        if max_draft < 1:
            raise BadRequestError(f"max draft length must be >= 1, got {max_draft}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise BadRequestError(f"prefill chunk must be >= 1, got {prefill_chunk}")
        #: which prompt rows each step feeds, and how (`nodes/engine/scheduler.py`); the
        #: module's `BATCHED_PROMPT_ROWS` read here, when the engine is made
        self.scheduler = Scheduler(backend, prefill_chunk=prefill_chunk,
                                   prefix_cache=prefix_cache,
                                   batched_prompt_rows=BATCHED_PROMPT_ROWS)
        #: which draft tokens each step verifies, from the learnt costs it owns (`cost`)
        self.planner = DraftPlanner(backend, max_draft=max_draft, fixed_k=fixed_k,
                                    tree=tree and getattr(backend, "supports_tree", False))
        #: turns what a forward proved into committed tokens (`nodes/engine/settle.py`)
        self.settler = Settler(backend)
        self.backend = backend
        self.drafter = drafter
        self.grammar_drafts = grammar_drafts
        self._grammars: Grammars | None = None

    #: the scheduler's settings (`Scheduler`): None or a chunk size; prompt rows a step feeds
    #: beyond its first; positions worth waiting a step for; earlier sequences' caches
    prefill_chunk = _Part("scheduler")
    prefill_step_rows = _Part("scheduler")
    prefix_defer_rows = _Part("scheduler")
    prefix_cache = _Part("scheduler")
    #: the planner's (`DraftPlanner`): the cost model (its record: verify, draft and batch
    #: costs, long-run acceptance), the longest draft, a pinned budget, tree verification
    cost = _Part("planner")
    max_draft = _Part("planner")
    fixed_k = _Part("planner")
    tree = _Part("planner")

    @property
    def grammars(self) -> Grammars:
        """This verifier's grammar compiler and its bounded cache (`grammar.Grammars`), made
        at the first constrained request."""
        if self._grammars is None:
            self._grammars = Grammars(self.backend.tokenizer, self.backend.vocab_size)
        return self._grammars

    # ---- public API -------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: GenerationParams,
                 on_block: Callable[[Block], None] | None = None) -> GenerationResult:
        """Run a whole generation and collect it, calling `on_block` as each block is
        committed (for streaming)."""
        start = time.perf_counter()
        stats = Stats()
        tokens: list[int] = []
        last: Block | None = None
        for block in self.stream(prompt_ids, params, stats=stats):
            tokens.extend(block.token_ids)
            last = block
            if on_block is not None:
                on_block(block)
        assert last is not None and last.finish_reason is not None
        text = last.text if last.text is not None else self.backend.tokenizer.decode(tokens)
        return GenerationResult(prompt_ids=list(prompt_ids), token_ids=tokens, text=text,
                                finish_reason=last.finish_reason,
                                elapsed_s=time.perf_counter() - start, stats=stats)

    def stream(
        self,
        prompt_ids: Sequence[int],
        params: GenerationParams,
        *,
        stats: Stats | None = None,
        sources: Sequence[DraftSource] | None = None,
    ) -> Iterator[Block]:
        """Yield committed tokens block by block, so callers can stream them as they land.
        `sources` as in `start`."""
        seq = self.start(prompt_ids, params, stats=stats, sources=sources)
        try:
            while seq.finish_reason is None:
                yield self.step(seq)
        finally:
            self.release(seq, keep=seq.finish_reason is not None)

    def start(
        self,
        prompt_ids: Sequence[int],
        params: GenerationParams,
        *,
        stats: Stats | None = None,
        sources: Sequence[DraftSource] | None = None,
        draft: bool = True,
    ) -> SequenceState:
        """A new sequence, validated, ready for its first step (the prefill).

        `sources` are the caller's (remote proposers with their deadlines, say): used, never
        closed by the engine; an empty list drafts with none of them. Without them the engine
        opens one source on its own drafter, if it has one, and closes it with the sequence.
        A constrained sequence also drafts the grammar's forced tokens (`grammar_drafts`)
        unless `draft` is False: plain decoding, no drafts at all (a request's `speculate:
        false`, the baseline speculation is measured against)."""
        prompt = self._check_prompt(prompt_ids)
        params = self._checked(params, len(prompt))
        sp = params.sampling
        eos = (
            self.backend.tokenizer.eos_token_ids
            if params.eos_token_ids is None
            else frozenset(params.eos_token_ids)
        )
        slots, grammar = self._slots(prompt, params, sources, draft)
        seq = SequenceState(
            prompt=prompt,
            params=params,
            eos=eos,
            noise_seed=sp.seed if sp.seed is not None else 0,  # greedy: no noise
            cache=self.backend.new_cache(),
            cost=self.planner.estimates(),
            stats=stats if stats is not None else Stats(),
            slots=slots,
            grammar=grammar,
        )
        self._capture_for(seq)
        return seq

    def _checked(self, params: GenerationParams, prompt_len: int) -> GenerationParams:
        """`params` validated against this engine (a `resumed` that leaves a prompt, biases
        inside the vocabulary), seeded: the sequence's noise key."""
        params.validate()
        if params.resumed >= prompt_len:
            raise BadRequestError(f"resumed: {params.resumed} generated tokens leave no prompt "
                                  f"of the {prompt_len} given", "resumed")
        vocab = self.backend.vocab_size
        for t, _ in params.sampling.logit_bias or ():
            if t >= vocab:
                raise BadRequestError(f"logit_bias: token id {t} outside the vocabulary "
                                      f"({vocab})", "logit_bias")
        return params.seeded()

    def _slots(self, prompt: list[int], params: GenerationParams,
               sources: Sequence[DraftSource] | None, draft: bool
               ) -> tuple[list[Slot], GrammarMatcher | None]:
        """The sequence's draft sources (`start`) and, constrained, its grammar matcher."""
        if sources is not None:
            slots = [Slot(s, s.name, owned=False) for s in sources]
        elif self.drafter is not None:
            slots = [Slot(self.drafter.open_source(prompt, params.sampling), self.drafter.name,
                          owned=True)]
        else:
            slots = []
        if params.constraint is None:
            return slots, None
        grammar = self.grammars.matcher(params.constraint)
        if params.resumed:  # a failover's resume: the grammar state after what it had
            grammar.resume(prompt[len(prompt) - params.resumed:])
        if self.grammar_drafts and draft:
            # the forced run, and each in-process lookup continuing it (`forced_lookup`)
            lookups = continued_by_lookups(grammar, [s.source for s in slots])
            slots.append(Slot(GrammarSource(grammar), GrammarSource.name, owned=True))
            slots += [Slot(s, s.name, owned=True) for s in lookups]
        if sources is None and not params.resumed and \
                getattr(self.drafter, "takes_grammar", False):  # (a Drafter's, not any opener's)
            # the engine's own model drafter drafts under the grammar too (a copy: its state
            # follows the commits, the sequence's follows acceptance)
            slots[0].source.constrain(self.grammars.matcher(params.constraint))
        return slots, grammar

    def release(self, seq: SequenceState, *, keep: bool = True) -> None:
        """The sequence is done (finished, cancelled or failed): close its sources and, with
        `keep` (its cache is whole: not after a step that raised), hand its cache to the
        prefix cache for later prompts that start the same way."""
        seq.close()
        if keep and self.prefix_cache is not None and seq.cache is not None:
            self.prefix_cache.store(seq.committed, seq.cache)
            seq.cache = None  # the prefix cache's now: never fed again

    def _capture_for(self, seq: SequenceState) -> None:
        """Opt the sequence's cache into hidden-state capture when a source reads them (the
        union of their layers, captured once); each such source gets its own columns."""
        wanted = [tuple(s.source.hidden_layers) for s in seq.slots if s.source.hidden_layers]
        if not wanted:
            return
        layers = tuple(sorted({i for w in wanted for i in w}))
        try:
            self.backend.capture_hidden(seq.cache, layers)
        except Exception:
            seq.close()
            raise
        seq.hidden_layers = layers
        for slot in seq.slots:
            own = slot.source.hidden_layers
            if own:
                slot.columns = [layers.index(i) for i in own]

    def step(self, seq: SequenceState) -> Block:
        """One verifier forward for `seq`: plan the tree, forward it, commit what it proved."""
        return self.step_batch([seq])[0]

    def step_batch(self, seqs: Sequence[SequenceState]) -> list[Block]:
        """One step of each sequence in `seqs` (distinct, unfinished), their blocks in order.

        Every started sequence plans its own tree (possibly just the pending token); new
        sequences feed their prompt (whole, or its next chunk, within the step's prefill
        budget: `Scheduler`). On a backend that batches rows (`Scheduler.batches_rows`) all of it
        goes through ONE forward (`Backend.forward_batch`; a prompt chunk is a chain whose last
        row alone matters); elsewhere each prefill runs alone first, as before. Then each
        sequence accepts and commits on its own, exactly as alone. A batch of one takes the
        solo code paths. Greedy outputs equal the solo ones whenever the backend's batched
        logits equal its solo logits (docs/engine.md, "Batching")."""
        _check_batch(seqs)
        plan = self.scheduler.schedule(seqs)
        blocks = {i: self.settler.nothing(seqs[i], 0) for i in plan.waiting}
        for fill in plan.alone:
            blocks[fill.index] = self._prefill(seqs[fill.index], fill)
        if plan.forward:
            decoding = [seqs[i] for i in plan.decode]
            trees = [self._plan(seq, plan.sharing) for seq in decoding]
            if plan.together:
                self.planner.fit_to_batch(decoding, trees, plan.prompt_rows, plan.new)
            ahead = self._masks_ahead(decoding)  # filled while the forward runs
            try:
                bases, logits, dt = self._forward(seqs, plan, trees)
            finally:  # the matchers are the compute thread's again once their masks are in
                root_bits = _masks(decoding, ahead)
            self.planner.observe_forward(trees, dt, together=plan.together,
                                         prompt_rows=plan.prompt_rows)
            for seq, i, tree, base, rows in zip(decoding, plan.decode, trees, bases,
                                                logits[:len(trees)], strict=True):
                blocks[i] = self._verified(seq, tree, base, rows, dt, alone=plan.solo,
                                           root_bits=root_bits.get(id(seq)))
            for fill, rows in zip(plan.fills, logits[len(trees):], strict=True):
                blocks[fill.index] = self._prefilled(seqs[fill.index], fill, rows[-1], dt)
        return [blocks[i] for i in range(len(seqs))]

    def learn_batch_cost(self, prompt_ids: Sequence[int], batch: int) -> None:
        """Give the batch curve (`CostModel.batch_cost`) its first points before any user:
        `batch` copies of `prompt_ids` in one forward and a one-row step (cold: not timed),
        then timed batched forwards of `BATCH_COST_ROWS` rows a sequence, on throwaway caches.

        Why: the curve is learnt from decode-only batched steps, so a verifier's first burst
        (prompts arriving together, then the steps that feed them) was judged on the solo
        curve, whose slope is the few-row kernel's (about 2 ms a row on SmolLM2 here, against
        5 in a batch), and drafts rode its prefill steps as if nearly free. Nothing to learn
        where forwards do not batch rows (MLX, `batch_invariant`) or for `batch` < 2."""
        if batch < 2 or not prompt_ids or not self.scheduler.batches_rows():
            return
        backend = self.backend
        caches = [backend.new_cache() for _ in range(batch)]
        chain = list(range(-1, len(prompt_ids) - 1))
        backend.forward_batch(caches, [(list(prompt_ids), chain)] * batch)
        base = backend.cache_length(caches[0])
        samples = []
        for k, timed in [(1, False)] + [(k, True) for k in BATCH_COST_ROWS]:
            # (a one-row step takes another path than the prompt's: its first call is cold)
            feed = ((list(prompt_ids) * k)[:k], list(range(-1, k - 1)))
            t0 = time.perf_counter()
            backend.forward_batch(caches, [feed] * batch)
            if timed:
                samples.append((batch * k, time.perf_counter() - t0))
            for cache in caches:
                backend.crop(cache, base)
        self.planner.learn_batch_curve(batch, samples)

    def _prefill(self, seq: SequenceState, fill: Fill) -> Block:
        """A new sequence's prompt (or its next chunk) in a forward of its own: the whole
        prompt through `Backend.prefill` (the reference generator's split: HF-identical), a
        chunk through `forward_last`. Its last rows with a draft tree where the backend's rows
        are independent (`_drafts_with_prompt`)."""
        if self._drafts_with_prompt(seq, fill):
            tree = self.planner.plan(seq, local_only=True)
            if tree.drafted:
                return self._prefill_drafted(seq, fill, tree)
        t0 = time.perf_counter()
        if fill.whole:
            row = self.backend.prefill(seq.cache, seq.prompt)
        else:
            row = self.backend.forward_last(seq.cache, fill.rows)
        return self._prefilled(seq, fill, row, time.perf_counter() - t0)

    def _drafts_with_prompt(self, seq: SequenceState, fill: Fill) -> bool:
        """Whether the prompt's last rows and a first draft tree share one forward: the fill
        ends the prompt, the backend's rows are independent of what a forward carries (so the
        prompt's K/V and the first token's logits are those a plain prefill gives, bit for
        bit), and an in-process source may have a draft already (a grammar's forced opening
        `{"tool":"`, a lookup's continuation of it). Why: a constrained answer's first
        forced run otherwise costs a forward of its own right after the prefill, one of the
        6-9 steps of an agent's tool call. Remote proposers are not asked (their session
        has only just opened), nor is anyone waited for."""
        return (self.backend.rows_independent and seq.hidden_layers is None
                and (fill.whole or seq.prefilled + fill.size == len(seq.prompt))
                and any(not slot.source.streams for slot in seq.slots))

    def _prefill_drafted(self, seq: SequenceState, fill: Fill, tree: TokenTree) -> Block:
        """The prompt's rows but its last, then `tree` (rooted at the prompt's last token), in
        one forward (`Backend.forward_tree_after`), accepted and settled as a step's tree: the
        first block carries the first token and whatever drafts the verifier proved after it.
        No verify-cost sample (prompt rows rode along)."""
        rows = list(fill.rows)
        base = self.backend.cache_length(seq.cache) + len(rows) - 1
        t0 = time.perf_counter()
        logits = self.backend.forward_tree_after(seq.cache, rows[:-1], tree.tokens,
                                                 tree.parents)
        dt = time.perf_counter() - t0
        self.scheduler.advance(seq, fill)
        block = self._verified(seq, tree, base, logits, dt, alone=False)
        return replace(block, fed=len(rows) - 1 + len(tree))

    def _prefilled(self, seq: SequenceState, fill: Fill, row: np.ndarray, dt: float) -> Block:
        """After `fill`'s prompt rows went in (`row`: the logits after the last)."""
        self.scheduler.advance(seq, fill)
        return self.settler.prefilled(seq, fill.size, row, dt)

    def _forward(self, seqs: Sequence[SequenceState], plan: StepPlan, trees: list[TokenTree]
                 ) -> tuple[list[int], list[np.ndarray], float]:
        """The step's ONE forward: the decoding sequences' trees, then the prompt rows, each
        on its own cache. Returns where each tree starts in its cache, every feed's logits (a
        prompt's: its last row's at least) and the forward's time."""
        bases = [self.backend.cache_length(seqs[i].cache) for i in plan.decode]
        feeds: list[Any] = [(t.tokens, t.parents) for t in trees]
        feeds += [_PromptRows(fill.rows) for fill in plan.fills]
        caches = [seqs[i].cache for i in plan.decode] + [seqs[f.index].cache for f in plan.fills]
        t0 = time.perf_counter()
        logits = self.backend.forward_batch(caches, feeds)
        return bases, logits, time.perf_counter() - t0

    def _plan(self, seq: SequenceState, sharing: int = 1) -> TokenTree:
        """The sequence's draft tree for this step (`DraftPlanner.plan`)."""
        return self.planner.plan(seq, sharing)

    def _masks_ahead(self, decoding: Sequence[SequenceState]) -> Future | None:
        """Start filling, on the grammar's mask thread, the root-row masks the step's accept
        will need (`settle.needs_full_mask`), all in one call (`Grammars.fill_ahead`); None
        when none does. The matchers are that thread's until the future is done."""
        if not settle.BATCH_MASKS or self._grammars is None:
            return None
        need = [seq.grammar for seq in decoding if needs_full_mask(seq)]
        return self._grammars.fill_ahead(need) if need else None

    def _verified(self, seq: SequenceState, tree: TokenTree, base: int, logits: np.ndarray,
                  dt: float, *, alone: bool, root_bits: np.ndarray | None = None) -> Block:
        """Accept the deepest path of `tree` the verifier's `logits` prove, tell the planner
        (before the tokens are committed) and settle. `alone`: the forward was this tree's;
        `root_bits`: the root row's grammar mask, filled ahead (`_masks_ahead`)."""
        path, nxt, logits = self._accept(seq, tree, logits, root_bits)
        self.planner.observe(seq, Verified(tree, path, dt, alone))
        return self.settler.verified(seq, tree, path, nxt, base, logits, dt)

    def _accept(self, seq: SequenceState, tree: TokenTree, logits: np.ndarray,
                root_bits: np.ndarray | None = None) -> tuple[list[int], int, np.ndarray]:
        """The deepest path of `tree` the verifier's `logits` prove (tree indices), the
        token after it (the correction, or a bonus) and the logits it was chosen from: greedy,
        or keyed by the sequence's noise (`sampling.accept_tree_keyed`: the text never depends
        on the drafts). A constrained sequence's rows are masked by its grammar as the walk
        reaches them, and the grammar follows the walk (`sampling.accept_tree_masked`; the
        masked rows are what its log probabilities come from)."""
        sp = seq.params.sampling
        at = len(seq.prompt) + len(seq.generated)  # the position node 0's row predicts
        vocab = self.backend.vocab_size
        noise_at = lambda depth: noise(seq, at + depth, vocab)  # noqa: E731
        rules = row_rules(seq, root_bits)  # logit controls, a grammar: row by row on the walk
        if rules is not None:
            if not logits.flags.writeable:
                logits = logits.copy()
            path, nxt = accept_tree_masked(logits, tree, sp, noise_at, *rules)
            return path, nxt, logits
        if sp.greedy:
            return (*accept_tree_greedy(logits, tree), logits)
        return (*accept_tree_keyed(logits, tree, sp, noise_at), logits)

    # ---- helpers ----------------------------------------------------------------------------
    def _check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise BadRequestError("empty prompt: need at least one token")
        bad = [t for t in prompt if not 0 <= t < self.backend.vocab_size]
        if bad:
            raise BadRequestError(f"prompt token id {bad[0]} outside vocabulary")
        return prompt

def _masks(decoding: Sequence[SequenceState], ahead: Future | None) -> dict[int, np.ndarray]:
    """The root masks `Engine._masks_ahead` filled, by sequence (waited for)."""
    if ahead is None:
        return {}
    bits = ahead.result()
    need = [seq for seq in decoding if needs_full_mask(seq)]
    return {id(seq): bits[i] for i, seq in enumerate(need)}


def _check_batch(seqs: Sequence[SequenceState]) -> None:
    if any(seq.finish_reason is not None for seq in seqs):
        raise RuntimeError("step on a finished sequence")
    if len({id(seq) for seq in seqs}) != len(seqs):
        raise ValueError("a sequence appears twice in one batch")


class _PromptRows(tuple):
    """A prompt chunk's feed, `(tokens, parents)` as a chain, marked `last_only`: only its last
    row's logits matter (a backend that batches computes only that row; the default one at a
    time returns them all, and the engine reads the last)."""

    last_only = True

    def __new__(cls, tokens: Sequence[int]) -> _PromptRows:
        tokens = list(tokens)
        return super().__new__(cls, (tokens, list(range(-1, len(tokens) - 1))))
