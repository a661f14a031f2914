"""The speculative-decoding engine as a step machine: plan -> one forward -> commit.

Invariant between steps: the verifier cache holds every committed token except the last one
(the *pending* token, whose logits are not computed yet). A step asks every draft source for
candidates, merges them into one token tree rooted at the pending token, feeds the whole tree
in one forward (a chain is a tree with one branch), accepts the deepest correct path, takes the
correction (or bonus) token from the last accepted node's row, moves the accepted path's K/V
into place and crops the rest. No second forward is ever needed. An empty tree is a plain
decode step, which is how a slow, absent or unhelpful drafter degrades to decoding alone.

All per-sequence state lives in one `SequenceState` (committed ids, cache, sources, acceptance
and cost estimates), never in generator locals, so `Engine.step_batch` steps several sequences
in one forward (each plans, accepts and commits on its own); `Engine.step` is a batch of one and
`Engine.stream` a thin loop over it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from nodes.engine.cost import CostModel, class_key
from nodes.engine.errors import BadRequestError
from nodes.engine.logprobs import token_logprobs
from nodes.engine.sampling import (
    accept_tree_greedy,
    accept_tree_keyed,
    keyed_sample,
    position_noise,
    probs_from_logits,
)
from nodes.engine.sources import DraftSource, Feedback, SourceOpener
from nodes.engine.state import (
    Block,
    Generation,
    GenerationParams,
    SequenceState,
    Slot,
    Stats,
    drop_source,
)
from nodes.engine.tree import Candidate, TokenTree
from nodes.prefixes import as_ids, common_prefix

if TYPE_CHECKING:
    from nodes.backends.base import Backend
    from nodes.engine.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

#: without `prefill_chunk`, the most prompt rows one batched forward takes from whole prompts
#: (a longer prompt is prefilled in a forward of its own)
BATCHED_PROMPT_ROWS = 1024
#: positions of a batch-mate's prompt worth waiting one step for instead of computing them
#: again (`Engine._defer_for_prefix`): ~0.25 s of prefill on SmolLM2 here, against a decode
#: step's ~0.1-0.2 s of waiting
PREFIX_DEFER_ROWS = 64
#: rows a sequence at which `Engine.learn_batch_cost` times batched forwards
BATCH_COST_ROWS = (1, 4)
#: without `prefill_chunk`, the most prompt rows a step feeds from whole prompts beyond its
#: first (`Engine.prefill_step_rows`): prompts that arrive together start over several steps,
#: first come first, so the median of 8 chat prompts arriving together answers in about half
#: the time, at the same aggregate tok/s (docs/benchmarks.md, "Prompts that arrive together")
PREFILL_STEP_ROWS = 256


class Engine:
    """Verifier backend + optional drafter (a `SourceOpener`), or caller-given sources.
    Steps one sequence (`step`) or several in one forward (`step_batch`); the verify costs it
    learns (solo and batched) carry over between sequences, acceptance starts afresh with each.

    `fixed_k` pins the draft node budget (tests); otherwise the cost model picks it per step.
    `tree=False` verifies only the first candidate's single path (what a backend without tree
    attention does anyway).
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
    ) -> None:
        if drafter is not None:
            drafter.check_compatible(backend.fingerprint)
        if max_draft < 1:
            raise BadRequestError(f"max draft length must be >= 1, got {max_draft}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise BadRequestError(f"prefill chunk must be >= 1, got {prefill_chunk}")
        #: None: a prompt is prefilled in one forward; N: in chunks of N positions, at most
        #: one chunk's worth of prompt rows per step (`_prefill`)
        self.prefill_chunk = prefill_chunk
        #: without chunks, the prompt rows a step feeds beyond its first prompt (the rest wait)
        self.prefill_step_rows = PREFILL_STEP_ROWS
        #: a new prompt waits a step for a batch-mate's prompt computed in this one when that
        #: gives it at least this many more positions to copy (`_defer_for_prefix`)
        self.prefix_defer_rows = PREFIX_DEFER_ROWS
        self.backend = backend
        self.drafter = drafter
        self.max_draft = max_draft
        self.fixed_k = fixed_k
        self.tree = tree and getattr(backend, "supports_tree", False)
        self.cost = CostModel(max_k=max_draft)
        #: earlier sequences' caches a new prompt starts from (None: every prompt prefilled
        #: whole; `nodes/engine/prefix_cache.py`); shared by engines on the same backend
        self.prefix_cache = prefix_cache

    # ---- public API -------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: GenerationParams,
                 on_block: Callable[[Block], None] | None = None) -> Generation:
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
        return Generation(prompt_ids=list(prompt_ids), token_ids=tokens, text=text,
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
    ) -> SequenceState:
        """A new sequence, validated, ready for its first step (the prefill).

        `sources` are the caller's (remote proposers with their deadlines, say): used, never
        closed by the engine; an empty list is plain decoding. Without them the engine opens
        one source on its own drafter, if it has one, and closes it with the sequence."""
        prompt = self._check_prompt(prompt_ids)
        params.validate()
        params = params.seeded()
        sp = params.sampling
        eos = (
            self.backend.tokenizer.eos_token_ids
            if params.eos_token_ids is None
            else frozenset(params.eos_token_ids)
        )
        if sources is not None:
            slots = [Slot(s, s.name, owned=False) for s in sources]
        elif self.drafter is not None:
            slots = [Slot(self.drafter.open_source(prompt, sp), self.drafter.name, owned=True)]
        else:
            slots = []
        seq = SequenceState(
            prompt=prompt,
            params=params,
            eos=eos,
            noise_seed=sp.seed if sp.seed is not None else 0,  # greedy: no noise
            cache=self.backend.new_cache(),
            cost=self.cost.fork(),
            stats=stats if stats is not None else Stats(),
            slots=slots,
        )
        self._capture_for(seq)
        return seq

    def release(self, seq: SequenceState, *, keep: bool = True) -> None:
        """The sequence is done (finished, cancelled or failed): close its sources and, with
        `keep` (its cache is whole: not after a step that raised), hand its cache to the
        prefix cache for later prompts that start the same way."""
        seq.close()
        if keep and self.prefix_cache is not None and seq.cache is not None:
            self.prefix_cache.store(seq.committed, seq.cache)
            seq.cache = None  # the prefix cache's now: never fed again

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
        one long system prompt or tool schema (an agent's parallel calls) arrive together."""
        prompt = as_ids(seq.prompt)
        for tokens, covered in feeding:
            shared = common_prefix(as_ids(tokens), prompt, min(covered, len(prompt) - 1))
            if shared >= seq.reused + self.prefix_defer_rows:
                return True
        return False

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
        budget: `_prefill_size`). On a backend that batches rows (`_batches_rows`) all of it
        goes through ONE forward (`Backend.forward_batch`; a prompt chunk is a chain whose last
        row alone matters); elsewhere each prefill runs alone first, as before. Then each
        sequence accepts and commits on its own, exactly as alone. A batch of one takes the
        solo code paths. Greedy outputs equal the solo ones whenever the backend's batched
        logits equal its solo logits (docs/engine.md, "Batching")."""
        if any(seq.finish_reason is not None for seq in seqs):
            raise RuntimeError("step on a finished sequence")
        if len({id(seq) for seq in seqs}) != len(seqs):
            raise ValueError("a sequence appears twice in one batch")
        blocks: dict[int, Block] = {}
        going = [i for i, seq in enumerate(seqs) if seq.started]
        budget = self.prefill_chunk  # prompt rows this step may still feed (None: any)
        fills: list[tuple[int, int]] = []  # (sequence, prompt rows it feeds now)
        feeding: list[tuple[list[int], int]] = []  # prompts computed this step, how far
        for i, seq in enumerate(seqs):
            if not seq.started:
                if self._may_reuse(seq):
                    self._reuse_prefix(seq, seqs)
                    if self._defer_for_prefix(seq, feeding):
                        blocks[i] = self._no_block(seq, 0)  # a batch-mate computes it now
                        continue
                size = self._prefill_size(seq, budget)
                if not size:
                    blocks[i] = self._no_block(seq, 0)  # the step's prompt rows are spent
                    continue
                fills.append((i, size))
                feeding.append((seq.prompt, seq.prefilled + size))
                if budget is not None:
                    budget = max(0, budget - size)
        together = len(going) + len(fills) > 1 and self._batches_rows()
        if together and self.prefill_chunk is None and fills:
            # no chunking: whole prompts, first come first, while the step's prompt rows stay
            # within `prefill_step_rows` (the first always runs); the rest wait for a later
            # step. A prompt too long to pack (packed attention is quadratic in the rows)
            # goes in a forward of its own.
            packed, fed, waiting, joined = 0, 0, False, []
            for i, size in fills:
                if waiting or (fed and fed + size > self.prefill_step_rows):
                    waiting = True  # and so does every later one: first come, first served
                    blocks[i] = self._no_block(seqs[i], 0)
                    continue
                fed += size
                if packed + size <= BATCHED_PROMPT_ROWS:
                    joined.append((i, size))
                    packed += size
                else:
                    blocks[i] = self._prefill(seqs[i], size)
            fills = joined
            together = len(going) + len(fills) > 1
        if not together:
            for i, size in fills:
                blocks[i] = self._prefill(seqs[i], size)
            fills = []
        if not going and not fills:
            return [blocks[i] for i in range(len(seqs))]
        # sequences sharing this step's forward: an in-process source's drafting makes all
        # of them wait (`CostModel.fit_draft_to_batch`)
        sharing = len(going) + len(fills) if together else 1
        trees = [self._plan(seqs[i], sharing) for i in going]
        if together:
            self._fit_to_batch([seqs[i] for i in going], trees,
                               sum(size for _, size in fills), len(seqs) - len(going))
        bases = [self.backend.cache_length(seqs[i].cache) for i in going]
        feeds: list[Any] = [(t.tokens, t.parents) for t in trees]
        feeds += [_PromptRows(self._prompt_rows(seqs[i], size)) for i, size in fills]
        t0 = time.perf_counter()
        logits = self.backend.forward_batch(
            [seqs[i].cache for i in going] + [seqs[i].cache for i, _ in fills], feeds)
        dt = time.perf_counter() - t0
        alone = len(feeds) == 1
        if together and not fills and self.fixed_k is None:
            # a sample of the batch's cost per row fed (prompt rows skip the LM head: not one)
            self.cost.record_batch(sum(len(t) for t in trees), dt)
        for i, tree, base, rows in zip(going, trees, bases, logits[:len(going)], strict=True):
            blocks[i] = self._settle(seqs[i], tree, base, rows, dt, alone=alone)
        for (i, size), rows in zip(fills, logits[len(going):], strict=True):
            blocks[i] = self._prefilled(seqs[i], size, rows[-1], dt)
        return [blocks[i] for i in range(len(seqs))]

    def _batches_rows(self) -> bool:
        """Whether the backend's `forward_batch` feeds several sequences in one call (torch,
        outside `batch_invariant`); the default one at a time (MLX) gains nothing from prompt
        rows beside the others and loses `prefill`'s own split, so there prefills run alone."""
        from nodes.backends.base import Backend as Base  # (imports the engine: not at the top)

        backend = self.backend
        return (type(backend).forward_batch is not Base.forward_batch
                and not getattr(backend, "batch_invariant", False))

    def learn_batch_cost(self, prompt_ids: Sequence[int], batch: int) -> None:
        """Give the batch curve (`CostModel.batch_cost`) its first points before any user:
        `batch` copies of `prompt_ids` in one forward and a one-row step (cold: not timed),
        then timed batched forwards of `BATCH_COST_ROWS` rows a sequence, on throwaway caches.

        Why: the curve is learnt from decode-only batched steps, so a verifier's first burst
        (prompts arriving together, then the steps that feed them) was judged on the solo
        curve, whose slope is the few-row kernel's (about 2 ms a row on SmolLM2 here, against
        5 in a batch), and drafts rode its prefill steps as if nearly free. Nothing to learn
        where forwards do not batch rows (MLX, `batch_invariant`) or for `batch` < 2."""
        if batch < 2 or not prompt_ids or not self._batches_rows():
            return
        backend = self.backend
        caches = [backend.new_cache() for _ in range(batch)]
        chain = list(range(-1, len(prompt_ids) - 1))
        backend.forward_batch(caches, [(list(prompt_ids), chain)] * batch)
        base = backend.cache_length(caches[0])
        for k, timed in [(1, False)] + [(k, True) for k in BATCH_COST_ROWS]:
            # (a one-row step takes another path than the prompt's: its first call is cold)
            feed = ((list(prompt_ids) * k)[:k], list(range(-1, k - 1)))
            t0 = time.perf_counter()
            backend.forward_batch(caches, [feed] * batch)
            if timed:
                self.cost.record_batch(batch * k, time.perf_counter() - t0)
            for cache in caches:
                backend.crop(cache, base)
        log.info("batch curve from %d throwaway sequences: %s", batch, ", ".join(
            f"{batch * k} rows {self.cost.batch_cost(batch * k) * 1000:.0f} ms"
            for k in BATCH_COST_ROWS))

    def _fit_to_batch(self, seqs: list[SequenceState], trees: list[TokenTree],
                      prompt_rows: int, new: int) -> None:
        """Trim the batch's least valuable draft nodes while their rows cost the batch more
        than they buy (`CostModel.fit_batch`, on the learnt rows -> seconds curve of batched
        forwards). `prompt_rows` ride along in this forward; `new` sequences (their prompt in
        it, or waiting for a later step) are delayed by every draft row too. Only greedy
        sequences' planned trees with node values are trimmed (a sampling sequence's tree
        stays as proposed); trimming drafts never changes outputs."""
        plans, which = [], []
        for s, (seq, tree) in enumerate(zip(seqs, trees, strict=True)):
            values = seq.plan_values
            if tree.drafted and values is not None and len(values) == len(tree):
                plans.append((values, seq.plan_forced))
                which.append(s)
        if not plans:
            return
        fixed = sum(len(t) for s, t in enumerate(trees) if s not in which)
        keeps = self.cost.fit_batch(plans, fixed_rows=fixed + len(plans),
                                    tokens=len(seqs) + new, prompt_rows=prompt_rows)
        if log.isEnabledFor(logging.DEBUG):
            planned = sum(len(v) - 1 for v, _ in plans)
            log.debug("batch of %d (+%d new, %d fixed rows, %d prompt rows): keeps %d of %d "
                      "planned draft nodes", len(seqs), new, fixed + len(plans), prompt_rows,
                      sum(map(len, keeps)), planned)
        for s, keep in zip(which, keeps, strict=True):
            tree = trees[s]
            if len(keep) == tree.drafted:
                continue
            seq = seqs[s]
            hist = seq.stats.k_hist
            hist[tree.drafted] -= 1
            trees[s] = tree = tree.subtree(keep)
            hist[tree.drafted] = hist.get(tree.drafted, 0) + 1
            for slot in seq.slots:
                slot.offered = tree.offered_by(slot.tag)

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
        size = left if chunk is None or self._whole(seq) else min(chunk, left)
        if budget is not None and size > budget and budget < (chunk or 0):
            return 0
        return size

    def _whole(self, seq: SequenceState) -> bool:
        """Whether the prompt goes in whole, from position 0 (not in chunks, nothing reused)."""
        if seq.reused:
            return False
        chunk = self.prefill_chunk
        return chunk is None or len(seq.prompt) <= chunk or seq.hidden_layers is not None

    def _prompt_rows(self, seq: SequenceState, size: int) -> list[int]:
        """The prompt tokens a prefill of `size` rows feeds now."""
        if self._whole(seq):
            return seq.prompt
        return seq.prompt[seq.prefilled:seq.prefilled + size]

    def _prefill(self, seq: SequenceState, size: int) -> Block:
        """A new sequence's prompt (or its next chunk) in a forward of its own: the whole
        prompt through `Backend.prefill` (the reference generator's split: HF-identical), a
        chunk through `forward_last`."""
        t0 = time.perf_counter()
        if self._whole(seq):
            row = self.backend.prefill(seq.cache, seq.prompt)
        else:
            row = self.backend.forward_last(seq.cache, self._prompt_rows(seq, size))
        return self._prefilled(seq, size, row, time.perf_counter() - t0)

    def _prefilled(self, seq: SequenceState, size: int, row: np.ndarray, dt: float) -> Block:
        """After `size` prompt rows went in (`row`: the logits after the last): a block with
        no tokens while chunks remain, else the first token, committed."""
        prompt = seq.prompt
        if not self._whole(seq):
            seq.prefilled += size
            if self.prefill_chunk is not None:  # chunks: show progress
                log.info("prefill %d/%d positions", seq.prefilled, len(prompt))
        seq.stats.verify_s += dt
        if seq.prefilled and seq.prefilled < len(prompt):
            return self._no_block(seq, size)
        sp = seq.params.sampling
        first = int(np.argmax(row)) if sp.greedy else keyed_sample(
            probs_from_logits(row, sp)[0], self._noise(seq, len(prompt)))
        return replace(self._commit(seq, [first], drafted=0, accepted=0, base=0,
                                    hidden=self._take_hidden(seq, None), rows=row), fed=size)

    def _no_block(self, seq: SequenceState, fed: int) -> Block:
        """A step that committed nothing for `seq` (a prefill chunk, or its turn to wait)."""
        return Block(token_ids=[], drafted=0, accepted=0, committed_len=len(seq.prompt),
                     cache_len=self.backend.cache_length(seq.cache), fed=fed)

    def _settle(self, seq: SequenceState, tree: TokenTree, base: int, logits: np.ndarray,
                dt: float, *, alone: bool) -> Block:
        """Accept the deepest path of `tree` the verifier's `logits` prove, compact the cache
        to it and commit. `dt`: the forward's time, a verify-cost sample only when `seq` had
        it to itself (a batch's time is not its own tree's cost)."""
        backend, stats, sp = self.backend, seq.stats, seq.params.sampling
        stats.verify_s += dt
        if self.fixed_k is None and alone:
            seq.cost.record_verify(len(tree), dt)
        if sp.greedy:
            path, nxt = accept_tree_greedy(logits, tree)
        else:
            at = len(seq.prompt) + len(seq.generated)  # the position node 0's row predicts
            path, nxt = accept_tree_keyed(logits, tree, sp,
                                          lambda depth: self._noise(seq, at + depth))
        hidden = self._take_hidden(seq, [0, *path])
        if not tree.is_chain():
            backend.compact(seq.cache, base, [0, *path])
            stats.tree_blocks += 1
        new = [*(tree.tokens[i] for i in path), nxt]
        if log.isEnabledFor(logging.DEBUG):  # once per step: no formatting unless asked
            log.debug("step at %d: fed %d (%s), accepted %d, verify %.1f ms; %s",
                      len(seq.committed), len(tree), "chain" if tree.is_chain() else "tree",
                      len(path), dt * 1000, ", ".join(
                          f"{s.key} k={s.budget} offered {s.offered} "
                          f"a={seq.cost.acceptance_of(s.key):.2f}" for s in seq.slots))
        if tree.drafted:
            stats.spec_blocks += 1
            stats.drafted += tree.drafted
            stats.accepted += len(path)
        else:
            stats.plain_steps += 1
        return replace(self._commit(seq, new, drafted=tree.drafted, accepted=len(path),
                                    tree=tree, path=path, base=base, hidden=hidden,
                                    rows=logits[[0, *path]]), fed=len(tree))

    def _noise(self, seq: SequenceState, position: int) -> np.ndarray:
        """The sampling noise of `position` in `seq` (a function of its seed and the position
        alone: the text never depends on drafts, batching or the verifier that served it)."""
        return position_noise(seq.noise_seed, position, self.backend.vocab_size)

    def _take_hidden(self, seq: SequenceState, rows: list[int] | None) -> Any:
        """The captured hidden states of the fed rows `rows` (None: all), in path order."""
        if seq.hidden_layers is None:
            return None
        hidden = self.backend.take_hidden(seq.cache)
        if hidden is None or rows is None:
            return hidden
        return hidden[rows]

    # ---- the step's parts -------------------------------------------------------------------
    def _plan(self, seq: SequenceState, sharing: int = 1) -> TokenTree:
        """Ask every source for candidates, each within the budget its own record earns (and,
        `sharing` sequences in the step, that the batch's rate leaves it), merge them into one
        tree (the likeliest source first) and keep the nodes worth a forward."""
        remaining = seq.params.max_tokens - len(seq.generated)
        cap = max(0, min(self.max_draft, remaining - 1))
        adaptive = self.fixed_k is None
        committed = seq.committed
        tree = TokenTree(seq.generated[-1])
        found: list[tuple[int, Candidate]] = []
        probes: set[int] = set()
        for i, slot in enumerate(list(seq.slots)):
            slot.asked, slot.offered, slot.tag, slot.budget = False, 0, i, 0
            try:
                label = slot.source.draft_class(committed) if adaptive else None
            except Exception as exc:  # noqa: BLE001 - same policy as propose
                drop_source(seq, slot, "failed", exc)
                continue
            slot.key = class_key(slot.name, label)
            budget = seq.cost.choose_k(slot.key) if adaptive else self.fixed_k
            if adaptive and sharing > 1:
                budget = seq.cost.fit_draft_to_batch(budget, slot.name, sharing,
                                                     key=slot.key)
            budget = slot.budget = max(0, min(budget, cap))
            t0 = time.perf_counter()
            try:
                cands = slot.source.propose(committed, budget)
            except Exception as exc:  # noqa: BLE001 - a broken source must not end generation
                drop_source(seq, slot, "failed", exc)
                continue
            dt = time.perf_counter() - t0
            slot.asked = True
            if budget <= 0:
                continue
            cands = [c for c in (self._clean(c, budget, seq.eos) for c in cands)
                     if len(c.tokens)]
            seq.stats.draft_s += dt
            if adaptive:
                seq.cost.record_draft(sum(len(c.tokens) for c in cands), dt, slot.name)
                if seq.cost.probing(slot.key):
                    probes.add(i)
            found += [(i, c) for c in cands]
        if adaptive and not found:
            found = self._wait_for_drafts(seq, committed, cap)
        elif adaptive:
            found = self._top_up(seq, committed, found)
        if adaptive:  # the source most likely to be right goes first (and wins ties)
            rank = {s.tag: seq.cost.acceptance_of(s.key) for s in seq.slots}
            found.sort(key=lambda pair: -rank[pair[0]])
        if found and not self.tree:
            found = found[:1]  # single-path verification: the best source's first candidate
        tree.add(found, cap if adaptive else min(cap, self.fixed_k),
                 max_depth=max(remaining - 1, 0))
        seq.plan_values = seq.plan_forced = None
        if adaptive and tree.drafted and seq.params.sampling.greedy:
            # greedy only: which proposals survive must not depend on sampled draft tokens
            values = tree.node_values({s.tag: seq.cost.chain_acceptance(s.key, tree.depth)
                                       for s in seq.slots})
            forced = [bool(probes & owners) for owners in tree.owners]
            keep = seq.cost.select(values, forced)
            tree = tree.subtree(keep)
            # what the batch may still trim by (`_fit_to_batch`), in the kept tree's order
            seq.plan_values = [values[0], *(values[i] for i in keep)]
            seq.plan_forced = [forced[0], *(forced[i] for i in keep)]
        for slot in seq.slots:
            slot.offered = tree.offered_by(slot.tag)
            if adaptive and slot.budget > 0 and not slot.offered:
                seq.cost.record_unheard(slot.key)
        if tree.drafted or found:
            seq.stats.k_hist[tree.drafted] = seq.stats.k_hist.get(tree.drafted, 0) + 1
        return tree

    def _wait_for_drafts(self, seq: SequenceState, committed: list[int],
                         cap: int) -> list[tuple[int, Candidate]]:
        """Nothing to verify but a plain step: wait for the one source whose announced drafts
        pay for the wait (the likeliest first), bounded by twice its announcement.

        A source being probed is waited for even when the wait does not pay on its current
        estimate: a remote proposer no faster than the verifier's plain step is never ahead of
        it, so without a wait its drafts never arrive in time to be judged and its estimate
        (the prior, at first) never moves. Probes back off while they fail, so a useless
        source costs a bounded wait every 8-32 steps."""
        ranked = sorted(seq.slots, key=lambda s: -seq.cost.acceptance_of(s.key))
        for slot in ranked:
            k = min(slot.budget, cap)
            wait = slot.source.expected_wait() if k > 0 else None
            if wait is None or not (seq.cost.wait_pays(slot.key, k, wait)
                                    or seq.cost.probing(slot.key)):
                continue
            return self._wait_then_propose(seq, slot, committed, k, wait) or []
        return []

    def _wait_then_propose(self, seq: SequenceState, slot, committed: list[int], k: int,
                           wait: float) -> list[tuple[int, Candidate]] | None:
        """Wait at most twice the announced `wait` for a source's drafts, then ask it for k;
        None when the source failed (it is dropped)."""
        t0 = time.perf_counter()
        try:
            came = slot.source.wait(2 * wait + 0.001)
            cands = slot.source.propose(committed, k) if came else []
        except Exception as exc:  # noqa: BLE001 - same policy as propose
            drop_source(seq, slot, "failed", exc)
            return None
        waited = time.perf_counter() - t0
        seq.stats.waited_s += waited
        seq.stats.waits += 1
        out = [(slot.tag, c) for c in (self._clean(c, k, seq.eos) for c in cands)
               if len(c.tokens)]
        if self.fixed_k is None:
            seq.cost.record_delivered(slot.key, max((len(c.tokens) for _, c in out), default=0),
                                      k)
        if log.isEnabledFor(logging.DEBUG):  # no formatting on the wait path unless asked
            log.debug("waited %.1f ms (announced %.1f) for %s: %s", waited * 1000,
                      wait * 1000, slot.name,
                      f"longest {max(len(c.tokens) for _, c in out)}" if out else "nothing")
        return out

    def _top_up(self, seq: SequenceState, committed: list[int],
                found: list[tuple[int, Candidate]]) -> list[tuple[int, Candidate]]:
        """Something to verify, but short: a source whose fresh drafts (answering the last
        commit) are due may offer its whole budget after a short wait, where what it has now
        continues an older guess and runs out a few tokens in (a proposer's drafts stop at its
        horizon past the commit it last knew). Wait, bounded by twice the announcement, when
        the cost model says the longer draft pays for the wait; the source's candidates are
        then replaced by what it has after the wait."""
        longest: dict[int, int] = {}
        for tag, cand in found:
            longest[tag] = max(longest.get(tag, 0), len(cand.tokens))
        for slot in sorted(seq.slots, key=lambda s: -seq.cost.acceptance_of(s.key)):
            have, k = longest.get(slot.tag, 0), slot.budget
            if k <= have:
                continue
            wait = slot.source.expected_wait()
            if wait is None or not seq.cost.top_up_pays(slot.key, have, k, wait):
                continue
            fresh = self._wait_then_propose(seq, slot, committed, k, wait)
            if fresh is None:  # the source failed and was dropped
                return [(tag, c) for tag, c in found if tag != slot.tag]
            if fresh:
                slot.asked = True
                return [(tag, c) for tag, c in found if tag != slot.tag] + fresh
            return found
        return found

    def _clean(self, cand: Candidate, budget: int, eos: frozenset[int]) -> Candidate:
        """A hostile or buggy source must not break the verifier: cut at the first bad id and
        at the budget it was given, ignore probabilities of the wrong shape (the draft is then
        deterministic) and draft confidences that are not probabilities.

        And cut after the first of the sequence's EOS ids: a token drafted past it can never
        commit (an accepted EOS ends the generation, a rejected one rejects what follows),
        so its row would be paid for nothing. Drafters that match the prompt run into it
        whenever a match continues across the chat template's end of a turn (a one-token
        match on an open-ended answer drafting the system prompt's end and the user turn)."""
        vocab = self.backend.vocab_size
        ids = np.asarray(cand.tokens, dtype=np.int64).reshape(-1)[: min(budget, self.max_draft)]
        bad = np.nonzero((ids < 0) | (ids >= vocab))[0]
        if bad.size:
            ids = ids[: bad[0]]
        if eos:
            ends = np.nonzero(np.isin(ids, np.fromiter(eos, dtype=np.int64)))[0]
            if ends.size:
                ids = ids[: ends[0] + 1]
        probs = cand.probs
        if probs is not None:
            probs = np.asarray(probs)
            if probs.ndim != 2 or probs.shape[0] < len(ids) or probs.shape[1] < vocab:
                probs = None
            else:
                probs = probs[: len(ids), :vocab]
        conf = cand.conf
        if conf is not None:
            conf = np.asarray(conf, dtype=np.float64).reshape(-1)
            if len(conf) < len(ids) or not np.all((conf[: len(ids)] >= 0)
                                                  & (conf[: len(ids)] <= 1)):
                conf = None  # NaN fails the range check too
            else:
                conf = conf[: len(ids)]
        return Candidate(ids, probs, conf)

    def _commit(
        self,
        seq: SequenceState,
        new: list[int],
        *,
        drafted: int,
        accepted: int,
        tree: TokenTree | None = None,
        path: list[int] | None = None,
        base: int = 0,
        hidden: Any = None,
        rows: Any = None,
    ) -> Block:
        """`rows[i]`: the verifier's logits `new[i]` was chosen from."""
        new, finish, text = self._finish(seq.generated, new, seq.params, seq.eos)
        top = seq.params.logprobs
        logprobs = None if top is None or not new else token_logprobs(
            np.atleast_2d(rows)[: len(new)], new, min(top, self.backend.vocab_size))
        seq.generated.extend(new)
        seq.finish_reason = finish
        seq.stats.blocks += 1
        committed = len(seq.prompt) + len(seq.generated)
        if hidden is not None:  # the rows of what stays cached (a stop rule may cut the path)
            hidden = hidden[: max(0, committed - 1 - base)]
        # roll back rejected (or cut-off) drafts: keep all committed but the pending one
        self.backend.crop(seq.cache, committed - 1)
        for slot in list(seq.slots):
            asked = slot.asked and tree is not None and path is not None
            fb = Feedback(
                committed=tuple(new),
                committed_len=committed,
                offered=slot.offered if asked else 0,
                accepted=tree.accepted_by(slot.tag, path) if asked else 0,
                hidden=None if hidden is None or slot.columns is None
                else hidden[:, slot.columns],
            )
            if fb.offered and self.fixed_k is None:
                seq.cost.record_acceptance(tree.depth_of(slot.tag), fb.accepted, slot.key)
            try:
                slot.source.feedback(fb)
            except Exception as exc:  # noqa: BLE001 - same policy as propose
                drop_source(seq, slot, "failed on feedback", exc)
        return Block(
            token_ids=new,
            drafted=drafted,
            accepted=accepted,
            committed_len=committed,
            cache_len=self.backend.cache_length(seq.cache),
            finish_reason=finish,
            text=text,
            logprobs=logprobs,
        )

    # ---- helpers ----------------------------------------------------------------------------
    def _check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise BadRequestError("empty prompt: need at least one token")
        bad = [t for t in prompt if not 0 <= t < self.backend.vocab_size]
        if bad:
            raise BadRequestError(f"prompt token id {bad[0]} outside vocabulary")
        return prompt

    def _finish(
        self,
        generated: list[int],
        new: list[int],
        params: GenerationParams,
        eos: frozenset[int],
    ) -> tuple[list[int], str | None, str | None]:
        """Cut a block's new tokens at EOS, max tokens or a stop string; say why it ended."""
        finish = None
        for i, t in enumerate(new):
            if t in eos:
                new, finish = new[: i + 1], "eos"
                break
        room = params.max_tokens - len(generated)
        if len(new) > room:
            new, finish = new[:room], "length"
        elif len(new) == room and finish is None:
            finish = "length"
        if not params.stop:
            return new, finish, None
        decode = self.backend.tokenizer.decode
        for i in range(len(new)):
            text = decode(generated + new[: i + 1])
            cut = min((p for p in (text.find(s) for s in params.stop) if p >= 0), default=-1)
            if cut >= 0:
                return new[: i + 1], "stop", text[:cut]
        return new, finish, decode(generated + new) if finish else None


class _PromptRows(tuple):
    """A prompt chunk's feed, `(tokens, parents)` as a chain, marked `last_only`: only its last
    row's logits matter (a backend that batches computes only that row; the default one at a
    time returns them all, and the engine reads the last)."""

    last_only = True

    def __new__(cls, tokens: Sequence[int]) -> _PromptRows:
        tokens = list(tokens)
        return super().__new__(cls, (tokens, list(range(-1, len(tokens) - 1))))
