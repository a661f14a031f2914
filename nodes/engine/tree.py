"""A prefix tree of draft tokens, verified in one forward.

Node 0 is the *pending* token (committed, its logits not computed yet); every other node is a
draft token whose parent is the token before it. Every source's `DraftTree` is merged into
one tree: identical prefixes share nodes, so a token is fed once however many sources propose
it. Acceptance walks the tree from the root following the verifier's own token at each node
(its argmax, or its seeded Gumbel-max draw: `sampling.accept_tree_keyed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: nodes a source's chain leaves free for each of its alternative leaves
ALT_RESERVE = 2


def _conf_array(conf, n: int) -> np.ndarray | None:
    """A draft's confidences as `DraftTree.conf` holds them: float64 [n] probabilities, or
    None when any is missing or not a probability (all or nothing: a node without one would
    otherwise rank as if its drafter had said nothing about its siblings)."""
    if conf is None:
        return None
    arr = np.asarray(conf, dtype=np.float64).reshape(-1)
    if len(arr) != n or not np.all((arr >= 0) & (arr <= 1)):  # NaN fails the range check too
        return None
    return arr


@dataclass(frozen=True)
class DraftTree:
    """One source's draft, the one shape it keeps from the drafter through the wire
    (`draft_chunk` carries these fields as they are) to the engine's merge (`TokenTree.merge`).

    Node i is token `tokens[i]` after node `parents[i]` (-1: right after the committed tip;
    else an earlier node, so the nodes are in topological order). The first `chain` nodes are
    the source's own pick, each after the one before (its chain); the nodes after them are
    alternatives (a model's runners-up, an index's other continuations), in the order the
    source ranks them. `conf` (float64 [n] or None) is the drafter's probability of each token
    given its parent: it only ranks alternatives (`TokenTree.node_values`), never enters
    acceptance. `classes` (one label per chain node, "" for none; or empty) says what kind of
    draft each chain token came from (`DraftSource.draft_class`)."""

    tokens: np.ndarray
    parents: np.ndarray
    chain: int
    conf: np.ndarray | None = None
    classes: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.tokens)

    # ---- building -----------------------------------------------------------------------------
    @classmethod
    def of_chain(cls, tokens: Sequence[int], conf: Sequence[float] | None = None,
                 classes: Sequence[str] = ()) -> DraftTree:
        """A chain: each token after the one before."""
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        return cls(toks, np.arange(-1, len(toks) - 1, dtype=np.int64), len(toks),
                   _conf_array(conf, len(toks)), tuple(classes))

    @classmethod
    def branched(cls, chain: Sequence[int], conf: Sequence[float] | None = None,
                 alternatives: Sequence[tuple[int, Sequence[int], Sequence[float] | None]] = (),
                 ) -> DraftTree:
        """A chain and alternatives `(at, tokens, conf)`: the first token of each an
        alternative to chain token `at` (after the chain's first `at`), the rest after it.
        An alternative past the chain's end, or empty, is left out; none without a chain."""
        head = [int(t) for t in np.asarray(chain).reshape(-1)]
        if not head:
            return EMPTY_TREE
        head_conf = None if conf is None else [float(c) for c in np.asarray(conf).reshape(-1)]
        paths: list[tuple[list[int], list[float] | None]] = [(head, head_conf)]
        for at, toks, alt_conf in alternatives:
            if not len(toks) or at > len(head):
                continue
            paths.append(([*head[:at], *(int(t) for t in toks)],
                          None if head_conf is None or alt_conf is None
                          else [*head_conf[:at], *(float(c) for c in alt_conf)]))
        return cls.from_paths(paths)

    @classmethod
    def from_paths(cls, paths: Sequence[tuple[Sequence[int], Sequence[float] | None]]
                   ) -> DraftTree:
        """Root-to-leaf paths `(tokens, conf)` merged where they share a prefix: the first
        path is the chain, each later one adds the nodes it does not share, in order. A
        shared node keeps the highest confidence given it; conf is None if any path has none."""
        tokens: list[int] = []
        parents: list[int] = []
        conf: list[float] = []
        children: dict[tuple[int, int], int] = {}
        has_conf = bool(paths)
        chain = 0
        for n, (toks, path_conf) in enumerate(paths):
            if path_conf is None or len(path_conf) < len(toks):
                has_conf = False
            at = -1
            for d, tok in enumerate(toks):
                tok = int(tok)
                c = float(path_conf[d]) if has_conf and path_conf is not None else 0.0
                node = children.get((at, tok))
                if node is None:
                    node = children[(at, tok)] = len(tokens)
                    tokens.append(tok)
                    parents.append(at)
                    conf.append(c)
                elif has_conf:
                    conf[node] = max(conf[node], c)
                at = node
            if n == 0:
                chain = len(tokens)
        return cls(np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64),
                   chain, _conf_array(conf, len(tokens)) if has_conf else None)

    @classmethod
    def from_parents(cls, tokens: Sequence[int], parents: Sequence[int],
                     score: Sequence[float], conf: Sequence[float] | None = None) -> DraftTree:
        """A drafted tree as a drafter builds it (node 0 the pending token, not a draft; the
        others after their parents), laid out with the best-scoring leaf's path as the chain
        and the other leaves' paths after it, best first."""
        inner = set(parents[1:])
        leaves = sorted((i for i in range(1, len(tokens)) if i not in inner),
                        key=lambda i: -score[i])
        paths = []
        for leaf in leaves:
            path = []
            while leaf > 0:
                path.append(leaf)
                leaf = parents[leaf]
            path.reverse()
            paths.append(([tokens[i] for i in path],
                          None if conf is None else [conf[i] for i in path]))
        return cls.from_paths(paths)

    # ---- reading ------------------------------------------------------------------------------
    @property
    def chain_tokens(self) -> np.ndarray:
        """The source's own pick: the chain's tokens."""
        return self.tokens[: self.chain]

    def depths(self) -> np.ndarray:
        """Each node's depth below the tip (1 for a child of the tip)."""
        out = np.zeros(len(self.tokens), dtype=np.int64)
        for i, p in enumerate(self.parents.tolist()):
            out[i] = 1 if p < 0 else out[p] + 1
        return out

    def paths(self) -> list[list[int]]:
        """Node indices of the chain, then of each alternative leaf's path from the tip (the
        alternatives in order): how `TokenTree.merge` places the tree within a budget."""
        parents = self.parents.tolist()
        inner = set(parents)
        out = [list(range(self.chain))]
        for leaf in range(self.chain, len(parents)):
            if leaf in inner:
                continue
            path = []
            node = leaf
            while node >= 0:
                path.append(node)
                node = parents[node]
            out.append(path[::-1])
        return out

    def path_tokens(self) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """`paths` as (tokens, conf) of each, the chain first (even when empty)."""
        return [(self.tokens[p], None if self.conf is None else self.conf[p])
                for p in self.paths()]

    # ---- changing -------------------------------------------------------------------------------
    def keep(self, mask: np.ndarray) -> DraftTree:
        """The nodes where `mask` holds whose every ancestor is kept, in the same layout."""
        parents = self.parents.tolist()
        kept = np.zeros(len(parents), dtype=bool)
        for i, p in enumerate(parents):
            kept[i] = bool(mask[i]) and (p < 0 or kept[p])
        if kept.all():
            return self
        new = np.cumsum(kept) - 1
        idx = np.nonzero(kept)[0]
        par = np.asarray([-1 if parents[i] < 0 else int(new[parents[i]]) for i in idx],
                         dtype=np.int64)
        chain = int(kept[: self.chain].sum())
        return DraftTree(self.tokens[idx], par, chain,
                         None if self.conf is None else self.conf[idx],
                         self.classes[:chain] if self.classes else ())

    def cut(self, depth: int) -> DraftTree:
        """Only the nodes at most `depth` below the tip."""
        return self.keep(self.depths() <= depth)

    def after(self, done: Sequence[int], budget: int) -> tuple[DraftTree, bool]:
        """What the tree offers past `done` (tokens committed after its tip), at most `budget`
        deep: its paths that continue `done` cut to what follows it, the first of them the
        chain; and whether any path agrees with `done` at all (False: the draft is stale)."""
        known = len(done)
        want = np.asarray(done, dtype=np.int64)
        out, alive = [], False
        for toks, conf in self.path_tokens():
            if len(toks) < known or not np.array_equal(toks[:known], want):
                continue
            alive = True
            if len(toks) > known and budget > 0:
                out.append((toks[known : known + budget],
                            None if conf is None else conf[known : known + budget]))
        return DraftTree.from_paths(out), alive

    def then(self, more: DraftTree) -> DraftTree:
        """This tree with `more` drafted after its chain's last token: the chains joined, this
        tree's alternatives, then `more`'s (their nodes renumbered)."""
        if not len(more):
            return self
        if not len(self):
            return more
        a, b = self.chain, more.chain
        alt_a = len(self) - a

        def own(i: int) -> int:  # a node of this tree in the joined layout
            return i if i < a else i + b

        def new(i: int) -> int:  # a node of `more` in the joined layout
            if i < 0:
                return a - 1
            return a + i if i < b else a + b + alt_a + (i - b)

        tokens = np.concatenate([self.tokens[:a], more.tokens[:b], self.tokens[a:],
                                 more.tokens[b:]])
        parents = np.asarray([*range(-1, a + b - 1),
                              *(-1 if p < 0 else own(p) for p in self.parents[a:].tolist()),
                              *(new(p) for p in more.parents[b:].tolist())], dtype=np.int64)
        conf = (None if self.conf is None or more.conf is None else np.concatenate(
            [self.conf[:a], more.conf[:b], self.conf[a:], more.conf[b:]]))
        classes = ((tuple(self.classes or ("",) * a) + tuple(more.classes or ("",) * b))
                   if self.classes or more.classes else ())
        return DraftTree(tokens, parents, a + b, conf, classes)

    def advanced(self, n: int) -> DraftTree:
        """This tree once its first `n` chain tokens are committed: the rest of the chain,
        and the alternatives that branch off at or after the new tip (an alternative to a
        token now committed is moot)."""
        if n <= 0:
            return self
        if n > self.chain or n >= len(self):  # past the chain: nothing drafted is left
            return EMPTY_TREE
        parents = self.parents.tolist()
        branch = {}  # each alternative node's branch point on the chain (-1: the tip)
        mask = np.zeros(len(parents), dtype=bool)
        mask[n : self.chain] = True
        for i in range(self.chain, len(parents)):
            p = parents[i]
            branch[i] = branch[p] if p >= self.chain else p
            mask[i] = branch[i] >= n - 1
        idx = np.nonzero(mask)[0]
        new = {int(i): j for j, i in enumerate(idx)}
        par = np.asarray([-1 if parents[i] == n - 1 or parents[i] < 0 else new[parents[i]]
                          for i in idx], dtype=np.int64)
        return DraftTree(self.tokens[idx], par, self.chain - n,
                         None if self.conf is None else self.conf[idx],
                         self.classes[n:] if self.classes else ())

    def bounded(self, most: int) -> DraftTree:
        """At most `most` alternative nodes: whole branches (an alternative off the chain
        and what hangs under it), nearest the tip first, each only if it still fits."""
        parents = self.parents.tolist()
        if len(parents) - self.chain <= most:
            return self
        root: dict[int, int] = {}
        size: dict[int, int] = {}
        for i in range(self.chain, len(parents)):
            p = parents[i]
            root[i] = root[p] if p >= self.chain else i
            size[root[i]] = size.get(root[i], 0) + 1
        taken, room = set(), most
        for r in sorted(size, key=lambda r: parents[r]):  # stable: wire order among equals
            if size[r] <= room:
                taken.add(r)
                room -= size[r]
        mask = np.ones(len(parents), dtype=bool)
        for i in range(self.chain, len(parents)):
            mask[i] = root[i] in taken
        return self.keep(mask)


EMPTY_TREE = DraftTree(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 0)


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

    def merge(
        self,
        drafts: Sequence[tuple[int, DraftTree]],
        budget: int,
        max_depth: int,
    ) -> dict[int, int]:
        """Merge (source index, draft) pairs; return draft tokens placed per source.

        Each source's chain goes in first, in source order, leaving ALT_RESERVE nodes per
        alternative leaf of that source (but taking at least half of what is left); then
        every source's alternatives depth by depth, so the rest of the budget covers the first
        tokens of every alternative before deep tails. A token already in the tree costs
        nothing.
        """
        offered: dict[int, int] = {}
        rest = []
        for src, draft in drafts:
            if not len(draft):
                continue
            chain, *alternatives = draft.paths()
            left = budget - self.drafted
            room = max(left - ALT_RESERVE * len(alternatives), (left + 1) // 2)
            self._place([(src, draft, chain[:room])], budget, max_depth, offered)
            rest += [(src, draft, path) for path in alternatives]
        self._place(rest, budget, max_depth, offered)
        return offered

    def _place(self, paths, budget, max_depth, offered) -> None:
        """Add (source, draft, node path) depth by depth (path order breaks ties) within the
        budget."""
        # each path's tokens and confidences as Python numbers, read once (indexing the
        # drafts' arrays node by node was most of a step's planning)
        walks = []
        for src, draft, path in paths:
            nodes = list(path[:max_depth])
            toks = [int(t) for t in np.asarray(draft.tokens)[nodes].tolist()]
            confs = (None if draft.conf is None
                     else [float(c) for c in np.asarray(draft.conf)[nodes].tolist()])
            walks.append((src, toks, confs))
        cur = [0] * len(paths)
        alive = [True] * len(paths)
        for d in range(max((len(w[1]) for w in walks), default=0)):
            for pi, (src, toks, confs) in enumerate(walks):
                if not alive[pi] or d >= len(toks):
                    continue
                tok, parent = toks[d], cur[pi]
                child = self.children[parent].get(tok)
                if child is None:
                    if self.drafted >= budget:
                        alive[pi] = False
                        continue
                    child = self._new(tok, parent)
                self.owners[child].add(src)
                if confs is not None:
                    c, old = confs[d], self.conf[child]
                    self.conf[child] = c if old is None else max(old, c)
                offered[src] = offered.get(src, 0) + 1
                cur[pi] = child

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
