"""The draft-length controller: speculate when it pays, plain steps when it does not."""

from __future__ import annotations

import numpy as np
import pytest

from nodes.engine import cost as cost_mod
from nodes.engine.cost import CostModel
from nodes.engine.tree import DraftTree, TokenTree


def feed(c, cost, accept_rate, blocks=200):
    """Simulate blocks: verify cost(n) seconds, drafts accepted with the given pattern."""
    ks = []
    for i in range(blocks):
        k = c.choose_k()
        ks.append(k)
        c.record_verify(k + 1, cost(k + 1))
        if k:
            accepted = k if accept_rate(i) else 0
            c.record_acceptance(k, accepted)
    return ks


def test_sublinear_cost_and_good_drafts_use_long_blocks():
    c = CostModel(max_k=16)
    ks = feed(c, lambda n: 0.058 + 0.0046 * (n - 1), lambda i: True)
    assert min(ks[20:]) >= 12


def test_useless_drafts_turn_speculation_off_with_backoff():
    c = CostModel(max_k=16)
    ks = feed(c, lambda n: 0.058 + 0.0046 * (n - 1), lambda i: False, blocks=400)
    spec = [i for i, k in enumerate(ks) if k]
    assert len(spec) < 20  # a few early tries, then rare probes
    gaps = [b - a for a, b in zip(spec[-4:-1], spec[-3:], strict=True)]
    assert all(g >= 32 for g in gaps)  # probes back off


def test_linear_cost_never_pays():
    # verifying n tokens costs n times one token: drafts accepted half the time cannot pay
    c = CostModel(max_k=8)
    ks = feed(c, lambda n: 0.05 * n, lambda i: i % 2 == 0, blocks=300)
    assert sum(1 for k in ks[50:] if k) < 15


def test_expensive_drafter_is_turned_down():
    c = CostModel(max_k=8)
    for _ in range(5):
        c.record_draft(4, 4 * 0.2)  # 200 ms per drafted token vs 58 ms verify
    ks = feed(c, lambda n: 0.058 + 0.0046 * (n - 1), lambda i: True, blocks=100)
    assert sum(1 for k in ks if k) < 20


def test_new_generation_restarts_a_poor_record_at_the_prior_keeps_costs():
    c = CostModel(max_k=16)
    feed(c, lambda n: 0.05 + 0.002 * n, lambda i: False, blocks=50)
    assert c.acceptance < 0.05
    learnt = c.verify_cost(5)
    c.start_generation()
    assert c.acceptance == c.prior_acceptance
    assert c.verify_cost(5) == learnt


def test_verify_curve_between_and_past_measured_counts_follows_every_new_measurement():
    """The line through the multi-token forwards is fitted once per change (the planner reads
    it ~40 times a step); every measurement, and a fork's, must move it."""
    c = CostModel(max_k=16)
    assert c.verify_cost(1) == 1.0 and c.verify_cost(4) == pytest.approx(1.5 + 0.03 * 2)
    c.record_verify(1, 0.010)
    assert c.verify_cost(4) == pytest.approx(0.010 * (1.5 + 0.03 * 2))
    c.record_verify(2, 0.016)  # one multi-token point: a line through it at the prior's slope
    assert c.verify_cost(6) == pytest.approx(0.016 + 0.03 * 0.010 * 4)
    fork = c.fork()
    fork.record_verify(8, 0.028)  # two points: their line, read by the parent as well
    assert c.verify_cost(5) == pytest.approx(0.016 + 0.002 * 3)
    assert c.verify_cost(3) == pytest.approx(0.018) and c.verify_cost(8) == 0.028
    for _ in range(20):  # the 8-row forward gets cheaper: the line follows
        c.record_verify(8, 0.022)
    assert c.verify_cost(5) == pytest.approx(0.016 + 0.001 * 3, rel=1e-3)
    c._verify.update({2: 0.030, 8: 0.030})  # written directly (tests pin costs so)
    assert c.verify_cost(5) == pytest.approx(0.030)


def test_one_slow_forward_does_not_make_a_longer_one_look_cheaper():
    """Measured points are read non-decreasing in the rows fed: a 9-row forward caught slow
    (29.8 ms beside 26.6 ms for 10 rows) must not stop a near-certain chain short of it."""
    c = CostModel(max_k=16)
    measured = {1: 12.2, 2: 13.7, 3: 21.1, 4: 18.2, 5: 19.4, 6: 20.2, 7: 23.6, 8: 23.1,
                9: 29.8, 10: 26.6, 11: 33.0, 12: 30.1, 16: 40.2, 17: 39.4}
    c._verify.update({n: ms / 1000 for n, ms in measured.items()})
    costs = [c.verify_cost(n) for n in range(2, 18)]
    assert costs == sorted(costs)  # a row never saves time
    assert c.verify_cost(9) == c.verify_cost(10) == pytest.approx(0.0282)
    assert c.verify_cost(1) == pytest.approx(0.0122)  # its own kernel path: never pooled
    for _ in range(30):
        c.record_acceptance(9, 9, "sure")
    assert c.choose_k("sure") >= 9
    c.record_verify(9, 0.010)  # a new measurement re-orders the curve
    assert c.verify_cost(9) < c.verify_cost(10)


# ---- per-source estimates and tree selection ------------------------------------------------
CPU = lambda n: 0.056 if n == 1 else 0.090 + 0.003 * (n - 2)  # noqa: E731 - SmolLM2 on CPU


def seeded(max_k=16):
    c = CostModel(max_k=max_k)
    for n in range(1, max_k + 2):
        c.record_verify(n, CPU(n))
    return c


def test_each_source_is_judged_on_its_own_record():
    c = seeded()
    for _ in range(30):
        c.record_acceptance(8, 8, "good")  # every token right
        c.record_acceptance(8, 0, "bad")  # never
    assert c.acceptance_of("good") > 0.95 and c.acceptance_of("bad") < 0.05
    assert c.choose_k("good") >= 12  # a weak neighbour does not shrink a strong source
    ks = [c.choose_k("bad") for _ in range(100)]
    assert 0 < sum(1 for k in ks if k) <= 100 // c.probe_every  # off, but probed
    assert c.choose_k("new") > 0  # an unknown source starts from the prior and is tried


def test_remote_drafts_cost_nothing_local_drafting_counts():
    c = seeded()
    for _ in range(10):
        c.record_acceptance(6, 2, "int8")
        c.record_acceptance(6, 2, "remote")
        c.record_draft(6, 6 * 0.040, "int8")  # 40 ms per drafted token on the verifier's time
    assert c.acceptance_of("int8") == pytest.approx(c.acceptance_of("remote"))
    assert c.choose_k("remote") > 0
    assert c.choose_k("int8") == 0


def test_node_values_follow_owners_and_siblings_share():
    tree = TokenTree(1)
    tree.merge([(0, DraftTree.of_chain([5, 6])), (1, DraftTree.of_chain([7, 8]))], 8, 8)
    tree.merge([(1, DraftTree.of_chain([5, 9]))], 8, 8)  # 5 shared by both sources
    v = tree.node_values({0: 0.5, 1: 0.9})
    by_tok = dict(zip(tree.tokens, v, strict=True))
    assert by_tok[5] == pytest.approx(0.9)  # the better owner counts
    assert by_tok[6] == pytest.approx(0.9 * 0.5)
    assert by_tok[9] == pytest.approx(0.9 * 0.9 * 0.5)  # the second child gets what is left
    assert by_tok[7] == pytest.approx(0.9 * 0.1)  # second child of the root
    assert by_tok[8] == pytest.approx(0.9 * 0.1 * 0.9)


def test_node_values_take_an_acceptance_per_depth():
    tree = TokenTree(1)
    tree.merge([(0, DraftTree.of_chain([5, 6, 7, 8]))], 8, 8)
    v = dict(zip(tree.tokens, tree.node_values({0: [0.2, 0.5, 0.9]}), strict=True))
    assert v[5] == pytest.approx(0.2)
    assert v[6] == pytest.approx(0.2 * 0.5)
    assert v[7] == pytest.approx(0.2 * 0.5 * 0.9)
    assert v[8] == pytest.approx(0.2 * 0.5 * 0.9 * 0.9)  # deeper: the last figure


def test_alternatives_are_valued_by_their_draft_probability():
    """A model drafter's runners-up: of what the chain token leaves, each gets its share of
    the draft probability the earlier siblings did not take."""
    tree = TokenTree(1)
    chain = ([5, 6], [0.5, 0.9])
    likely = ([7], [0.4])  # alternative to 5
    unlikely = ([8], [0.02])
    tree.merge([(0, DraftTree.from_paths([chain, likely, unlikely]))], 8, 8)
    by_tok = dict(zip(tree.tokens, tree.node_values({0: 0.6}), strict=True))
    assert by_tok[5] == pytest.approx(0.6)  # the chain: the source's measured acceptance
    assert by_tok[6] == pytest.approx(0.6 * 0.6)
    assert by_tok[7] == pytest.approx(0.4 * 0.8)  # (1 - 0.6) left, 0.4 / 0.5 of it
    assert by_tok[8] == pytest.approx((0.4 - 0.32) * (0.02 / 0.1))
    # without probabilities an alternative is valued like any sibling (the n-gram case)
    bare = TokenTree(1)
    bare.merge([(0, DraftTree.from_paths([([5, 6], None), ([7], None)]))], 8, 8)
    assert dict(zip(bare.tokens, bare.node_values({0: 0.6}), strict=True))[7] == \
        pytest.approx(0.4 * 0.6)
    # the pruned tree keeps the likely runner-up and drops the unlikely one
    kept = tree.subtree(seeded().select(tree.node_values({0: 0.6}), [False] * len(tree)))
    assert 7 in kept.tokens and 8 not in kept.tokens


def test_select_keeps_what_pays_and_is_prefix_closed():
    c = seeded()
    tree = TokenTree(1)
    tree.merge([(0, DraftTree.of_chain(np.arange(10, 20))),
                (1, DraftTree.of_chain(np.arange(30, 36)))], 16, 16)
    strong = tree.node_values({0: 0.95, 1: 0.05})
    keep = c.select(strong, [False] * len(tree))
    kept = tree.subtree(keep)
    assert kept.tokens[1:] == list(range(10, 20))  # the strong chain whole, the weak one gone
    assert kept.is_chain() and kept.offered_by(0) == 10 and kept.offered_by(1) == 0
    # nothing worth a wider forward: a plain step (a 1-token draft costs 1.6x for 0.3 tokens)
    weak = tree.node_values({0: 0.3, 1: 0.05})
    assert c.select(weak, [False] * len(tree)) == []
    # a probe's chain stays whatever it is worth, and with it every parent
    forced = [1 in owners for owners in tree.owners]
    keep = c.select(weak, forced)
    assert [tree.tokens[i] for i in keep if 1 in tree.owners[i]] == list(range(30, 36))
    # ... and once the forward is wide anyway, the other chain's likeliest tokens ride along
    assert [tree.tokens[i] for i in keep if 0 in tree.owners[i]] == [10, 11]
    mixed = c.select(tree.node_values({0: 0.7, 1: 0.6}), [False] * len(tree))
    assert all(tree.parents[i] == 0 or tree.parents[i] in mixed for i in mixed)
    assert any(1 in tree.owners[i] for i in mixed) and any(0 in tree.owners[i] for i in mixed)


def test_a_wait_is_taken_only_when_it_pays():
    c = seeded()
    for _ in range(10):
        c.record_acceptance(8, 8, "fast")  # nearly always right
        c.record_acceptance(8, 0, "wrong")
    assert c.wait_pays("fast", 8, 0.001)  # a millisecond for ~8 tokens
    assert c.wait_pays("fast", 8, 0.150)  # even 150 ms: ~8 tokens for 0.32 s vs 1 per 56 ms
    assert not c.wait_pays("fast", 8, 1.0)
    assert not c.wait_pays("wrong", 8, 0.001)  # nothing to gain
    assert not c.wait_pays("fast", 0, 0.001)


def test_a_wait_counts_on_what_the_source_brought_after_earlier_waits():
    """A proposer that is never ahead brings one token per wait, whatever it is asked for: on
    a verifier whose forwards cost the same for 1 or 17 tokens (a GPU), waiting 30 ms for one
    token does not beat a 28 ms plain step, though waiting for 16 would."""
    flat = CostModel(max_k=16)
    for n in range(1, 18):
        flat.record_verify(n, 0.028)
    for _ in range(10):
        flat.record_acceptance(8, 8, "slow")
    assert flat.wait_pays("slow", 16, 0.030)  # nothing known yet: the budget counts
    for _ in range(5):
        flat.record_delivered("slow", 1, 16)
    assert flat.delivered("slow", 16) == 1
    assert not flat.wait_pays("slow", 16, 0.030)
    assert not flat.top_up_pays("slow", 1, 16, 0.030)  # it has that one already
    # on a one-thread CPU verifier (two tokens cost ~1.1x one) one token is worth the wait
    cpu = CostModel(max_k=16)
    for n in range(1, 18):
        cpu.record_verify(n, 0.095 if n == 1 else 0.103 + 0.004 * (n - 2))
    for _ in range(10):
        cpu.record_acceptance(8, 8, "slow")
        cpu.record_delivered("slow", 1, 16)
    assert cpu.wait_pays("slow", 16, 0.030)
    # a full answer to a short ask does not lower what longer asks count on
    flat.record_delivered("slow", 6, 6)
    flat.record_delivered("slow", 2, 2)
    assert flat.delivered("slow", 16) >= 2
    assert flat.wait_pays("slow", 16, 0.030) == (flat.delivered("slow", 16) >= 2)
    # waits that brought nothing leave a fast source worth a millisecond's wait
    for _ in range(20):
        flat.record_delivered("fast", 0, 16)
        flat.record_acceptance(8, 8, "fast")
    assert flat.delivered("fast", 16) == 1
    assert flat.wait_pays("fast", 16, 0.001)


# ---- acceptance across generations ---------------------------------------------------------------
def one_generation(c, name, accept, steps=12):
    """A generation on a fork of `c`: the budgets asked for, `accept(k)` of each right."""
    f = c.fork()
    ks = []
    for _ in range(steps):
        k = f.choose_k(name)
        ks.append(k)
        if k:
            f.record_acceptance(k, accept(k), name)
    return ks


def test_a_source_right_so_far_gets_its_whole_budget_from_the_first_step():
    c = seeded()
    first = one_generation(c, "suffix", lambda k: k)
    assert first[0] < 6  # a source without a record starts from the prior and ramps
    for _ in range(2):
        ks = one_generation(c, "suffix", lambda k: k)
        assert ks[0] == c.max_k, ks  # its record: the large budget at once
    assert c.fork().choose_k("other") == first[0]  # records are per source


def test_a_source_that_never_helps_is_still_asked_for_little():
    """A poor record never starts a generation below the prior (a prompt the source copies
    from must not be held back), and the source is turned down as fast as a new one."""
    c = seeded()
    fresh = one_generation(c.fork(), "bad", lambda k: 0, steps=40)
    for _ in range(3):
        ks = one_generation(c, "bad", lambda k: 0, steps=40)
    assert c.start_acceptance("bad") == c.prior_acceptance
    assert ks == fresh and sum(ks) <= 40  # a few small tries and rare probes


def test_the_new_prompt_soon_outweighs_a_good_record():
    c = seeded()
    for _ in range(3):
        one_generation(c, "suffix", lambda k: k)
    f = c.fork()
    assert f.choose_k("suffix") == c.max_k
    f.record_acceptance(c.max_k, 0, "suffix")  # the whole draft wrong: open-ended text
    assert f.acceptance_of("suffix") < 0.6 and f.choose_k("suffix") <= 4


# ---- a batch's cost per total rows, and draft sizing given the batch ----------------------------
def cpu_batch(rows):
    """A CPU-like batched forward (pinned, no timing): few rows cost little each (the few-row
    kernel), past 16 each row costs twice as much."""
    return 0.046 + 0.004 * rows if rows <= 16 else 0.110 + 0.008 * (rows - 16)


def pinned_batch(curve, rows=range(2, 129)):
    c = CostModel(max_k=16)
    for r in rows:
        c.record_batch(r, curve(r))
    return c


CHAIN = ([1.0, 0.9, 0.8, 0.7, 0.6], [False] * 5)  # a likely chain of 4 draft nodes


def test_batch_cost_is_learnt_per_rows_non_decreasing_and_shared_by_forks():
    c = CostModel(max_k=16)
    for n in range(1, 9):
        c.record_verify(n, 0.05 + 0.002 * n)
    assert c.batch_cost(6) == c.verify_cost(6)  # before any batched forward: the solo curve
    c.fork().record_batch(4, 0.100)  # a fork's sample is the engine's (it is the device's)
    assert c.batch_cost(4) == pytest.approx(0.100)
    assert c.batch_cost(6) == pytest.approx(0.100 * c.verify_cost(6) / c.verify_cost(4))
    c.record_batch(8, 0.140)
    c.record_batch(6, 0.200)  # one slow sample: pooled with its neighbour, not a cliff
    assert c.batch_cost(4) == pytest.approx(0.100)
    assert c.batch_cost(6) == pytest.approx(0.170) == c.batch_cost(8)
    assert c.batch_cost(5) == pytest.approx(0.135)
    assert c.batch_cost(10) == pytest.approx(0.170)  # past the end: the last segment's slope
    assert c.start_generation() is None and c.batch_cost(4) == pytest.approx(0.100)


def test_below_the_smallest_batched_forward_the_cost_stays_positive():
    """Only long batched forwards measured (prompts riding along: 150 and 300 rows, a steep
    line that crosses zero at 75 rows): a 2-row batch is the solo curve scaled through the
    smallest point, positive and below it, and fitting a batch there does not divide by zero
    (it did: `bench serve --drafter int8` at c = 2 failed generations so)."""
    c = CostModel(max_k=16)
    for n in range(1, 9):
        c.record_verify(n, 0.05 + 0.002 * n)
    c.record_batch(150, 0.50)
    c.record_batch(300, 1.50)
    assert 0 < c.batch_cost(2) == pytest.approx(0.50 * c.verify_cost(2) / c.verify_cost(150))
    assert c.batch_cost(2) < c.batch_cost(150)
    assert c.fit_batch([CHAIN, CHAIN], fixed_rows=2, tokens=2) == [[1, 2, 3, 4]] * 2


def test_an_in_process_drafter_drafts_less_as_the_batch_grows():
    """A source drafting on the verifier's own time (16 ms a token, right 0.75 of the time)
    drafts as alone in a batch of one, and not at all once the batch's plain rate beats what
    its drafting buys (every sequence waits while it drafts); a remote source (no draft cost
    here) keeps its k whatever the batch, `fit_batch` weighing its rows."""
    c = pinned_batch(cpu_batch)
    for _ in range(50):
        c.record_acceptance(4, 3, "int8")
        c.record_acceptance(4, 3, "remote")
        c.record_draft(4, 0.064, "int8")
    assert c.acceptance_of("int8") == pytest.approx(0.75, abs=0.02)
    assert c.fit_draft_to_batch(5, "int8", 1) == 5
    ks = [c.fit_draft_to_batch(5, "int8", b) for b in (2, 4, 8, 16)]
    assert ks == sorted(ks, reverse=True) and ks[-1] == 0
    assert [c.fit_draft_to_batch(5, "remote", b) for b in (1, 8, 16)] == [5, 5, 5]
    # drafting that costs next to nothing keeps its length in a batch
    c.record_draft(4, 1e-6, "cheap")
    for _ in range(50):
        c.record_acceptance(4, 3, "cheap")
    assert c.fit_draft_to_batch(5, "cheap", 8) == 5


def test_in_a_batch_a_new_generation_starts_from_the_sources_record_not_the_prior():
    """Alone, a source with a poor record starts a generation at the prior (a prompt it helps
    with must not be held back); in a batch, where every sequence waits while it drafts, its
    record stands in for the prior until the generation's own evidence outweighs it."""
    c = pinned_batch(cpu_batch)
    c.record_draft(2, 0.006, "head")  # 3 ms a token on the verifier's time
    for _ in range(20):  # earlier generations: right 0.2 of the time
        for accepted in (0, 0, 0, 1):
            c.record_acceptance(4, accepted, "head")
    fresh = c.fork()  # a new generation
    assert fresh.acceptance_of("head") == pytest.approx(fresh.prior_acceptance)
    assert fresh.batch_acceptance("head") < 0.3
    assert fresh.fit_draft_to_batch(3, "head", 1) == 3  # alone: as before
    assert fresh.fit_draft_to_batch(3, "head", 8) == 0
    unknown = c.fork()  # the same costs, no record: the prior decides, and it drafts
    unknown.record_draft(2, 0.006, "other")
    assert unknown.batch_acceptance("other") == pytest.approx(unknown.prior_acceptance)
    assert unknown.fit_draft_to_batch(3, "other", 8) > 0
    for _ in range(6):  # this prompt it gets right: its own evidence takes over
        fresh.record_acceptance(3, 3, "head")
    assert fresh.batch_acceptance("head") == pytest.approx(fresh.acceptance_of("head"),
                                                           abs=0.05)
    assert fresh.fit_draft_to_batch(3, "head", 8) > 0


def test_at_low_load_the_batch_keeps_every_planned_draft():
    c = pinned_batch(cpu_batch)
    keep = c.fit_batch([CHAIN, CHAIN], fixed_rows=2, tokens=2)
    assert keep == [[1, 2, 3, 4], [1, 2, 3, 4]]


def test_at_high_load_the_batch_narrows_to_plain_decoding():
    c = pinned_batch(cpu_batch)
    keep = c.fit_batch([CHAIN] * 16, fixed_rows=16, tokens=16)  # 16 rows already
    assert keep == [[]] * 16
    # in between, the least valuable draft nodes go first, each tree stays prefix-closed
    keep = c.fit_batch([CHAIN] * 6, fixed_rows=6, tokens=6)
    assert 0 < sum(map(len, keep)) < 24
    assert all(k == list(range(1, len(k) + 1)) for k in keep)
    assert max(map(len, keep)) - min(map(len, keep)) <= 1

def test_prompt_rows_in_the_forward_do_not_make_drafts_look_free():
    """A step that also feeds prompts is long anyway, but its draft rows still delay those
    prompts for tokens worth a decode step's share: judged against the decode step, with the
    rows' marginal cost where they really sit (on top of the prompt rows), and the new
    sequences counted like running ones."""
    c = pinned_batch(cpu_batch)
    # at low load a likely chain still rides along; past 16 rows a row costs 8 ms, and the
    # fourth node (0.6 of a token) no longer pays for that at the decode step's rate
    assert c.fit_batch([CHAIN, CHAIN], fixed_rows=2, tokens=2, prompt_rows=4) == [[1, 2, 3, 4]] * 2
    assert c.fit_batch([CHAIN, CHAIN], fixed_rows=2, tokens=2 + 1,
                       prompt_rows=64) == [[1, 2, 3]] * 2
    # in between it trims as without the prompt (here to 10 of 24 nodes; with it, at 8 ms
    # a row throughout, to 12), where a 300-row step's own rate would have kept every node
    assert sum(map(len, c.fit_batch([CHAIN] * 6, fixed_rows=6, tokens=6))) == 10
    assert c.fit_batch([CHAIN] * 6, fixed_rows=6, tokens=6, prompt_rows=300) == [[1, 2]] * 6
    assert c.fit_batch([CHAIN] * 6, fixed_rows=6 + 300, tokens=6) == [[1, 2, 3, 4]] * 6
    # prompts waiting for a later step weigh like running sequences: fewer nodes, down to none
    kept = [sum(map(len, c.fit_batch([CHAIN] * 2, fixed_rows=2, tokens=2 + w)))
            for w in range(0, 16, 2)]
    assert kept == sorted(kept, reverse=True) and kept[0] == 8 and kept[-1] == 0


def test_a_batch_keeps_probes_and_the_likelier_sequence_s_drafts():
    c = pinned_batch(cpu_batch)
    probe = ([1.0, 0.1, 0.05], [False, True, True])
    sure = ([1.0, 0.99, 0.98, 0.97], [False] * 4)
    unsure = ([1.0, 0.3, 0.09, 0.03], [False] * 4)
    keep = c.fit_batch([probe, unsure, sure], fixed_rows=3 + 13, tokens=16)
    assert keep[0] == [1, 2]  # forced, whatever the load
    assert len(keep[2]) >= len(keep[1])
    assert keep[1] == []


def test_rows_nearly_free_keep_everything_whatever_the_batch():
    c = pinned_batch(lambda rows: 0.030 + 0.0001 * rows)
    assert c.fit_batch([CHAIN] * 16, fixed_rows=16, tokens=16) == [[1, 2, 3, 4]] * 16


def test_a_probe_is_as_long_as_the_verify_curve_makes_it_worth():
    """Long where the first extra row is dear and later ones cheap (torch's CPU matmul), short
    where rows rise steadily (the few-row kernel), never past probe_k."""
    torch_like, kernel_like = CostModel(), CostModel()
    for n, ms in {1: 50, 2: 85, 3: 105, 4: 84, 5: 95, 6: 95, 7: 96, 8: 96, 9: 100}.items():
        torch_like.record_verify(n, ms / 1000)
    for n, ms in {1: 47, 2: 56, 3: 62, 4: 70, 5: 72, 6: 73, 7: 78, 8: 83, 9: 86}.items():
        kernel_like.record_verify(n, ms / 1000)
    assert torch_like.probe_length() >= 3
    assert kernel_like.probe_length() <= 3
    assert kernel_like.probe_length() < torch_like.probe_length()
    assert CostModel(probe_k=2).probe_length() <= 2


def test_a_source_that_never_helps_is_probed_with_the_probe_length():
    c = CostModel()
    for n, ms in {1: 47, 2: 56, 3: 62, 4: 70, 5: 72, 6: 73, 7: 78}.items():
        c.record_verify(n, ms / 1000)
    asked = []
    for _ in range(200):
        k = c.choose_k("useless")
        asked.append(k)
        if k:
            c.record_acceptance(k, 0, "useless")
    probes = [k for k in asked[40:] if k]  # past the first tries at the prior: probes only
    assert probes and set(probes) == {c.probe_length()}


def test_a_draft_class_starts_from_its_sources_phase_in_this_generation():
    from nodes.engine.cost import class_key

    c = CostModel(max_k=16)
    short, long_ = class_key("ngram", "m1"), class_key("ngram", "m9")
    assert class_key("ngram", None) == "ngram"
    # nothing seen yet this generation: a class starts from the prior
    assert c.acceptance_of(short) == c.prior_acceptance
    for _ in range(6):  # long matches right in full: the answer copies its prompt
        c.record_acceptance(8, 8, long_)
    assert c.acceptance_of(long_) > 0.9
    # the source's phase moved with its class, and a class met now starts from it
    assert c.acceptance_of("ngram") > 0.9
    assert c.acceptance_of(class_key("ngram", "m2")) > 0.9
    # a class's own evidence then rules it: short matches wrong, long ones unaffected
    for _ in range(4):
        c.record_acceptance(2, 0, short)
    assert c.acceptance_of(short) < 0.5 and c.acceptance_of(long_) > 0.9
    # each class keeps its own record across generations, a poor one included (a short
    # match's record is its own kind of draft's rate: no floor at the prior)
    c.start_generation()
    assert c.acceptance_of(long_) > 0.9 and c.acceptance_of(short) < 0.1


def test_a_chain_climbs_the_match_classes():
    from nodes.engine.sources import class_at, names_match

    assert [class_at("lm1", j) for j in range(10)] == [
        "lm1", "lm2", "lm3", "lm3", "lm5", "lm5", "lm5", "lm5", "lm9", "lm9"]
    assert [class_at("m3", j) for j in range(4)] == ["m3", "m3", "m5", "m5"]
    assert class_at("gm9", 30) == "gm9"
    # labels that name no match are their own class at every depth, hostile ones included
    for label in ("repeat", "m0", "m", "", "lm1x", "m#1", "m-1"):
        assert class_at(label, 3) == label
        assert not names_match(label)
    assert class_at("m999", 1) == "m9" and names_match("lm1") and names_match("m9")


def test_each_chain_token_is_recorded_under_its_own_class():
    from nodes.engine.cost import class_key

    c = seeded()
    one = class_key("s", "lm1")
    for _ in range(3):  # 5 drafted from a one-token match: 3 right, the 4th wrong
        c.record_acceptance(5, 3, one)
    # the source's phase this generation: 3 of 4 judged tokens per block
    assert c.acceptance_of("s") < 0.8
    c.start_generation()
    assert c.start_acceptance(one) == 1.0  # 1st token: m1, always right
    assert c.start_acceptance(class_key("s", "lm2")) == 1.0  # 2nd: m2
    assert c.start_acceptance(class_key("s", "lm3")) == pytest.approx(0.5)  # 3rd right, 4th not
    assert c.start_acceptance(class_key("s", "lm5")) == c.prior_acceptance  # never judged


def test_a_chain_from_a_short_match_is_worth_what_its_classes_are():
    """Records from answers that copy their prompt: a one-token match's next token is wrong,
    a long match's right. Judged by its first token's class alone, a chain from a one-token
    match took the whole chains' rate (~0.8 on such prompts) and started every open-ended
    answer with a long wrong draft; along its ladder it is worth a plain step."""
    from nodes.engine.cost import class_key

    c = seeded()
    short, long_ = class_key("s", "m1"), class_key("s", "m5")
    for _ in range(6):
        c.record_acceptance(8, 0, short)
        c.record_acceptance(8, 8, long_)
    c.start_generation()
    assert c.choose_k(long_) == c.max_k
    assert c.choose_k(short) == 0
    # the tokens a chain would climb to count: from a two-token match (no record: the
    # prior) the chain reaches m5, whose record pays for a long draft
    two = class_key("s", "m2")
    assert c.chain_acceptance(two, 5) == pytest.approx([0.5, 0.5, 0.5, 1.0, 1.0], abs=0.02)
    assert c.expected_tokens(8, two) > c.expected_tokens(8, "s", a=0.5)
    assert c.choose_k(two) >= 8


def test_a_class_not_drafted_yet_follows_the_generation_s_phase():
    from nodes.engine.cost import class_key

    c = seeded()
    for _ in range(6):
        c.record_acceptance(8, 8, class_key("s", "m9"))
    c.start_generation()
    # this answer does not copy: one-token matches keep failing
    for _ in range(4):
        c.record_acceptance(4, 0, class_key("s", "m1"))
    phase = c.acceptance_of("s")
    assert phase < 0.2
    # m5 was never reached: it reads the phase, and reading it does not fix it there
    five = class_key("s", "m5")
    assert c.acceptance_of(five) == pytest.approx(phase)
    assert c.chain_acceptance(class_key("s", "m3"), 3)[2] == pytest.approx(phase)
    c.record_acceptance(4, 4, class_key("s", "m1"))  # m1, m2, m3, m3 right: not m5
    assert c.acceptance_of(five) == pytest.approx(c.acceptance_of("s"))
    assert c.acceptance_of(five) > phase


# ---- a source whose drafts come too late --------------------------------------------------------
def late_model():
    c = CostModel(max_k=16)
    for n in range(1, 18):
        c.record_verify(n, 0.058 + 0.0046 * (n - 1))  # long blocks pay at the prior
    return c


def ask_unheard(c, name, steps, streams=True):
    """`steps` plans in which `name`'s drafts were never in the verified tree; the budgets."""
    ks = []
    for _ in range(steps):
        k = c.choose_k(name)
        ks.append(k)
        if k:
            c.record_unheard(name, streams=streams)
    return ks


def test_a_source_never_heard_is_asked_only_in_probes_until_one_is_heard():
    """A remote proposer whose drafts never arrive in time is asked `probe_every` times, then
    only in probes (every 8, 16, 32 steps), however good its drafts would be; a probe whose
    draft is verified makes it a source like any other again."""
    c = late_model()
    ks = ask_unheard(c, "remote", 200)
    best = ks[0]
    assert best > 0 and ks[:c.probe_every] == [best] * c.probe_every  # while it might be in time
    asked = [i for i, k in enumerate(ks) if k]
    later = asked[c.probe_every:]
    assert 0 < len(later) <= 9 and all(ks[i] == c.probe_length() for i in later)
    gaps = [b - a for a, b in zip(later, later[1:], strict=False)]
    assert gaps[-2:] == [c.max_probe_every] * 2  # probes back off while unheard
    while not c.choose_k("remote"):  # the next probe
        pass
    c.record_acceptance(c.probe_length(), c.probe_length(), "remote")  # heard, and right
    assert c.choose_k("remote") >= best


def test_lateness_is_recorded_but_a_new_generation_asks_the_source_again():
    """Whether a proposer's drafts are in time depends on the text (a far ngram proposer is
    late on open-ended answers, in time on ones that copy their prompt), so the next
    generation asks a late source from its first step; the engine's record still says it was
    late (what lets a late EAGLE head sit out generations) until one of its drafts is heard."""
    c = late_model()
    ask_unheard(c.fork(), "remote", 2 * c.probe_every)
    assert c.is_late("remote")
    c.start_generation()
    g = c.fork()
    assert g.choose_k("remote") > 0
    g.record_acceptance(3, 1, "remote")
    assert not c.is_late("remote") and not c.is_late("other")


def test_an_in_process_source_with_nothing_to_offer_is_never_late():
    """A source that does not stream (the grammar's forced tokens, an in-process lookup) and
    had nothing to offer was empty-handed, not late: it is still asked every step, so a
    forced token or a match is taken the step it appears."""
    c = late_model()
    ks = ask_unheard(c, "grammar", 100, streams=False)
    assert all(k > 0 for k in ks) and not c.is_late("grammar")


def test_the_records_of_sources_stay_bounded_as_proposers_come_and_go(monkeypatch):
    """A verifier meets proposers for as long as it runs, each restart under a new name: its
    shared records (acceptance over generations, draft costs, deliveries, lateness) keep the
    `MAX_RECORDS` most recently updated keys, and a kept source's record is what it learnt."""
    monkeypatch.setattr(cost_mod, "MAX_RECORDS", 50)
    c = late_model()
    for i in range(200):
        g = c.fork()
        late, heard = f"far-{i}", f"near-{i}"
        ask_unheard(g, late, 2 * c.probe_every)  # late: its drafts never came in time
        g.record_acceptance(4, 2, heard)
        g.record_draft(4, 0.001, heard)
        g.record_delivered(heard, 4, 4)
    for record in (c._longrun, c._draft, c._delivered, c._late):
        assert 0 < len(record) <= 50
    assert c.is_late("far-199") and not c.is_late("far-0")  # (forgotten: asked again)
    assert "near-0" not in c._draft and "near-199" in c._draft
    assert c._longrun["near-199"][1] > 0  # the newest is kept, with what it learnt
