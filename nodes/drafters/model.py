"""A small causal LM as drafter, with its own KV cache rolled back when drafts are rejected.

The state remembers which ids its cache holds; on `draft` it crops back to the longest prefix
shared with the committed tokens (accepted drafts stay cached) and feeds only the new ones.

As a tree source (`ModelState.propose` through `DraftStateSource`, torch drafters) it drafts EAGLE-2
style: each level is one tree forward of the draft model over the tree so far; every expanded node
offers its top-`width` children scored by cumulative draft probability, and the best-scoring
candidates anywhere in the tree (not only under the best node) are added until the node budget is
spent. Where the drafter is sure the tree is nearly a chain; where it is unsure it branches. Tree
tokens are deterministic proposals (point masses), which multi-candidate rejection sampling accepts
losslessly.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from nodes.backends.base import Backend
from nodes.drafters.base import Drafter, DraftState, DraftStateSource
from nodes.engine.sampling import SamplingParams, probs_from_logits, sample
from nodes.engine.tree import DraftTree

if TYPE_CHECKING:
    from nodes.engine.grammar import GrammarMatcher

log = logging.getLogger(__name__)

#: children offered per expanded node; 1 drafts a plain chain
TREE_WIDTH = 3
#: a level adds a further node only if its cumulative probability is at least this fraction of
#: the level's best one
BRANCH_RATIO = 0.2
#: drafting ahead: a runner-up is sent only if the drafter gives it at least this probability
MIN_ALT_CONF = 0.05


class ModelState(DraftState):
    def __init__(self, backend: Backend, prompt_ids: Sequence[int], params: SamplingParams):
        self.backend = backend
        self.params = params
        seed = None if params.seed is None else params.seed + 0x5EED
        self.rng = np.random.default_rng(seed)
        self.tokens: list[int] = [int(t) for t in prompt_ids]
        self.cached: list[int] = []  # ids whose keys/values are in the cache, in order
        self.cache: Any = backend.new_cache()
        #: the generation's grammar (`constrain`), at the state after every token past
        #: `constrained_from` (or after those up to where it completed); None: free drafting
        self.grammar: GrammarMatcher | None = None
        self.constrained_from = 0

    def constrain(self, matcher: GrammarMatcher) -> None:
        """Draft only what `matcher` (a fresh one: nothing consumed) allows after the tokens
        so far: every drafted token comes from the drafter's logits masked by the grammar, as
        the verifier picks its own (a proposer whose verifier sent the grammar)."""
        self.grammar, self.constrained_from = matcher, len(self.tokens)

    def extend(self, delta: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in delta)
        grammar = self.grammar
        if grammar is None:
            return
        try:
            for t in delta:
                if grammar.done:
                    break
                grammar.advance(int(t))
        except RuntimeError as exc:  # a commit the grammar refuses: not this grammar's text
            log.warning("drafting without the grammar from here: %s", exc)
            self.grammar = None

    def truncate(self, length: int) -> None:
        """Roll back to `length` tokens; the cache is cropped to the common prefix lazily, at
        the next `draft`."""
        del self.tokens[max(length, 0) :]
        if self.grammar is not None:
            self.grammar.sync(min(self.grammar.consumed, max(length - self.constrained_from, 0)))

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
        probs: list[np.ndarray] = []

        def choose(row: np.ndarray) -> int:
            if self.params.greedy:
                return int(np.argmax(row))
            q = probs_from_logits(row, self.params)[0]
            probs.append(q.astype(np.float32))
            return sample(q, self.rng)

        ids = self._decode(k, choose)
        return np.asarray(ids, dtype=np.int32), (np.stack(probs) if probs else None)

    def draft_ahead(self, k: int, width: int = 1) -> DraftTree:
        """The likeliest chain (`draft`'s under greedy), each token's draft probability, and at
        each position up to `width - 1` runners-up worth at least MIN_ALT_CONF (one-token
        branches).

        Under sampling too the chain is the mode of `q`, not a sample: these drafts travel
        without `q` and are verified as point masses, which the verifier accepts with
        probability p(x). The mode maximises that under the drafter's own belief (p ~ q);
        a sample from q does worse on average (measured with int8 vs the fp32 model,
        docs/engine.md: 0.35 vs 0.28 per token at temperature 0.7, 0.26 vs 0.14 at 1.0).
        """
        conf: list[float] = []
        branches: list[tuple[int, tuple[int, ...], tuple[float, ...]]] = []

        def choose(row: np.ndarray) -> int:
            q = self._probs(row)
            tok = int(np.argmax(q))
            at = len(conf)
            conf.append(float(q[tok]))
            if width > 1:
                top = sorted(np.argpartition(-q, width)[:width].tolist(), key=lambda t: -q[t])
                runners = [t for t in top if t != tok and q[t] >= MIN_ALT_CONF][: width - 1]
                branches.extend((at, (int(t),), (float(q[t]),)) for t in runners)
            return tok

        ids = self._decode(k, choose)
        return DraftTree.branched(ids, conf[: len(ids)], branches)

    def _decode(self, k: int, choose) -> list[int]:
        """k decode steps after everything committed, `choose(logits row) -> token` each."""
        if k <= 0 or not self.tokens:
            return []
        keep = self._common_prefix()
        self.backend.crop(self.cache, keep)
        feed = self.tokens[keep:]
        self.cached = self.tokens[:keep] + feed
        ids: list[int] = []
        grammar = self.grammar
        start = grammar.consumed if grammar is not None else 0
        try:
            for _ in range(k):
                row = self.backend.forward_last(self.cache, feed)
                ended = False
                if grammar is not None:  # the drafter's own logits under the grammar
                    ended = grammar.done  # complete: only the end is left to draft
                    row = grammar.mask_logits(np.array(row, copy=True))
                tok = choose(row)
                ids.append(tok)
                if ended:
                    break
                if grammar is not None:
                    grammar.advance(tok)
                feed = [tok]
                if len(ids) < k:
                    self.cached.append(tok)
        finally:
            if grammar is not None:  # the state follows the tokens, not the drafts
                grammar.sync(start)
        # the last drafted token was never fed: the cache holds self.cached exactly
        return ids

    def close(self) -> None:
        self.cache = None
        self.cached = []

    def propose(self, budget: int, width: int) -> DraftTree:
        if self.grammar is not None:  # under a grammar: its chain and runners-up, masked
            return self.draft_ahead(budget, width)
        if width <= 1 or not self.backend.supports_tree:
            ids, _probs = self.draft(budget)
            return DraftTree.of_chain(ids)
        return self.draft_tree(budget, width)

    def draft_tree(self, budget: int, width: int) -> DraftTree:
        """Up to `budget` tree nodes, the likeliest leaf's path as the chain."""
        keep = self._common_prefix()
        self.backend.crop(self.cache, keep)
        if len(self.tokens) - 1 > keep:
            self.backend.forward_last(self.cache, self.tokens[keep:-1])
        self.cached = self.tokens[:-1]
        base = len(self.cached)
        toks, parents, score = [self.tokens[-1]], [-1], [0.0]
        frontier = [0]
        heap: list[tuple[float, int, int]] = []  # (-cumulative log prob, parent, token)
        while len(toks) - 1 < budget:
            logits = self.backend.forward_tree(self.cache, toks, parents)
            self.backend.crop(self.cache, base)
            for node in frontier:
                q = self._probs(logits[node])
                top = np.argsort(-q, kind="stable")[:width]
                for t in top:
                    if q[t] > 0:
                        heapq.heappush(heap, (-(score[node] + np.log(q[t])), node, int(t)))
            frontier = []
            floor = -heap[0][0] + np.log(BRANCH_RATIO) if heap else 0.0
            while heap and len(frontier) < width and len(toks) - 1 < budget:
                if frontier and -heap[0][0] < floor:
                    break  # the drafter is sure here: spend the budget on depth, not breadth
                neg, parent, tok = heapq.heappop(heap)
                toks.append(tok)
                parents.append(parent)
                score.append(-neg)
                frontier.append(len(toks) - 1)
            if not frontier:
                break
        return DraftTree.from_parents(toks, parents, score)

    def _probs(self, row: np.ndarray) -> np.ndarray:
        if self.params.greedy:
            x = np.asarray(row, dtype=np.float64)
            e = np.exp(x - x.max())
            return e / e.sum()
        return probs_from_logits(row, self.params)[0]


class ModelDrafter(Drafter):
    """Drafts with a (smaller or cheaper) model sharing the verifier's tokenizer.

    Drafting ahead (proposer role) it streams a chunk per drafted token: the worker reads
    commits between chunks, so a contradicting commit stops wasted drafting within one step
    (with 4 tokens per chunk, most chunks were stale on arrival: measured, docs/engine.md)."""

    ahead_chunk = 1

    def __init__(
        self, backend: Backend, name: str | None = None, tree_width: int = TREE_WIDTH
    ) -> None:
        self.backend = backend
        self.name = name or f"model:{backend.model_name}"
        self.fingerprint = backend.fingerprint
        self.tree_width = tree_width  # local trees, and runners-up per position drafting ahead

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> ModelState:
        return ModelState(self.backend, prompt_ids, params)

    @property
    def takes_grammar(self) -> bool:
        """A model drafter masks its own logits with the grammar (`ModelState.constrain`),
        where its tokenizer is a Hugging Face one (llguidance builds its own from it)."""
        return getattr(getattr(self.backend, "tokenizer", None), "hf", None) is not None

    def grammar_tokenizer(self) -> Any:
        return self.backend.tokenizer

    def open_source(self, prompt_ids: Sequence[int],
                    params: SamplingParams) -> DraftStateSource:
        """A tree source (`ModelState.propose`); a chain where the backend has no tree
        forward."""
        return DraftStateSource(self.open(prompt_ids, params), len(prompt_ids), name=self.name,
                                width=self.tree_width)
