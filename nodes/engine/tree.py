"""A prefix tree of draft tokens, verified in one forward.

Node 0 is the *pending* token (committed, its logits not computed yet); every other node is a
draft token whose parent is the token before it. Candidates from all sources are merged into
one tree: identical prefixes share nodes, so a token is fed once however many sources propose
it. Acceptance walks the tree from the root following the verifier's own token at each node
(its argmax, or its seeded Gumbel-max draw: `sampling.accept_tree_keyed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: nodes a source's first chain leaves free for each of its alternative candidates
ALT_RESERVE = 2


@dataclass(frozen=True)
class Candidate:
    """One proposed continuation: ids int64 [n], and the distribution each was drawn from
    (float [n, vocab]) or None for deterministic proposals (point masses). `conf` (float
    [n], optional) is the drafter's own probability of each token given the ones before it;
    it only ranks alternatives (`TokenTree.node_values`), never enters acceptance."""

    tokens: np.ndarray
    probs: np.ndarray | None = None
    conf: np.ndarray | None = None


class TokenTree:
    def __init__(self, root_token: int) -> None:
        self.tokens: list[int] = [int(root_token)]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.children: list[dict[int, int]] = [{}]
        #: per node, the indices of the sources that proposed it
        self.owners: list[set[int]] = [set()]
        #: per node, the highest draft probability any proposal gave it (None: none said)
        self.conf: list[float | None] = [None]

    def __len__(self) -> int:
        """Nodes including the root: the number of tokens a verify forward feeds."""
        return len(self.tokens)

    @property
    def drafted(self) -> int:
        return len(self.tokens) - 1

    @property
    def depth(self) -> int:
        return max(self.depths)

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def add(
        self,
        candidates: Sequence[tuple[int, Candidate]],
        budget: int,
        max_depth: int,
    ) -> dict[int, int]:
        """Merge (source index, candidate) pairs; return draft tokens placed per source.

        Each source's first candidate (its best chain) goes in, in source order, leaving
        ALT_RESERVE nodes per alternative of that source (but taking at least half of what is
        left); then the other candidates (alternatives) depth by depth, so the rest of the
        budget covers the first tokens of every alternative before deep tails. A token already
        in the tree costs nothing.
        """
        offered: dict[int, int] = {}
        firsts, seen = [], set()
        for ci, (src, _) in enumerate(candidates):
            if src not in seen:
                seen.add(src)
                firsts.append(ci)
        rest = [ci for ci in range(len(candidates)) if ci not in set(firsts)]
        for ci in firsts:
            src, cand = candidates[ci]
            # hold back room for this source's alternatives: their divergent token and one more
            alts = sum(1 for s, _ in candidates if s == src) - 1
            left = budget - self.drafted
            room = max(left - ALT_RESERVE * alts, (left + 1) // 2)
            self._place([(src, Candidate(cand.tokens[:room],
                                          None if cand.probs is None else cand.probs[:room],
                                          None if cand.conf is None else cand.conf[:room]))],
                        budget, max_depth, offered)
        self._place([candidates[ci] for ci in rest], budget, max_depth, offered)
        return offered

    def _place(self, candidates, budget, max_depth, offered) -> None:
        """Add candidates depth by depth (candidate order breaks ties) within the budget."""
        cur = [0] * len(candidates)
        alive = [True] * len(candidates)
        for d in range(max_depth):
            for ci, (src, cand) in enumerate(candidates):
                if not alive[ci] or d >= len(cand.tokens):
                    continue
                tok, parent = int(cand.tokens[d]), cur[ci]
                child = self.children[parent].get(tok)
                if child is None:
                    if self.drafted >= budget:
                        alive[ci] = False
                        continue
                    child = self._new(tok, parent)
                self.owners[child].add(src)
                if cand.conf is not None:
                    c, old = float(cand.conf[d]), self.conf[child]
                    self.conf[child] = c if old is None else max(old, c)
                offered[src] = offered.get(src, 0) + 1
                cur[ci] = child

    def _new(self, tok: int, parent: int) -> int:
        node = len(self.tokens)
        self.tokens.append(tok)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.append({})
        self.owners.append(set())
        self.conf.append(None)
        self.children[parent][tok] = node
        return node

    def node_values(self, acceptance: dict[int, float | Sequence[float]]) -> list[float]:
        """Each node's chance of ending on the accepted path, from its owners' per-token
        acceptance (`acceptance[source]`: one figure, or one per depth, the first for depth 1
        and the last for any deeper: `CostModel.chain_acceptance`; the best owner counts).
        Siblings exclude each other:
        a parent's children, in the order they were proposed, share what the ones before them
        left (the second child of a parent whose first is right 90 % of the time gets at most
        10 %). A later child whose drafter said how likely it is (`conf`) gets, of what is
        left, its share of the draft probability the earlier children did not take (a
        drafter's 40 % runner-up behind its 50 % pick gets 80 % of what the pick leaves, its
        2 % one far less); the first child, the source's own pick, goes by its record."""
        values = [1.0] * len(self.tokens)
        for parent, kids in enumerate(self.children):
            left = mass = 1.0
            for i, child in enumerate(kids.values()):
                depth = self.depths[child]
                a = min(max(max((_at_depth(acceptance.get(s, 0.0), depth)
                                 for s in self.owners[child]), default=0.0), 0.0), 0.999)
                q = self.conf[child]
                if i and q is not None:  # the drafter's odds given the earlier ones failed
                    a = min(q / mass, 0.999) if mass > 1e-6 else 0.0
                if q is not None:
                    mass = max(mass - q, 0.0)
                p = a * left
                left -= p
                values[child] = values[parent] * p
        return values

    def subtree(self, keep: Sequence[int]) -> TokenTree:
        """The root and the nodes `keep` (ascending, every parent of a kept node kept),
        renumbered."""
        out = TokenTree(self.tokens[0])
        new = {0: 0}
        for node in keep:
            child = out._new(self.tokens[node], new[self.parents[node]])
            out.owners[child] = set(self.owners[node])
            out.conf[child] = self.conf[node]
            new[node] = child
        return out

    def offered_by(self, source: int) -> int:
        """Nodes `source` proposed (shared ones included)."""
        return sum(1 for owners in self.owners if source in owners)

    def depth_of(self, source: int) -> int:
        """The deepest node `source` proposed (0: none)."""
        return max((d for d, o in zip(self.depths, self.owners, strict=True) if source in o),
                   default=0)

    def accepted_by(self, source: int, path: Sequence[int]) -> int:
        """How many leading nodes of an accepted path `source` had proposed."""
        n = 0
        for node in path:
            if source not in self.owners[node]:
                break
            n += 1
        return n


def _at_depth(acceptance: float | Sequence[float], depth: int) -> float:
    """A source's acceptance at a node `depth` deep (`TokenTree.node_values`)."""
    if isinstance(acceptance, (int, float)):
        return float(acceptance)
    return float(acceptance[min(depth, len(acceptance)) - 1]) if len(acceptance) else 0.0
