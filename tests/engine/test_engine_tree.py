"""Token trees: one forward over a tree equals chain forwards along its paths; the accepted
path's K/V is compacted into exactly what a chain forward would have cached; greedy tree
decoding stays identical to Hugging Face greedy."""

from __future__ import annotations

import numpy as np
import pytest

from nodes.engine import Engine, GenerationParams
from nodes.engine.core import Stats
from nodes.engine.cost import CostModel
from nodes.engine.sources import DraftSource
from nodes.engine.tree import DraftTree, TokenTree
from tests.engine.conftest import DecoyTree, hf_greedy, stream_checked

N = 24
EOS_NONE = frozenset({49151})


@pytest.fixture(scope="module")
def reference(tiny_torch, prompt_ids):
    return hf_greedy(tiny_torch, prompt_ids, N + 12, eos_id=49151)


def random_tree(rng, root, size, vocab):
    tree = TokenTree(root)
    while tree.drafted < size:
        parent = int(rng.integers(len(tree)))
        tree._new(int(rng.integers(vocab)), parent)
    return tree


def path_to(tree, node):
    path = []
    while node > 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_logits_equal_chain_logits(tiny_torch, prompt_ids, seed):
    b = tiny_torch
    rng = np.random.default_rng(seed)
    prefix, root = prompt_ids[:-1], prompt_ids[-1]
    tree = random_tree(rng, root, 15, 1000)
    assert not tree.is_chain()
    cache = b.new_cache()
    b.forward(cache, prefix)
    tree_logits = b.forward_tree(cache, tree.tokens, tree.parents)
    assert tree_logits.shape == (len(tree), b.vocab_size)
    for leaf in range(len(tree)):
        nodes = [0, *path_to(tree, leaf)]
        chain_cache = b.new_cache()
        b.forward(chain_cache, prefix)
        chain = b.forward(chain_cache, [tree.tokens[i] for i in nodes])
        np.testing.assert_allclose(tree_logits[nodes], chain, atol=1e-4, rtol=0)
        assert (tree_logits[nodes].argmax(-1) == chain.argmax(-1)).all()


@pytest.mark.parametrize("seed", [0, 3])
def test_compaction_leaves_the_chain_cache(tiny_torch, prompt_ids, seed):
    import torch

    b = tiny_torch
    rng = np.random.default_rng(seed)
    prefix, root = prompt_ids[:-1], prompt_ids[-1]
    tree = random_tree(rng, root, 12, 1000)
    leaf = max(range(len(tree)), key=lambda i: (tree.depths[i], i))  # a deep, late node
    nodes = [0, *path_to(tree, leaf)]
    assert nodes != list(range(len(nodes)))  # really needs moving

    cache = b.new_cache()
    b.forward(cache, prefix)
    base = b.cache_length(cache)
    b.forward_tree(cache, tree.tokens, tree.parents)
    b.compact(cache, base, nodes)

    ref = b.new_cache()
    b.forward(ref, prefix)
    b.forward(ref, [tree.tokens[i] for i in nodes])
    assert b.cache_length(cache) == b.cache_length(ref) == base + len(nodes)
    for got, want in zip(cache.layers, ref.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=0)
    # and decoding goes on from it as from the chain
    nxt = [5, 6, 7]
    np.testing.assert_allclose(b.forward(cache, nxt), b.forward(ref, nxt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("k", [3, 8, 16])
def test_scripted_tree_greedy_matches_hf(tiny_torch, prompt_ids, reference, k):
    source = DecoyTree(prompt_ids + reference, tiny_torch.vocab_size, seed=k)
    engine = Engine(tiny_torch, fixed_k=k)
    params = GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE)
    out, stats = stream_checked(engine, prompt_ids, params, sources=[source])
    assert out == reference[:N]
    assert stats.tree_blocks > 0 and stats.accepted > 0


def test_tree_with_eos_inside(tiny_torch, prompt_ids, reference):
    eos = reference[5]
    expected = hf_greedy(tiny_torch, prompt_ids, N, eos_id=eos)
    source = DecoyTree(prompt_ids + reference, tiny_torch.vocab_size)
    params = GenerationParams(max_tokens=N, eos_token_ids=frozenset({eos}))
    out, _ = stream_checked(Engine(tiny_torch, fixed_k=8), prompt_ids, params, sources=[source])
    assert out == expected


def test_drafts_are_cut_after_an_eos(tiny_torch, prompt_ids, reference):
    """A drafted token past an EOS can never commit: the engine feeds the draft up to the
    EOS and no further (a prompt-matching drafter runs into the chat template's end of turn)."""
    j = next(i for i in range(2, 8) if reference[i] not in reference[:i])
    eos = reference[j]
    expected = hf_greedy(tiny_torch, prompt_ids, N, eos_id=eos)
    assert expected == reference[: j + 1]
    truth = Chain("truth", prompt_ids + reference, tiny_torch.vocab_size, right=True)
    params = GenerationParams(max_tokens=N, eos_token_ids=frozenset({eos}))
    out, stats = stream_checked(Engine(tiny_torch, fixed_k=12), prompt_ids, params, sources=[truth])
    assert out == expected
    # one verify block: of the 12 tokens the source proposed, the engine fed reference[1..j],
    # the EOS the last of them
    assert stats.drafted == j and stats.accepted == j
    assert max(truth.offered) == j


@pytest.mark.parametrize("k", [4, None])
def test_model_and_ngram_trees_match_hf(tiny_torch, tiny_draft_folder, prompt_ids, reference, k):
    from nodes.backends.torch_backend import TorchBackend
    from nodes.drafters.model import ModelDrafter
    from nodes.drafters.ngram import NgramDrafter

    params = GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE)
    other = TorchBackend.load(str(tiny_draft_folder), device="cpu")
    for drafter in (NgramDrafter(branches=4), ModelDrafter(other, tree_width=3),
                    ModelDrafter(tiny_torch, tree_width=2)):
        out, _ = stream_checked(Engine(tiny_torch, drafter, fixed_k=k), prompt_ids, params)
        assert out == reference[:N], drafter.name


def test_two_sources_merge_into_one_tree(tiny_torch, tiny_draft_folder, prompt_ids, reference):
    """ngram + a model tree + the scripted truth, deduplicated into one forward per step."""
    from nodes.backends.torch_backend import TorchBackend
    from nodes.drafters.model import ModelDrafter
    from nodes.drafters.ngram import NgramDrafter
    from nodes.engine import SamplingParams

    other = ModelDrafter(TorchBackend.load(str(tiny_draft_folder), device="cpu"), tree_width=2)
    sp = SamplingParams()
    sources = [
        DecoyTree(prompt_ids + reference, tiny_torch.vocab_size),
        NgramDrafter(branches=4).open_source(prompt_ids, sp),
        other.open_source(prompt_ids, sp),
    ]
    params = GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE)
    out, stats = stream_checked(Engine(tiny_torch, fixed_k=12), prompt_ids, params, sources=sources)
    assert out == reference[:N]
    assert stats.blocks < N // 2  # the truth is in every tree: long blocks


def test_tree_dedups_and_respects_budget():
    a = DraftTree.of_chain([5, 6, 7])
    b = DraftTree.from_paths([([5, 6, 8, 8], None), ([9], None), ([4, 4, 4], None)])
    tree = TokenTree(1)
    offered = tree.merge([(0, a), (1, b)], budget=9, max_depth=8)
    # source 0's chain whole; source 1's chain leaves 2 nodes per alternative (9 - 3 - 4 = 2
    # tokens, but at least half of the 6 left: 3), then the alternatives breadth-first
    assert tree.tokens == [1, 5, 6, 7, 8, 9, 4, 4, 4]
    assert tree.parents == [-1, 0, 1, 2, 2, 0, 0, 6, 7]
    assert offered == {0: 3, 1: 7}
    assert tree.accepted_by(0, [1, 2, 3]) == 3 and tree.accepted_by(1, [1, 2, 3]) == 2
    assert tree.accepted_by(1, [1, 2, 4]) == 3
    small = TokenTree(1)
    small.merge([(0, a), (1, DraftTree.of_chain([5, 6, 8, 8]))], budget=2, max_depth=8)
    assert small.tokens == [1, 5, 6]
    depth_cap = TokenTree(1)
    depth_cap.merge([(0, a)], budget=9, max_depth=2)
    assert depth_cap.tokens == [1, 5, 6]


def test_ngram_tree_offers_every_continuation():
    from nodes.drafters.ngram import NgramDrafter
    from nodes.engine import SamplingParams

    tokens = [1, 2, 9, 9, 4, 1, 2, 5, 5, 1, 2, 9, 3, 1, 2]
    src = NgramDrafter(branches=4).open_source(tokens, SamplingParams())
    got = [t.tolist() for t, _ in src.propose(tokens, 3).path_tokens()]
    assert got == [[9, 3, 1], [5, 5, 1], [9, 9, 4]]  # most recent first, all distinct
    # a longer matched suffix first, then shorter suffixes' continuations as alternatives
    tokens = [7, 1, 2, 5, 0, 3, 1, 2, 6, 0, 7, 1, 2]
    got = [t.tolist() for t, _ in NgramDrafter(branches=4).open_source(tokens, SamplingParams())
           .propose(tokens, 2).path_tokens()]
    assert got == [[5, 0], [6, 0]]
    assert [t.tolist() for t, _ in NgramDrafter().open_source(tokens, SamplingParams())
            .propose(tokens, 2).path_tokens()] == [[5, 0]]  # default: one chain


class Recorder(DraftSource):
    """Passes proposals through and keeps every feedback it gets."""

    def __init__(self, inner):
        self.inner, self.name, self.got = inner, "recorder", []

    def propose(self, committed, budget):
        return self.inner.propose(committed, budget)

    def feedback(self, fb):
        self.got.append(fb)


class FailsOnSecondCall(DraftSource):
    name = "flaky"

    def __init__(self):
        self.calls = 0

    def propose(self, committed, budget):
        self.calls += 1
        if self.calls == 2:
            raise ConnectionError("gone")
        return DraftTree.of_chain([3, 3])


def test_feedback_is_explicit_and_survives_a_failing_source(tiny_torch, prompt_ids, reference):
    rec = Recorder(DecoyTree(prompt_ids + reference, tiny_torch.vocab_size))
    flaky = FailsOnSecondCall()
    params = GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE)
    blocks, stats = [], Stats()
    for block in Engine(tiny_torch, fixed_k=6).stream(prompt_ids, params, stats=stats,
                                                      sources=[flaky, rec]):
        blocks.append(block)
    assert [t for b in blocks for t in b.token_ids] == reference[:N]
    assert stats.drafter_errors == 1 and flaky.calls == 2  # dropped, never asked again
    assert len(rec.got) == len(blocks)  # one feedback per step, the prefill included
    for fb, block in zip(rec.got, blocks, strict=True):
        assert list(fb.committed) == block.token_ids
        assert fb.committed_len == block.committed_len
        # the truth is among the recorder's candidates: every accepted token was its proposal
        assert fb.accepted == block.accepted
        assert fb.offered >= fb.accepted and (fb.offered > 0) == (block.drafted > 0)


class PinnedCost(CostModel):
    """The cost model with verify costs fixed (SmolLM2 on CPU) and no timing learnt, so the
    adaptive decisions under test depend only on which drafts were right."""

    def __post_init__(self):
        super().__post_init__()
        for n in range(1, 18):
            self._verify[n] = 0.056 if n == 1 else 0.090 + 0.003 * (n - 2)

    def record_verify(self, fed, seconds):
        return None

    def record_draft(self, drafted, seconds, name=""):
        return None


class Chain(DraftSource):
    """Proposes the reference's continuation, or a wrong one (every token shifted)."""

    def __init__(self, name, reference, vocab, *, right):
        self.name, self.reference, self.vocab, self.right = name, reference, vocab, right
        self.offered = []

    def propose(self, committed, budget):
        truth = self.reference[len(committed) : len(committed) + budget]
        toks = truth if self.right else [(t + 1) % self.vocab for t in truth]
        return DraftTree.of_chain(toks)

    def feedback(self, fb):
        self.offered.append(fb.offered)


def run_alone_pinned(backend, prompt_ids, reference, n, source):
    """Decode `n` tokens with `source` the only draft source, under `PinnedCost`; the output
    must be `reference`'s. Returns (engine, stats)."""
    engine = Engine(backend)
    engine.cost = PinnedCost(max_k=engine.max_draft)
    params = GenerationParams(max_tokens=n, eos_token_ids=EOS_NONE)
    out, stats = stream_checked(engine, prompt_ids, params, sources=[source])
    assert out == reference[:n]
    return engine, stats


#: tokens the probe tests decode: room for three probes (after 8, 16 and 32 plain steps)
PROBE_N = 64


@pytest.fixture(scope="module")
def probe_reference(tiny_torch, prompt_ids):
    return hf_greedy(tiny_torch, prompt_ids, PROBE_N, eos_id=49151)


def test_a_wrong_source_is_pruned_without_costing_the_right_one(tiny_torch, prompt_ids,
                                                                 reference):
    engine = Engine(tiny_torch)
    engine.cost = PinnedCost(max_k=engine.max_draft)
    full = prompt_ids + reference
    # the wrong source comes first: order must not matter, its record must
    junk = Chain("junk", full, tiny_torch.vocab_size, right=False)
    truth = Chain("truth", full, tiny_torch.vocab_size, right=True)
    params = GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE)
    out, stats = stream_checked(engine, prompt_ids, params, sources=[junk, truth])
    assert out == reference[:N]
    steps = len(truth.offered) - 1  # the prefill offers nothing
    assert sum(1 for o in junk.offered if o) <= 2  # the prior's tries, then it is left out
    assert sum(1 for o in truth.offered if o) >= steps - 1
    assert stats.blocks <= 4  # long blocks: the right chain is never cut short for the junk


class RunnerUp(Chain):
    """A model drafter as a remote proposer sends it, unsure at the first token: its pick
    (50 %) is wrong, its 40 % runner-up right, a 1 % runner-up wrong; the rest of the chain
    right (it continues the truth)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, right=True, **kw)
        self.accepted, self.truths = [], []

    def propose(self, committed, budget):
        truth = self.reference[len(committed) : len(committed) + budget]
        self.truths.append(self.reference[len(committed)] if len(committed) < len(
            self.reference) else None)
        if not truth:
            return DraftTree.of_chain([])
        conf = np.full(len(truth), 0.8)
        conf[0] = 0.5
        return DraftTree.from_paths([([(truth[0] + 1) % self.vocab, *truth[1:]], conf),
                                     ([truth[0]], [0.4]),
                                     ([(truth[0] + 2) % self.vocab], [0.01])])

    def feedback(self, fb):
        super().feedback(fb)
        self.accepted.append(fb.accepted)


def test_a_likely_runner_up_is_verified_and_a_hopeless_one_pruned(tiny_torch, prompt_ids,
                                                                  reference):
    engine = Engine(tiny_torch)
    engine.cost = PinnedCost(max_k=engine.max_draft)
    source = RunnerUp("int8", prompt_ids + reference, tiny_torch.vocab_size)
    trees, plan = [], engine._plan
    engine._plan = lambda seq, *rest: trees.append(plan(seq, *rest)) or trees[-1]
    params = GenerationParams(max_tokens=N, eos_token_ids=EOS_NONE)
    out, stats = stream_checked(engine, prompt_ids, params, sources=[source])
    assert out == reference[:N]
    # once asked, every step commits the runner-up (and the verifier's own next token)
    asked = [acc for acc, off in zip(source.accepted, source.offered, strict=True) if off]
    assert asked and all(acc == 1 for acc in asked)
    assert stats.tree_blocks == len(asked) and stats.plain_steps <= 1
    # the runner-up rode along in every verified tree, the 1 % one in none
    assert len(trees) == len(source.truths)  # one proposal per plan
    for tree, truth in zip(trees, source.truths, strict=True):
        if tree.drafted:
            first = {tree.tokens[c] for c in tree.children[0].values()}
            assert truth in first and (truth + 2) % tiny_torch.vocab_size not in first


class Late(Chain):
    """A remote-like source: its drafts for a commit arrive only after `wait` (no clock: the
    arrival is the call), and it announces them as due in a millisecond."""

    streams = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.arrived, self.waits = False, 0

    def propose(self, committed, budget):
        return super().propose(committed, budget) if self.arrived else DraftTree.of_chain([])

    def feedback(self, fb):
        super().feedback(fb)
        self.arrived = False  # a new commit: its answer is on its way

    def expected_wait(self):
        return None if self.arrived else 0.001

    def wait(self, timeout):
        self.waits += 1
        self.arrived = True
        return True


@pytest.mark.parametrize("right", [True, False])
def test_announced_drafts_are_waited_for_only_when_they_pay(tiny_torch, prompt_ids, reference,
                                                           right):
    late = Late("late", prompt_ids + reference, tiny_torch.vocab_size, right=right)
    _, stats = run_alone_pinned(tiny_torch, prompt_ids, reference, N, late)
    assert stats.waits == late.waits
    if right:  # waited every step (1 ms for many tokens) and got long blocks
        assert late.waits == stats.blocks - 1 and stats.blocks <= 4
    else:  # the prior earns a try or two, then never waits for drafts that are always wrong
        assert late.waits <= 2


class Slow(Late):
    """A remote-like source whose answers are announced too late to pay for a wait (12 ms
    against a 56 ms step, at the prior's acceptance), yet within a first probe's share of the
    verifier's time (3 % of 8 plain steps: 13.4 ms)."""

    announce = 0.012

    def expected_wait(self):
        return None if self.arrived else self.announce


@pytest.mark.parametrize("right", [True, False])
def test_a_probe_waits_for_a_source_no_wait_pays_for(tiny_torch, prompt_ids, probe_reference,
                                                     right):
    """Its drafts never arrive in time, so only probes (which wait) can judge them; they back
    off while they fail."""
    slow = Slow("slow", prompt_ids + probe_reference, tiny_torch.vocab_size, right=right)
    _, stats = run_alone_pinned(tiny_torch, prompt_ids, probe_reference, PROBE_N, slow)
    assert stats.waits == slow.waits >= 1  # only probes wait: 12 ms does not pay at the prior
    if right:  # each probe's drafts were all taken
        assert stats.accepted == stats.drafted >= slow.waits
    else:  # first probe after 8 plain steps, then 16, 32: three at most in 64 tokens
        assert stats.accepted == 0 and slow.waits <= 3


class SlowTimed(Slow):
    """Slow, announcing its drafts in 5 s, recording each wait's bound and each ask."""

    announce = 5.0

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.timeouts, self.asked = [], 0

    def propose(self, committed, budget):
        self.asked += budget > 0
        return super().propose(committed, budget)

    def wait(self, timeout):
        self.timeouts.append(timeout)
        return super().wait(timeout)


def test_a_source_due_later_than_a_probe_may_wait_is_asked_only_in_probes(
        tiny_torch, prompt_ids, probe_reference):
    """A source announcing its drafts in 5 s is never waited for: no probe's share of the
    verifier's time (`probe_share` of at most 32 plain steps: 54 ms here) covers that, and a
    shorter wait brings nothing but its cost. Its drafts never come in time, so after
    `probe_every` asks it is asked only in probes (every 8, 16, 32 steps), which take what it
    has then: a slow proposer costs next to nothing however slow it is."""
    slow = SlowTimed("slow", prompt_ids + probe_reference, tiny_torch.vocab_size, right=True)
    engine, stats = run_alone_pinned(tiny_torch, prompt_ids, probe_reference, PROBE_N, slow)
    assert slow.timeouts == [] and stats.waits == 0 and stats.drafted == 0
    assert engine.cost.probe_every <= slow.asked <= engine.cost.probe_every + 3


class RunsOut(Late):
    """A remote-like source whose drafts for the last commit are due in a millisecond, while
    what it has now (its older guess) runs out two tokens past the prefix."""

    def propose(self, committed, budget):
        return Chain.propose(self, committed, budget if self.arrived else min(budget, 2))


@pytest.mark.parametrize("right", [True, False])
def test_short_drafts_are_topped_up_by_a_wait_only_when_it_pays(tiny_torch, prompt_ids,
                                                                reference, right):
    src = RunsOut("remote", prompt_ids + reference, tiny_torch.vocab_size, right=right)
    _, stats = run_alone_pinned(tiny_torch, prompt_ids, reference, N, src)
    assert stats.waits == src.waits
    if right:  # 1 ms for a full block instead of 2 tokens: waited every step, long blocks
        assert src.waits == stats.blocks - 1 and stats.blocks <= 4
    else:  # never worth waiting for more of what is always wrong
        assert src.waits <= 2 and stats.blocks >= N // 2


class Classed(DraftSource):
    """A lookup drafter in miniature: every third step its draft continues a long match and
    is right, the other steps a one-token match and wrong; it says which before drafting."""

    name = "lookup"

    def __init__(self, reference, vocab):
        self.reference, self.vocab, self.steps = reference, vocab, 0
        self.asked = {"m5": [], "m1": []}  # per class: the budget asked, step by step

    def _cls(self):
        return "m5" if self.steps % 3 == 0 else "m1"

    def draft_class(self, committed):
        return self._cls()

    def propose(self, committed, budget):
        cls = self._cls()
        self.steps += 1
        self.asked[cls].append(budget)
        truth = self.reference[len(committed) : len(committed) + budget]
        toks = truth if cls == "m5" else [(t + 1) % self.vocab for t in truth]
        return DraftTree.of_chain(toks)


def test_a_source_is_judged_per_draft_class(tiny_torch, prompt_ids, reference):
    """Its long matches keep their budget although most of its drafts (the short matches)
    are wrong, and the short ones are turned down although its long ones are right: one
    estimate for both would draft the junk on the strength of the long matches."""
    long_ref = hf_greedy(tiny_torch, prompt_ids, 3 * N, eos_id=49151)
    engine = Engine(tiny_torch)
    engine.cost = PinnedCost(max_k=4)
    source = Classed(prompt_ids + long_ref, tiny_torch.vocab_size)
    params = GenerationParams(max_tokens=3 * N, eos_token_ids=EOS_NONE)
    out, _ = stream_checked(engine, prompt_ids, params, sources=[source])
    assert out == long_ref[: 3 * N]
    good, junk = source.asked["m5"][1:], source.asked["m1"]
    # long matches: drafted in full every time (but where the answer's end caps the budget)
    assert len(good) >= 5 and sum(1 for k in good if k >= 3) >= len(good) - 2
    assert len(junk) >= 10 and sum(1 for k in junk[4:] if k) <= 2  # short: off, but probes
    # the records are kept per class too: the next generation starts each from its own
    assert engine.cost.start_acceptance("lookup#m5") > 0.9
    assert engine.cost.start_acceptance("lookup") == engine.cost.prior_acceptance
