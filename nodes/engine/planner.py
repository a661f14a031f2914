"""The draft planner: which draft tokens each sequence's next forward verifies, and learning
from what it proved. `plan(seq, sharing) -> TokenTree`, `observe(seq, verified)`.

Why one owner: every decision about drafts is a cost-model decision (a source's budget, whether
to wait for its drafts, which nodes of the merged tree pay for their row, what a batch trims),
and every observation feeds the same model (draft, verify and batched-forward costs, each
source's acceptance). Kept together here, the engine's step only asks for a tree and reports
what the forward proved; the cost model itself (`nodes/engine/cost.py`) stays I/O-free arithmetic
on numbers, and this module is its only caller in a step.

A source that raises is dropped for the rest of the generation (`state.drop_source`): the
output is the same without it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from nodes.engine.cost import CostModel, class_key
from nodes.engine.grammar import prune_tree
from nodes.engine.state import SequenceState, Slot, drop_source
from nodes.engine.tree import EMPTY_TREE as EMPTY
from nodes.engine.tree import DraftTree, TokenTree

if TYPE_CHECKING:
    from nodes.backends.base import Backend

log = logging.getLogger(__name__)

#: the sources' drafts this step: (a source's tag, its draft), one per source that has one
Found = list[tuple[int, DraftTree]]


def _deepest(draft: DraftTree | None) -> int:
    """How many tokens deep a draft goes (0: none)."""
    return int(draft.depths().max()) if draft is not None and len(draft) else 0


@dataclass
class Verified:
    """What one forward proved about a sequence's planned tree: the accepted `path` (tree
    indices), and the forward's time, a verify-cost sample only when the tree had it `alone`
    (a batch's time is not one tree's cost)."""

    tree: TokenTree
    path: list[int]
    seconds: float
    alone: bool


class DraftPlanner:
    """Plans each step's draft tree from the sequence's sources within what the cost model
    says pays (module docstring). `fixed_k` pins the draft node budget (tests; no learning);
    `tree=False` verifies only the best source's chain."""

    def __init__(self, backend: Backend, *, max_draft: int, fixed_k: int | None,
                 tree: bool) -> None:
        self.backend = backend
        self.max_draft = max_draft
        self.fixed_k = fixed_k
        self.tree = tree
        #: the engine's record: verify, draft and batch costs and each source's long-run
        #: acceptance, shared by every sequence's fork (`estimates`)
        self.cost = CostModel(max_k=max_draft)
        # a backend whose verify curve is far from the prior's (the quantized forward: each
        # further row costs ~a third of a step, not 3 %) measures it once at load; seeded, the
        # first generations already draft what pays
        for fed, seconds in getattr(backend, "verify_costs", dict)().items():
            self.cost.record_verify(fed, seconds)

    @property
    def adaptive(self) -> bool:
        """Whether the cost model picks the budgets (and learns): no `fixed_k`."""
        return self.fixed_k is None

    def estimates(self) -> CostModel:
        """A new sequence's cost model: fresh acceptance, the engine's learnt costs."""
        return self.cost.fork()

    # ---- planning ---------------------------------------------------------------------------
    def plan(self, seq: SequenceState, sharing: int = 1, *,
             local_only: bool = False) -> TokenTree:
        """Ask every source for its draft tree, each within the budget its own record earns (and,
        `sharing` sequences in the step, that the batch's rate leaves it), merge them into one
        tree (the likeliest source first) and keep the nodes worth a forward. The tree's root
        is the pending token (before the first token: the prompt's last, `Engine`'s first
        block). `local_only`: in-process sources only (a remote one is not asked, nor waited
        for)."""
        remaining = seq.params.max_tokens - len(seq.generated)
        cap = max(0, min(self.max_draft, remaining - 1))
        committed = seq.committed
        found: Found = []
        probes: set[int] = set()
        for i, slot in enumerate(list(seq.slots)):
            if local_only and slot.source.streams:
                slot.asked, slot.offered, slot.tag, slot.budget = False, 0, i, 0
                continue
            found += self._ask(seq, slot, i, committed, cap, sharing, probes)
        if self.adaptive:
            found = self._more_drafts(seq, committed, cap, found)
        if found and not self.tree:  # single-path verification: the best source's chain
            tag, draft = found[0]
            found = [(tag, draft.keep(np.arange(len(draft)) < draft.chain))]
        tree = TokenTree(committed[-1])
        tree.merge(found, cap if self.adaptive else min(cap, self.fixed_k),
                 max_depth=max(remaining - 1, 0))
        for slot in seq.slots:
            slot.refused_at = None
        if seq.grammar is not None:  # drafts the grammar forbids never cost a row
            before = {s.tag: tree.depth_of(s.tag) for s in seq.slots}
            tree = prune_tree(tree, seq.grammar)
            for slot in seq.slots:  # a source's deepest draft cut: wrong there (`observe`)
                after = tree.depth_of(slot.tag)
                if after < before[slot.tag]:
                    slot.refused_at = after
        tree = self._prune(seq, tree, probes)
        self._note_offers(seq, tree, found)
        return tree

    def _ask(self, seq: SequenceState, slot: Slot, tag: int, committed: list[int], cap: int,
             sharing: int, probes: set[int]) -> Found:
        """One source's draft for this step, within its budget (`slot.budget`), cleaned;
        `tag` joins `probes` when the cost model is probing the source."""
        adaptive = self.adaptive
        slot.asked, slot.offered, slot.tag, slot.budget = False, 0, tag, 0
        try:
            label = slot.source.draft_class(committed) if adaptive else None
        except Exception as exc:  # noqa: BLE001 - same policy as propose
            drop_source(seq, slot, "failed", exc)
            return []
        slot.key = class_key(slot.name, label)
        budget = seq.cost.choose_k(slot.key) if adaptive else self.fixed_k
        if adaptive and sharing > 1:
            budget = seq.cost.fit_draft_to_batch(budget, slot.name, sharing, key=slot.key)
        budget = slot.budget = max(0, min(budget, cap))
        t0 = time.perf_counter()
        try:
            draft = slot.source.propose(committed, budget)
        except Exception as exc:  # noqa: BLE001 - a broken source must not end generation
            drop_source(seq, slot, "failed", exc)
            return []
        dt = time.perf_counter() - t0
        slot.asked = True
        if budget <= 0:
            return []
        draft = self._clean(draft, budget, seq.eos)
        seq.stats.draft_s += dt
        if adaptive:
            seq.cost.record_draft(len(draft), dt, slot.name)
            if seq.cost.probing(slot.key):
                probes.add(tag)
        return [(tag, draft)] if len(draft) else []

    def _more_drafts(self, seq: SequenceState, committed: list[int], cap: int,
                     found: Found) -> Found:
        """Nothing yet: wait for announced drafts where that pays; something, but short: top
        it up where that pays. Then the source most likely to be right goes first (and wins
        ties)."""
        if not found:
            found = self._wait_for_drafts(seq, committed, cap)
        else:
            found = self._top_up(seq, committed, found)
        rank = {s.tag: seq.cost.acceptance_of(s.key) for s in seq.slots}
        found.sort(key=lambda pair: -rank[pair[0]])
        return found

    def _prune(self, seq: SequenceState, tree: TokenTree, probes: set[int]) -> TokenTree:
        """Keep the merged tree's nodes worth one forward (`CostModel.select`), and note their
        values for the batch to trim by (`fit_to_batch`). Greedy, adaptive plans only: which
        proposals survive must not depend on sampled draft tokens."""
        seq.plan_values = seq.plan_forced = None
        if not (self.adaptive and tree.drafted and seq.params.sampling.greedy):
            return tree
        values = tree.node_values({s.tag: seq.cost.chain_acceptance(s.key, tree.depth)
                                   for s in seq.slots})
        forced = [bool(probes & owners) for owners in tree.owners]
        keep = seq.cost.select(values, forced)
        # what the batch may still trim by (`fit_to_batch`), in the kept tree's order
        seq.plan_values = [values[0], *(values[i] for i in keep)]
        seq.plan_forced = [forced[0], *(forced[i] for i in keep)]
        return tree.subtree(keep)

    def _note_offers(self, seq: SequenceState, tree: TokenTree, found: Found) -> None:
        """What each source has in the tree (its feedback's `offered`); a source asked but
        absent is unheard (`CostModel.record_unheard`); the draft length's histogram."""
        for slot in seq.slots:
            slot.offered = tree.offered_by(slot.tag)
            if self.adaptive and slot.budget > 0 and not slot.offered and \
                    slot.refused_at is None:
                seq.cost.record_unheard(slot.key, streams=slot.source.streams)
        if tree.drafted or found:
            seq.stats.k_hist[tree.drafted] = seq.stats.k_hist.get(tree.drafted, 0) + 1

    # ---- batches -----------------------------------------------------------------------------
    def fit_to_batch(self, seqs: list[SequenceState], trees: list[TokenTree],
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

    # ---- waiting for drafts --------------------------------------------------------------------
    def _wait_for_drafts(self, seq: SequenceState, committed: list[int],
                         cap: int) -> Found:
        """Nothing to verify but a plain step: wait for the one source whose announced drafts
        pay for the wait (the likeliest first), bounded by twice its announcement.

        A source being probed is waited for even when the wait does not pay on its current
        estimate: a remote proposer no faster than the verifier's plain step is never ahead of
        it, so without a wait its drafts never arrive in time to be judged and its estimate
        (the prior, at first) never moves. Probes back off while they fail, and a probe's wait
        is capped at its share of the verifier's time (`CostModel.probe_wait`), so a useless
        or slow source costs at most that share. A source whose drafts are announced later
        than that cap is not waited for at all: a wait shorter than the announcement brought
        nothing (an int8 proposer beside a quantized verifier, or 50 ms away: 2-3 % of the
        verifier's time in empty waits) and it is judged on the drafts that arrive in time on
        their own."""
        ranked = sorted(seq.slots, key=lambda s: -seq.cost.acceptance_of(s.key))
        for slot in ranked:
            k = min(slot.budget, cap)
            wait = slot.source.expected_wait() if k > 0 else None
            if wait is None:
                continue
            if not seq.cost.wait_pays(slot.key, k, wait):
                if not seq.cost.probing(slot.key):
                    continue
                share = seq.cost.probe_wait(slot.key)
                if wait > share:  # not due within what a probe may spend: a shorter wait
                    continue  # brings nothing and costs all of itself
                # a probe: bounded by its share of the verifier's time, not the announcement
                wait = min(wait, max(0.0, (share - 0.001) / 2))
            return self._wait_then_propose(seq, slot, committed, k, wait) or []
        return []

    def _wait_then_propose(self, seq: SequenceState, slot: Slot, committed: list[int], k: int,
                           wait: float) -> Found | None:
        """Wait at most twice the announced `wait` for a source's drafts, then ask it for k;
        None when the source failed (it is dropped)."""
        t0 = time.perf_counter()
        try:
            came = slot.source.wait(2 * wait + 0.001)
            draft = slot.source.propose(committed, k) if came else None
        except Exception as exc:  # noqa: BLE001 - same policy as propose
            drop_source(seq, slot, "failed", exc)
            return None
        waited = time.perf_counter() - t0
        seq.stats.waited_s += waited
        seq.stats.waits += 1
        draft = self._clean(draft, k, seq.eos) if draft is not None else None
        out = [(slot.tag, draft)] if draft is not None and len(draft) else []
        deepest = _deepest(draft)
        if self.adaptive:
            seq.cost.record_delivered(slot.key, deepest, k)
        if log.isEnabledFor(logging.DEBUG):  # no formatting on the wait path unless asked
            log.debug("waited %.1f ms (announced %.1f) for %s: %s", waited * 1000,
                      wait * 1000, slot.name,
                      f"longest {deepest}" if out else "nothing")
        return out

    def _top_up(self, seq: SequenceState, committed: list[int],
                found: Found) -> Found:
        """Something to verify, but short: a source whose fresh drafts (answering the last
        commit) are due may offer its whole budget after a short wait, where what it has now
        continues an older guess and runs out a few tokens in (a proposer's drafts stop at its
        horizon past the commit it last knew). Wait, bounded by twice the announcement, when
        the cost model says the longer draft pays for the wait; the source's draft is
        then replaced by what it has after the wait."""
        longest: dict[int, int] = {}
        for tag, draft in found:
            longest[tag] = max(longest.get(tag, 0), _deepest(draft))
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

    # ---- observing ---------------------------------------------------------------------------
    def observe(self, seq: SequenceState, verified: Verified) -> None:
        """Learn from what the forward proved, before the tokens are committed: the verify
        cost (a tree alone in its forward) and each offering source's acceptance."""
        tree, path = verified.tree, verified.path
        if self.adaptive and verified.alone:
            seq.cost.record_verify(len(tree), verified.seconds)
        if log.isEnabledFor(logging.DEBUG):  # once per step: no formatting unless asked
            log.debug("step at %d: fed %d (%s), accepted %d, verify %.1f ms; %s",
                      len(seq.committed), len(tree), "chain" if tree.is_chain() else "tree",
                      len(path), verified.seconds * 1000, ", ".join(
                          f"{s.key} k={s.budget} offered {s.offered} "
                          f"a={seq.cost.acceptance_of(s.key):.2f}" for s in seq.slots))
        if not self.adaptive:
            return
        for slot in seq.slots:
            if not slot.asked:
                continue
            depth = tree.depth_of(slot.tag)
            accepted = tree.accepted_by(slot.tag, path) if depth else 0
            if slot.refused_at is not None and slot.refused_at == depth and accepted == depth:
                # its draft went on past what was verified with a token the grammar refused
                # (`plan`): a miss right there, not an unheard or a perfect offer (a remote
                # proposer drafting unconstrained would keep its record, and its waits)
                seq.cost.record_acceptance(depth + 1, accepted, slot.key)
            elif slot.offered:
                seq.cost.record_acceptance(depth, accepted, slot.key)

    def observe_forward(self, trees: list[TokenTree], seconds: float, *, together: bool,
                        prompt_rows: int) -> None:
        """A batched forward of decode rows only is a sample of the batch's cost per row fed
        (prompt rows skip the LM head: not one)."""
        if together and not prompt_rows and self.adaptive:
            self.cost.record_batch(sum(len(t) for t in trees), seconds)

    def learn_batch_curve(self, batch: int, samples: list[tuple[int, float]]) -> None:
        """Timed throwaway forwards (`Engine.learn_batch_cost`): (rows, seconds) each."""
        for rows, seconds in samples:
            self.cost.record_batch(rows, seconds)
        log.info("batch curve from %d throwaway sequences: %s", batch, ", ".join(
            f"{rows} rows {self.cost.batch_cost(rows) * 1000:.0f} ms" for rows, _ in samples))

    # ---- drafts ------------------------------------------------------------------------------
    def _clean(self, draft: DraftTree | None, budget: int, eos: frozenset[int]) -> DraftTree:
        """A hostile or buggy source must not break the verifier: drop nodes with a bad id or
        a bad parent and what hangs under them, nodes deeper than the budget it was given,
        and draft confidences that are not probabilities.

        And drop what hangs under any of the sequence's EOS ids: a token drafted past it can
        never commit (an accepted EOS ends the generation, a rejected one rejects what
        follows), so its row would be paid for nothing. Drafters that match the prompt run
        into it whenever a match continues across the chat template's end of a turn (a
        one-token match on an open-ended answer drafting the system prompt's end and the user
        turn)."""
        if not isinstance(draft, DraftTree) or not len(draft):
            return EMPTY
        n = len(draft)
        tokens = np.asarray(draft.tokens).reshape(-1)
        parents = np.asarray(draft.parents).reshape(-1)
        if len(parents) != n or tokens.dtype.kind not in "iu" or parents.dtype.kind not in "iu":
            return EMPTY
        chain = min(max(int(draft.chain), 0), n)
        chain_ok = np.arange(n) < chain
        ok = ((tokens >= 0) & (tokens < self.backend.vocab_size)
              & (parents < np.arange(n)) & (parents >= -1)
              & np.where(chain_ok, parents == np.arange(n) - 1, True))
        ends = np.isin(tokens, np.fromiter(eos, dtype=np.int64)) if eos else np.zeros(n, bool)
        ok &= ~np.where(parents >= 0, ends[np.maximum(parents, 0)], False)
        conf = draft.conf
        if conf is not None:
            conf = np.asarray(conf, dtype=np.float64).reshape(-1)
            if len(conf) != n or not np.all((conf >= 0) & (conf <= 1)):
                conf = None  # NaN fails the range check too
        classes = tuple(draft.classes) if len(draft.classes) == chain else ()
        tree = DraftTree(tokens.astype(np.int64), parents.astype(np.int64), chain, conf,
                         classes)
        tree = tree.keep(ok)
        return tree.cut(min(budget, self.max_draft))
