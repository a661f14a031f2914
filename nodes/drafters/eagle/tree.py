"""EAGLE-2-style draft trees from an EAGLE-3 head, one head forward per tree level.

Each node just added offers its `width` likeliest children, scored by cumulative draft
log-probability; the best-scoring offers anywhere in the tree become the next level (a level
takes a further node only if it is at least `BRANCH_RATIO` as likely as its best, so where the
head is sure the budget buys depth). A level's nodes are fed together as new entries of the
head's cache, each seeing the committed entries, its own ancestors and itself; the caller
crops the draft entries away afterwards.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from nodes.drafters.eagle.cache import HeadCache
from nodes.drafters.eagle.head import Eagle3Head
from nodes.drafters.model import BRANCH_RATIO
from nodes.engine.tree import DraftTree


def draft_tree(head: Eagle3Head, cache: HeadCache, last: torch.Tensor, pending: int,
               budget: int, width: int, position: int | None = None) -> DraftTree:
    """Up to `budget` nodes below the pending token (verifier ids, with the head's
    probability of each token), the likeliest leaf's path as the chain.

    `last` is the head's pre-norm output at its last committed entry (it predicts the
    pending token's children); the cache holds exactly the committed entries, the last at
    position `position - 1` (default: one entry per position, `cache.length`)."""
    base = cache.length
    position = base if position is None else position
    target = head.target_ids()
    toks, parents, score, conf = [pending], [-1], [0.0], [1.0]
    slot = [-1]  # cache entry of each node (-1: the root, the last committed entry)
    hidden = {0: last}  # each fed node's pre-norm output: its children's feature
    frontier = [0]
    logits = head.logits(last[None])
    heap: list[tuple[float, int, int, float]] = []  # (-cum log prob, parent, draft id, prob)
    while len(toks) - 1 < budget:
        logp = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logp, min(width, logp.shape[-1]), dim=-1)
        for row, node in enumerate(frontier):
            for lp, d in zip(top.values[row].tolist(), top.indices[row].tolist(), strict=True):
                heapq.heappush(heap, (-(score[node] + lp), node, d, float(np.exp(lp))))
        added: list[int] = []
        floor = -heap[0][0] + np.log(BRANCH_RATIO) if heap else 0.0
        while heap and len(added) < width and len(toks) - 1 < budget:
            if added and -heap[0][0] < floor:
                break  # the head is sure here: spend the budget on depth, not breadth
            neg, parent, d, p = heapq.heappop(heap)
            toks.append(int(target[d]))
            parents.append(parent)
            score.append(-neg)
            conf.append(p)
            slot.append(-1)
            added.append(len(toks) - 1)
        if not added or len(toks) - 1 >= budget:
            break
        frontier = added
        logits = _feed_level(head, cache, base, position, frontier, toks, parents, slot,
                             hidden)
    return DraftTree.from_parents(toks, parents, score, conf)


def _feed_level(head: Eagle3Head, cache: HeadCache, base: int, position: int,
                level: list[int], toks: list[int], parents: list[int], slot: list[int],
                hidden: dict[int, torch.Tensor]) -> torch.Tensor:
    """Feed one level's nodes (each after its parent's output) and return their logits."""
    held = cache.length
    n = len(level)
    visible = torch.zeros((n, held + n), dtype=torch.bool, device=cache.k.device)
    visible[:, :base] = True
    depth = []
    for row, node in enumerate(level):
        d, p = 1, parents[node]
        while p > 0:
            visible[row, slot[p]] = True
            d, p = d + 1, parents[p]
        visible[row, held + row] = True
        depth.append(d)
    tokens = torch.tensor([toks[i] for i in level], dtype=torch.long, device=cache.k.device)
    feats = torch.stack([hidden[parents[i]] for i in level])
    positions = torch.tensor([position - 1 + d for d in depth], device=cache.k.device)
    out = head.step(cache, tokens, feats, positions, visible)
    for row, node in enumerate(level):
        slot[node] = held + row
        hidden[node] = out[row]
    return head.logits(out)
