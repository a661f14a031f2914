"""RemoteDraftSession against real proposers on the bus, honest and misbehaving."""

import time

import numpy as np
import pytest

from bus.streams import StreamServer
from codec.messages import make
from nodes.drafters.ngram import NgramDrafter
from nodes.engine.sampling import SamplingParams
from nodes.roles.proposer import ProposerRole
from nodes.roles.remote_draft import DeadlinePolicy, ProposerLink, RemoteDraftSession
from tests.nodes.conftest import BusHost

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
POLICY = DeadlinePolicy(first_s=0.3, max_s=0.3, max_failures=3)


def session(host, links, **kw):
    return RemoteDraftSession(host.client, links, PROMPT, SamplingParams(), session_id="t1",
                              vocab_size=100, fingerprint="fp", policy=POLICY, **kw)


@pytest.fixture
def honest(bus):
    h = BusHost(*bus, node_id="honest")
    role = ProposerRole(NgramDrafter(), vocab_size=100)
    role.attach(h)
    yield h
    role.close()


def test_drafts_flow_and_acceptance_is_learnt(host, honest):
    link = ProposerLink("honest", honest.server.endpoint)
    s = session(host, [link])
    ids, probs = s.draft(3)
    assert ids.tolist() == [7, 8, 5] and probs is None
    s.extend([7, 8, 9])  # verifier accepted 2 of 3, then corrected
    assert (link.accepted, link.verified) == (2, 3)
    ids, _ = s.draft(2)  # "... 7 8 9": no earlier "9" -> falls back to shorter n-grams
    assert link.drafts == 2 and link.net_s is not None
    s.close()


def test_silent_proposer_costs_at_most_the_deadline_then_is_dropped(host, bus):
    silent = StreamServer(*bus, handler=lambda req: None)
    link = ProposerLink("silent", silent.endpoint)
    s = session(host, [link])
    for _ in range(3):
        t0 = time.monotonic()
        ids, _ = s.draft(4)
        assert ids.size == 0
        assert time.monotonic() - t0 < POLICY.max_s + 0.15
    assert link.timeouts == 3 and s.deadline_misses == 3
    t0 = time.monotonic()
    assert s.draft(4)[0].size == 0  # dropped: no waiting any more
    assert time.monotonic() - t0 < 0.01


def garbage_server(bus, reply):
    return StreamServer(*bus, handler=lambda req: req.reply(reply(req)))


@pytest.mark.parametrize("bad", [
    lambda req: make("draft_reply", committed=0, tensors=[np.array([1], np.int32)]),  # wrong pos
    lambda req: make("draft_reply", committed=req.message["committed"], session="other",
                     tensors=[np.array([1], np.int32)]),  # wrong session
    lambda req: make("draft_reply", committed=req.message["committed"],
                     tensors=[np.array([1, 2, 3, 4, 5, 6, 7], np.int32)]),  # more than k
    lambda req: make("draft_reply", committed=req.message["committed"],
                     tensors=[np.array([1, 99999], np.int32)]),  # another tokenizer's ids
    lambda req: make("pong"),  # wrong type
])
def test_wrong_replies_are_ignored_and_counted(host, bus, honest, bad):
    liar = garbage_server(bus, bad)
    bad_link = ProposerLink("liar", liar.endpoint)
    good_link = ProposerLink("honest", honest.server.endpoint)
    s = session(host, [bad_link, good_link])
    ids, _ = s.draft(3)
    assert ids.tolist() == [7, 8, 5]  # the honest proposer's draft wins
    assert bad_link.bad_replies + bad_link.errors == 1


def test_dead_in_membership_is_skipped_without_waiting(host, bus):
    silent = StreamServer(*bus, handler=lambda req: None)
    s = session(host, [ProposerLink("gone", silent.endpoint)], is_alive=lambda nid: False)
    t0 = time.monotonic()
    assert s.draft(4)[0].size == 0
    assert time.monotonic() - t0 < 0.01


def test_deadline_adapts_to_measured_round_trips():
    link = ProposerLink("p", "tcp://x")
    policy = DeadlinePolicy(first_s=0.5, min_s=0.004, max_s=0.5)
    assert link.deadline(4, policy) == 0.5
    link.observe(rtt=0.002, drafting=0.001, k=4)
    assert link.deadline(4, policy) == pytest.approx(2 * (0.001 + 0.00025 * 4) + 0.003)
    link.observe(rtt=5.0, drafting=0.0, k=4)
    assert link.deadline(4, policy) == 0.5  # capped


def _hopeless_link(endpoint):
    """A proposer measured slow and never right: the adaptive verifier would not ask it."""
    link = ProposerLink("honest", endpoint)
    link.net_s, link.per_token_s, link.tokens_per_reply = 0.4, 0.01, 3.0
    link.recent_accepted, link.recent_verified = 0.0, 100.0
    return link


def test_forced_session_asks_every_block_even_a_hopeless_proposer(host, honest):
    generous = DeadlinePolicy(first_s=5.0, max_s=5.0, max_failures=3)
    adaptive = RemoteDraftSession(host.client, [_hopeless_link(honest.server.endpoint)], PROMPT,
                                  SamplingParams(), session_id="a1", vocab_size=100,
                                  fingerprint="fp", policy=generous)
    assert adaptive.draft(3)[0].size == 0  # judged not worth asking: nothing sent
    assert adaptive.stats()["honest"]["drafts"] == 0
    adaptive.close()

    link = _hopeless_link(honest.server.endpoint)
    forced = RemoteDraftSession(host.client, [link], PROMPT, SamplingParams(), session_id="f1",
                                vocab_size=100, fingerprint="fp", policy=generous, forced=True)
    for block in range(4):
        ids, _ = forced.draft(3)
        assert len(ids) >= 1, block
        forced.extend(ids.tolist()[:1] + [5])
    assert forced.stats()["honest"]["drafts"] == 4
    assert forced.stats()["honest"]["timeouts"] == 0
    forced.close()


def test_forced_wait_gives_up_on_a_proposer_that_dies_meanwhile(host, bus):
    """Forced waits are long (30 s here); a proposer leaving the alive state ends them."""
    silent = StreamServer(*bus, handler=lambda req: None)
    asked = []
    link = ProposerLink("dying", silent.endpoint)
    s = RemoteDraftSession(host.client, [link], PROMPT, SamplingParams(), session_id="d1",
                           vocab_size=100, fingerprint="fp", forced=True,
                           policy=DeadlinePolicy(first_s=30.0, max_s=30.0, forced_s=30.0),
                           is_alive=lambda nid: asked.append(nid) or len(asked) < 5)
    assert s.draft(4)[0].size == 0
    assert s.stats()["dying"]["dropped"] is True
    assert (link.errors, link.timeouts) == (1, 0)  # abandoned, never waited out
