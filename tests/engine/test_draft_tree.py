"""One draft tree (issue 44, item 2): `DraftTree` from the drafter through the wire to the
engine's merge. The merge must place a tree exactly as the path lists it replaced were placed
(the reference below is the old path-based placement), and the proposer's bookkeeping (join,
advance, bound, the wire's fields) must keep what each piece means."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codec.structs import DraftChunk
from nodes.engine.tree import ALT_RESERVE, EMPTY_TREE, DraftTree, TokenTree


# -- the placement the path lists had (before the one draft tree), as the reference ------------
def _reference(candidates, budget, max_depth):
    """(tokens, parents, owners, conf, offered) of the old `TokenTree.add` over
    `candidates` = [(source, tokens, conf or None)]: each source's first path (cut to its
    room), then every other path depth by depth."""
    tokens, parents, owners, conf, kids = [1], [-1], [set()], [None], [{}]
    offered = {}

    def place(cands):
        cur = [0] * len(cands)
        alive = [True] * len(cands)
        for d in range(max_depth):
            for ci, (src, toks, cf) in enumerate(cands):
                if not alive[ci] or d >= len(toks):
                    continue
                child = kids[cur[ci]].get(int(toks[d]))
                if child is None:
                    if len(tokens) - 1 >= budget:
                        alive[ci] = False
                        continue
                    child = len(tokens)
                    tokens.append(int(toks[d]))
                    parents.append(cur[ci])
                    owners.append(set())
                    conf.append(None)
                    kids.append({})
                    kids[cur[ci]][int(toks[d])] = child
                owners[child].add(src)
                if cf is not None:
                    conf[child] = cf[d] if conf[child] is None else max(conf[child], cf[d])
                offered[src] = offered.get(src, 0) + 1
                cur[ci] = child

    firsts, seen = [], set()
    for ci, (src, _, _) in enumerate(candidates):
        if src not in seen:
            seen.add(src)
            firsts.append(ci)
    for ci in firsts:
        src, toks, cf = candidates[ci]
        alts = sum(1 for s, _, _ in candidates if s == src) - 1
        left = budget - (len(tokens) - 1)
        room = max(left - ALT_RESERVE * alts, (left + 1) // 2)
        place([(src, toks[:room], None if cf is None else cf[:room])])
    place([candidates[ci] for ci in range(len(candidates)) if ci not in firsts])
    return tokens, parents, owners, conf, offered


@st.composite
def _source(draw):
    """A drafter's chain and its alternatives `(at, tokens, conf)`, each a true alternative
    (its first token differs from the chain's there) and no two sharing a first node."""
    chain = draw(st.lists(st.integers(0, 4), min_size=1, max_size=6))
    with_conf = draw(st.booleans())
    conf = [draw(st.sampled_from([0.1, 0.5, 0.9])) for _ in chain] if with_conf else None
    alts, used = [], set()
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(chain)))
        toks = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
        if (at < len(chain) and toks[0] == chain[at]) or (at, toks[0]) in used:
            continue
        used.add((at, toks[0]))
        alts.append((at, toks, [0.3] * len(toks) if with_conf else None))
    return chain, conf, alts


@settings(max_examples=300, deadline=None)
@given(st.lists(_source(), min_size=1, max_size=3), st.integers(0, 14), st.integers(1, 8))
def test_merging_trees_places_what_the_path_lists_placed(sources, budget, max_depth):
    drafts, candidates = [], []
    for src, (chain, conf, alts) in enumerate(sources):
        drafts.append((src, DraftTree.branched(chain, conf, alts)))
        candidates.append((src, chain, conf))
        for at, toks, cf in alts:
            candidates.append((src, [*chain[:at], *toks],
                               None if conf is None else [*conf[:at], *cf]))
    tree = TokenTree(1)
    offered = tree.merge(drafts, budget, max_depth)
    tokens, parents, owners, conf, want_offered = _reference(candidates, budget, max_depth)
    assert tree.tokens == tokens and tree.parents == parents
    assert tree.owners == owners
    assert [None if c is None else pytest.approx(c) for c in tree.conf] == conf
    assert offered == want_offered


def test_paths_merge_where_they_share_a_prefix_and_the_first_is_the_chain():
    t = DraftTree.from_paths([([5, 6, 7], [0.5, 0.6, 0.7]), ([5, 8], [0.5, 0.2]),
                              ([9], [0.1]), ([5, 6], [0.9, 0.9])])
    assert t.tokens.tolist() == [5, 6, 7, 8, 9] and t.chain == 3
    assert t.parents.tolist() == [-1, 0, 1, 0, -1]
    assert t.conf.tolist() == [0.9, 0.9, 0.7, 0.2, 0.1]  # a shared node keeps the highest
    assert [p for p in t.paths()] == [[0, 1, 2], [0, 3], [4]]
    # a path without confidences: the tree has none (all or nothing)
    assert DraftTree.from_paths([([5], [0.5]), ([6], None)]).conf is None
    assert DraftTree.of_chain([1, 2], [0.5, float("nan")]).conf is None
    assert not len(DraftTree.from_paths([])) and not len(DraftTree.branched([], None, [(0, [1],
                                                                                         None)]))


def test_a_drafted_tree_is_laid_out_best_leaf_first():
    # node 0 the pending token; leaves 3 (score -2), 4 (-1), 2 (-3)
    t = DraftTree.from_parents([0, 10, 11, 12, 13], [-1, 0, 0, 1, 1], [0, -0.5, -3, -2, -1],
                               [1, 0.6, 0.1, 0.3, 0.5])
    assert [t.tokens[p].tolist() for p in t.paths()] == [[10, 13], [10, 12], [11]]
    assert t.conf.tolist() == [0.6, 0.5, 0.3, 0.1]


def test_after_keeps_the_paths_that_continue_what_was_committed():
    t = DraftTree.branched([5, 6, 7], None, [(0, [8], None), (1, [9, 10], None)])
    rest, alive = t.after([5], 8)
    assert alive and [x.tolist() for x, _ in rest.path_tokens()] == [[6, 7], [9, 10]]
    rest, alive = t.after([8], 8)  # the runner-up was committed: nothing past it, still live
    assert alive and not len(rest)
    rest, alive = t.after([5, 9], 1)
    assert alive and rest.chain_tokens.tolist() == [10] and rest.chain == 1
    rest, alive = t.after([4], 8)  # nothing continues that: stale
    assert not alive and not len(rest)
    assert t.after([], 2)[0].tokens.tolist() == [5, 6, 8, 9]  # cut to 2 deep


def test_join_advance_and_bound_keep_each_alternative_where_it_hangs():
    a = DraftTree.branched([1, 2], [0.5, 0.5], [(1, [7], [0.2])])  # 7 instead of 2
    b = DraftTree.branched([3, 4], [0.6, 0.6], [(0, [8, 9], [0.3, 0.3])])  # 8 9 instead of 3
    b = DraftTree(b.tokens, b.parents, b.chain, b.conf, ("m1", "m2"))
    joined = a.then(b)
    assert joined.chain_tokens.tolist() == [1, 2, 3, 4]
    assert joined.classes == ("", "", "m1", "m2")
    assert [joined.tokens[p].tolist() for p in joined.paths()] == [
        [1, 2, 3, 4], [1, 7], [1, 2, 8, 9]]
    # two chain tokens committed: the 7 (an alternative to a committed token) is moot
    on = joined.advanced(2)
    assert [on.tokens[p].tolist() for p in on.paths()] == [[3, 4], [8, 9]]
    assert on.classes == ("m1", "m2") and on.conf.tolist() == [0.6, 0.6, 0.3, 0.3]
    assert not len(on.advanced(2)) and not len(EMPTY_TREE.then(EMPTY_TREE))
    assert not len(joined.advanced(9))  # commits past everything drafted: nothing is left
    # the wire's bound on alternatives: whole branches, nearest first
    assert [joined.bounded(2).tokens[p].tolist() for p in joined.bounded(2).paths()] == [
        [1, 2, 3, 4], [1, 7]]
    assert joined.bounded(3) is joined


def test_the_proposers_tree_crosses_the_wire_as_it_is():
    from nodes.proposer.role import _chunk, _Session
    from nodes.verifier.proposer_client import _tree_of

    tree = DraftTree.branched([5, 6, 7], [0.6, 0.5, 0.9],
                              [(0, [8], [0.3]), (1, [9, 10], [0.2, 0.8]), (2, [11], [0.1])])
    tree = DraftTree(tree.tokens, tree.parents, tree.chain, tree.conf, ("m1", "m2", "m3"))
    s = _Session("s1", "v", None, None, [1, 2, 3, 4], 1.0, 0.0, None, 16, ahead=tree)
    chunk = DraftChunk.from_message(_chunk(s).to_message())
    assert chunk.alt_parents.tolist() == [-1, 0, 4, 1] and chunk.classes == ("m1", "m2", "m3")
    back = _tree_of(chunk)
    assert back.tokens.tolist() == tree.tokens.tolist()
    assert back.parents.tolist() == tree.parents.tolist() and back.chain == tree.chain
    assert np.allclose(back.conf, tree.conf, atol=1e-6)


def test_the_planner_drops_what_a_bad_source_sends():
    from types import SimpleNamespace

    from nodes.engine.planner import DraftPlanner

    planner = DraftPlanner.__new__(DraftPlanner)
    planner.backend, planner.max_draft = SimpleNamespace(vocab_size=50), 8
    bad = DraftTree(np.asarray([5, 99, 6, 7, 2, 3]), np.asarray([-1, 0, 1, -1, 3, 4]), 3,
                    np.asarray([0.5, 0.5, 0.5, 0.5, 0.5, 2.0]))
    clean = planner._clean(bad, budget=8, eos=frozenset({7}))
    # 99 is out of the vocabulary (and the 6 under it goes too); nothing under the EOS 7
    assert clean.tokens.tolist() == [5, 7] and clean.parents.tolist() == [-1, -1]
    assert clean.chain == 1 and clean.conf is None  # 2.0 is not a probability
    assert planner._clean([1, 2], 8, frozenset()) is EMPTY_TREE  # not a tree at all
    cyclic = DraftTree(np.asarray([5, 6]), np.asarray([1, 0]), 0)
    assert not len(planner._clean(cyclic, 8, frozenset()))
    assert planner._clean(DraftTree.of_chain([1, 2, 3, 4]), 2, frozenset()).tokens.tolist() == [
        1, 2]
