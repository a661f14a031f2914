"""Suffix drafting (SuffixDecoding-style): continue the text's tail from this session and from
everything this drafter saw finished before.

Why: agents, SQL generators and editors repeat themselves across requests; a drafter that only
looks at the current sequence (ngram) drafts the tenth request of an agent loop as poorly as the
first. This one matches the tail of prompt + output in two indexes (nodes/drafters/
suffix_index.py): the session's own text, and a global index, shared by every session of this
drafter in the process, of earlier sessions' outputs (and prompts, with `prompts=1`), weighted by
how often each was written, kept within a byte budget.

A draft is a tree built from the occurrences of the longest matched suffix: their continuations
are counted (weighted) into a trie; the chain follows the heaviest child at each depth and its
`conf` is that child's share of its parent's count (the empirical continuation probability the
verifier's tree ranking and cost model read); alternatives are the other children whose path
probability is at least `min_prob`, offered only when the global index matched. A match in the
session's own text alone drafts a chain as ngram does: the continuation of the latest
occurrence, continued around a loop the text is in (`SuffixState._local_chain`). Its size
follows the match (SuffixDecoding's adaptive speculation): from the global index at most
`factor` x the matched length, so a one-token match drafts one token and a long one the whole
budget; from the session's own text up to the budget by default (`local_factor=0`), as the
ngram drafter, because an answer that copies its prompt does so in runs that a short match
starts. A path from the global index stops where its probability falls under `min_prob`.

An exact repeat comes first: a session whose prompt's keyed hash (`GlobalIndex.prompt_digest`)
files an earlier answer, and whose output so far is that answer's prefix, drafts the answer's
continuation from the current position, to the budget (the engine's max draft length, or a
proposer's horizon), as one chain with conf 1 where the filed answers agree
(`GlobalIndex.repeat`). The position is the session's output length, so it follows commits,
drafts assumed ahead and rollbacks alike; once the output leaves every filed answer, drafting
falls back to suffix matching as above.

A proposer serves verifiers of any tokenizer, and ids mean text only under their tokenizer: the
global index holds the ids of the first tokenizer named to it (`GlobalIndex.pin`: by a
publication the proposer hears, or by a session's verifier), and a session whose verifier names
another (`for_tokenizer`) drafts from its own text only and gives the index nothing.

The session's text enters the global index when the session closes (filed under its prompt's
hash). In a proposer that is the
committed text plus the few tokens it drafted ahead past the verifier's last commit (the role
does not say which were confirmed); those are copies of indexed text, so they only add weight to
a continuation the index already has.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nodes.drafters.base import (
    EMPTY_DRAFT,
    Drafter,
    DraftState,
    DraftStateSource,
    copy_on,
)
from nodes.drafters.suffix_index import MAX_MATCH, START, GlobalIndex, LocalIndex, Match
from nodes.engine.errors import BadRequestError
from nodes.engine.sampling import SamplingParams
from nodes.engine.sources import match_class
from nodes.engine.tree import EMPTY_TREE, DraftTree

log = logging.getLogger(__name__)

DEFAULT_BUDGET_MB = 64.0
#: documents whose continuation led a draft are marked useful (bounds the bookkeeping per draft)
TOUCH_PER_DRAFT = 8


@dataclass(frozen=True)
class SuffixOptions:
    budget_mb: float = DEFAULT_BUDGET_MB  # the global index's byte budget, in MiB
    factor: float = 1.0  # draft at most factor x matched length tokens (SuffixDecoding: 1.0)
    #: the same for matches in the session's own text; 0: up to the budget, as the ngram
    #: drafter does (an input-grounded answer copies its prompt in runs that a short match
    #: starts: measured in docs/engine.md "Suffix drafter")
    local_factor: float = 0.0
    min_prob: float = 0.1  # drop a path whose empirical probability falls under this
    width: int = 4  # candidates per position: the chain's token and up to width-1 alternatives
    prompts: bool = False  # index finished sessions' prompts too, not only their outputs

    def validate(self) -> None:
        if not self.budget_mb > 0:
            raise BadRequestError(f"suffix budget must be > 0 MB, got {self.budget_mb}")
        if not self.factor > 0:
            raise BadRequestError(f"suffix factor must be > 0, got {self.factor}")
        if not self.local_factor >= 0:
            raise BadRequestError(f"suffix local_factor must be >= 0, got {self.local_factor}")
        if not 0 <= self.min_prob <= 1:
            raise BadRequestError(f"suffix min_prob must be in [0, 1], got {self.min_prob}")
        if not 1 <= self.width <= 16:
            raise BadRequestError(f"suffix width must be in 1..16, got {self.width}")


def parse_spec(spec: str) -> SuffixOptions:
    """`suffix` or `suffix:budget=64,factor=1,local_factor=0,min_prob=0.1,width=4,prompts=1`."""
    name, _, rest = spec.partition(":")
    if name != "suffix":
        raise BadRequestError(f"not a suffix drafter spec: {spec!r}")
    kw: dict = {}
    types = {"budget": ("budget_mb", float), "factor": ("factor", float),
             "local_factor": ("local_factor", float),
             "min_prob": ("min_prob", float), "width": ("width", int),
             "prompts": ("prompts", lambda v: v.lower() in ("1", "true", "yes", "on"))}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in types:
            raise BadRequestError(
                f"bad suffix option {item!r}; use budget=MB, factor=F, local_factor=F, "
                "min_prob=P, width=N, prompts=0|1")
        field, cast = types[key.strip()]
        try:
            kw[field] = cast(value.strip())
        except ValueError as exc:
            raise BadRequestError(f"bad suffix option {item!r}: {exc}") from None
    opts = SuffixOptions(**kw)
    opts.validate()
    return opts


@dataclass
class SuffixPlan:
    """The suffix planner's reading of its trie, as `DraftTree.branched` takes it: the
    chain, each token's empirical probability, alternatives (at, tokens, conf): `tokens`
    continue the chain's first `at` tokens."""

    chain: list[int]
    conf: list[float]
    branches: list[tuple[int, list[int], list[float]]]


def plan_tree(conts: Sequence[tuple[int, ...]], weights: Sequence[float], size: int,
              width: int, min_prob: float) -> SuffixPlan:
    """Count weighted continuations into a trie and read a tree off it: the heaviest path as
    the chain, the other children whose path probability is >= `min_prob` (likeliest first,
    at most width-1) as alternatives, each followed along its own heaviest path. Earlier
    continuations win ties (callers list the most recent first)."""
    chain: list[int] = []
    conf: list[float] = []
    alts: list[tuple[float, int, int, float, list]] = []  # (path prob, at, token, p, group)
    merged: dict[tuple[int, ...], float] = {}  # identical continuations counted once
    for c, w in zip(conts, weights, strict=True):
        if c:
            merged[c] = merged.get(c, 0.0) + w
    group = list(merged.items())
    path = 1.0
    for d in range(size):
        kids = _children(group, d)
        if not kids:
            break
        mass = sum(w for _, w in group)
        tok, (w, sub) = max(kids.items(), key=lambda kv: kv[1][0])
        p = w / mass
        if width > 1:
            for other, (wo, subo) in kids.items():
                po = wo / mass
                if other != tok and path * po >= min_prob:
                    alts.append((path * po, d, other, po, subo))
        if path * p < min_prob:
            break
        chain.append(tok)
        conf.append(p)
        path *= p
        group = sub
    alts.sort(key=lambda a: -a[0])
    branches = []
    for prob, at, tok, p, sub in alts[: width - 1]:
        if at > len(chain):
            continue
        toks, confs = [tok], [p]
        for d in range(at + 1, size):
            kids = _children(sub, d)
            if not kids:
                break
            mass = sum(w for _, w in sub)
            nxt, (w, sub2) = max(kids.items(), key=lambda kv: kv[1][0])
            if prob * w / mass < min_prob:
                break
            prob *= w / mass
            toks.append(nxt)
            confs.append(w / mass)
            sub = sub2
        branches.append((at, toks, confs))
    return SuffixPlan(chain, conf, branches)


def _children(group, d: int) -> dict[int, list]:
    """Token at depth d -> [weight, continuations through it], in first-seen order."""
    kids: dict[int, list] = {}
    for c, w in group:
        if len(c) > d:
            k = kids.get(c[d])
            if k is None:
                kids[c[d]] = [w, [(c, w)]]
            else:
                k[0] += w
                k[1].append((c, w))
    return kids


class SuffixState(DraftState):
    """A sequence's local index and its view of the drafter's global one."""

    extends_at_feedback = True  # so the last block is in the text `close` files

    def __init__(self, drafter: SuffixDrafter, prompt_ids: Sequence[int]) -> None:
        self.drafter = drafter
        self.opts = drafter.opts
        self.prompt_len = len(prompt_ids)
        self.local = LocalIndex(prompt_ids)
        self.closed = False
        #: the prompt's keyed hash (`GlobalIndex.prompt_digest`): finds an earlier answer to it
        self.prompt_hash = drafter.index.prompt_digest(prompt_ids) if prompt_ids else None
        #: set when this session's verifier has another tokenizer than the global index's
        #: (`for_tokenizer`): then it drafts from its own text only and gives the index nothing
        self.foreign = False
        #: the tip's matches (`_matches`) and the global index's clock when they were taken;
        #: kept until the text or the index changes (an eviction moves positions)
        self._memo: tuple[int, Match, Match] | None = None

    def for_tokenizer(self, fingerprint: str) -> None:
        """A proposer's session for a verifier of tokenizer `fingerprint`: the global index
        holds one tokenizer's ids (`GlobalIndex.pin`); another's session keeps out of it."""
        if not self.drafter.index.pin(fingerprint):
            self.foreign = True
            self._memo = None

    def extend(self, delta: Sequence[int]) -> None:
        if len(delta):
            self._memo = None
        self.local.extend(delta)

    def truncate(self, length: int) -> None:
        self._memo = None
        self.local.truncate(max(length, 0))
        if len(self.local.tokens) < self.prompt_len:  # the prompt itself changed
            self.prompt_hash = None
        self.prompt_len = min(self.prompt_len, len(self.local.tokens))

    def peek(self, assumed: Sequence[int], k: int,
             width: int = 1) -> tuple[str | None, DraftTree]:
        """`DraftState.peek`: the local index extended by `assumed`, asked, truncated back
        (exact), and the tip's matches as they were (the text and the clock are again what
        they were taken at)."""
        told, memo = len(self.local.tokens), self._memo
        self.extend(assumed)
        try:
            return self.draft_class(), (self.propose(k, width) if k > 0 else EMPTY_TREE)
        finally:
            self.local.truncate(told)
            self._memo = memo

    def _global_context(self) -> list[int]:
        """The tail as the global index stores it: ... prompt, START, output."""
        toks, plen = self.local.tokens, self.prompt_len
        out = len(toks) - plen
        if out >= MAX_MATCH:
            return toks[len(toks) - MAX_MATCH :]
        keep = max(plen - (MAX_MATCH - out - 1), 0)
        return [*toks[keep:plen], START, *toks[plen:]]

    def _repeat(self, k: int) -> tuple[list[int], list[float]] | None:
        """An earlier answer to this prompt that the output so far follows: its next k."""
        index = self.drafter.index
        if self.prompt_hash is None or self.foreign or not index.by_prompt:
            return None
        return index.repeat(self.prompt_hash, self.local.tokens[self.prompt_len :], k)

    def _matches(self) -> tuple[Match, Match]:
        """The tip's longest matches in the session's text and in the global index."""
        index = self.drafter.index
        clock = index.clock  # read first: an add during the lookup makes the memo stale
        if self._memo is None or self._memo[0] != clock:
            local = self.local.match(self.local.tokens)
            glob = (index.lookup(self._global_context()) if index.docs and not self.foreign
                    else Match(0, [], []))
            self._memo = (clock, local, glob)
        return self._memo[1], self._memo[2]

    def draft_class(self) -> str | None:
        """`DraftSource.draft_class`: "repeat" for an earlier answer's continuation, else
        where the longer match is (g: the global index, l: this text) and its length class."""
        if not self.local.tokens:
            return None
        if self._repeat(1) is not None:
            return "repeat"
        local, glob = self._matches()
        m = max(local.length, glob.length)
        cls = match_class(m)
        return None if cls is None else ("g" if glob.length == m else "l") + cls

    def plan(self, k: int, width: int) -> SuffixPlan:
        """The draft tree for up to k chain tokens: from the index whose match is longer
        (both, counted together, on a tie)."""
        if k <= 0 or not self.local.tokens:
            return SuffixPlan([], [], [])
        index = self.drafter.index
        again = self._repeat(k)
        if again is not None:  # the same prompt answered before: its continuation
            return SuffixPlan(*again, [])
        local, glob = self._matches()
        m = max(local.length, glob.length)
        if m == 0:
            return SuffixPlan([], [], [])
        factor = self.opts.local_factor if local.length == m else self.opts.factor
        size = k if factor == 0 else min(k, max(1, math.floor(factor * m)))
        if glob.length < m:
            # the session's own text only: a chain, as ngram's default. Its other occurrences
            # are rarely right, and each alternative holds back room the chain needed (the
            # tree merge's reserve; the ngram tree lost the same way: docs/engine.md)
            return self._local_chain(local, size)
        conts: list[tuple[int, ...]] = []
        weights: list[float] = []
        if local.length == m:
            conts += [tuple(self.local.tokens[p : p + size]) for p in local.positions]
            weights += local.weights
        gconts = []
        if glob.length == m:
            gconts = index.continuations(glob.positions, size)
            conts += gconts
            weights += glob.weights
        tree = plan_tree(conts, weights, size, width, self.opts.min_prob)
        if gconts and tree.chain:
            led = [p for p, c in zip(glob.positions, gconts, strict=True)
                   if c[:1] == (tree.chain[0],)]
            index.touch(led[:TOUCH_PER_DRAFT])
        return tree

    def _local_chain(self, local: Match, size: int) -> SuffixPlan:
        """A chain from the session's own text: the continuation of the most recent occurrence
        of the longest match, `size` tokens, as ngram drafts. Within one generation the latest
        occurrence predicts best (the previous list item, table row or line of a loop); taking
        the most frequent continuation instead, and cutting where occurrences disagree, drafted
        a prompt's heading after an answer's line break. Where that continuation runs into the
        tip and the tail has repeated with its period at least twice (match length >= distance:
        a loop, a run of like items), it goes on with the period, as an LZ77 copy overlapping
        its source does. `conf`: depth by depth, the share of the occurrences still agreeing
        with the chain among those whose text goes on that far."""
        toks = self.local.tokens
        first = local.positions[0]  # most recent first
        chain = copy_on(toks, first, size, local.length)
        conts = [chain] + [toks[p : p + size] for p in local.positions[1:]]
        weights = local.weights
        agree = list(range(len(conts)))
        conf: list[float] = []
        for depth, tok in enumerate(chain):
            on = [i for i in agree if len(conts[i]) > depth]
            agree = [i for i in on if conts[i][depth] == tok]
            mass = sum(weights[i] for i in on)
            conf.append(sum(weights[i] for i in agree) / mass)
        return SuffixPlan(list(chain), conf, [])

    def draft(self, k: int) -> tuple[np.ndarray, None]:
        tree = self.plan(k, 1)
        if not tree.chain:
            return EMPTY_DRAFT, None
        return np.asarray(tree.chain, dtype=np.int32), None

    def draft_ahead(self, k: int, width: int = 1) -> DraftTree:
        tree = self.plan(k, width)
        return DraftTree.branched(tree.chain, tree.conf, tree.branches)

    def propose(self, budget: int, width: int) -> DraftTree:
        """The chain and each alternative, with their empirical probabilities."""
        return self.draft_ahead(budget, width)

    def close(self) -> None:
        """Give the finished text to the global index (once)."""
        if self.closed:
            return
        self.closed = True
        if self.foreign:
            return
        if self.drafter.index.add(self.local.tokens, self.prompt_len, self.opts.prompts,
                                  self.prompt_hash):
            log.debug("suffix index: +%d output tokens, %s", len(self.local.tokens)
                      - self.prompt_len, self.drafter.index.stats())


class SuffixDrafter(Drafter):
    """Model-free and tokenizer-agnostic (ids only); one global index per drafter object."""

    name = "suffix"
    fingerprint = None
    ahead_chunk = 0  # cheap: a proposer drafts up to its horizon in one go

    def __init__(self, opts: SuffixOptions | None = None) -> None:
        self.opts = opts or SuffixOptions()
        self.opts.validate()
        self.tree_width = self.opts.width
        self.index = GlobalIndex(int(self.opts.budget_mb * 2**20))

    @classmethod
    def from_spec(cls, spec: str) -> SuffixDrafter:
        return cls(parse_spec(spec))

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> SuffixState:
        return SuffixState(self, [int(t) for t in prompt_ids])

    def open_source(self, prompt_ids: Sequence[int],
                    params: SamplingParams) -> DraftStateSource:
        return DraftStateSource(self.open(prompt_ids, params), len(prompt_ids), name="suffix",
                                width=self.opts.width)
