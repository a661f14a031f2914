"""The draft-length controller: speculate when it pays, plain steps when it does not."""

from __future__ import annotations

from nodes.engine.adaptive import DraftLengthController


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
    c = DraftLengthController(max_k=16)
    ks = feed(c, lambda n: 0.058 + 0.0046 * (n - 1), lambda i: True)
    assert min(ks[20:]) >= 12


def test_useless_drafts_turn_speculation_off_with_backoff():
    c = DraftLengthController(max_k=16)
    ks = feed(c, lambda n: 0.058 + 0.0046 * (n - 1), lambda i: False, blocks=400)
    spec = [i for i, k in enumerate(ks) if k]
    assert len(spec) < 20  # a few early tries, then rare probes
    gaps = [b - a for a, b in zip(spec[-4:-1], spec[-3:], strict=True)]
    assert all(g >= 32 for g in gaps)  # probes back off


def test_linear_cost_never_pays():
    # verifying n tokens costs n times one token: drafts accepted half the time cannot pay
    c = DraftLengthController(max_k=8)
    ks = feed(c, lambda n: 0.05 * n, lambda i: i % 2 == 0, blocks=300)
    assert sum(1 for k in ks[50:] if k) < 15


def test_expensive_drafter_is_turned_down():
    c = DraftLengthController(max_k=8)
    for _ in range(5):
        c.record_draft(4, 4 * 0.2)  # 200 ms per drafted token vs 58 ms verify
    ks = feed(c, lambda n: 0.058 + 0.0046 * (n - 1), lambda i: True, blocks=100)
    assert sum(1 for k in ks if k) < 20


def test_new_generation_forgets_acceptance_keeps_costs():
    c = DraftLengthController(max_k=16)
    feed(c, lambda n: 0.05 + 0.002 * n, lambda i: False, blocks=50)
    assert c.acceptance < 0.05
    learnt = c.verify_cost(5)
    c.start_generation()
    assert c.acceptance == c.prior_acceptance
    assert c.verify_cost(5) == learnt
