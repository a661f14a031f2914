"""The verifier's side of protocol 2 (`ProposerSource`) against a scripted proposer on a real
ROUTER: stale, reordered, duplicated, lying and flooding chunks; commits pushed, never waited.

The scripted proposer answers `session_open` by keeping the request; the test streams chunks on
it. The source runs on the test thread (it owns its DirectClient). No verdict depends on timing:
each check first waits (bounded) until the source has read what was sent.
"""

from __future__ import annotations

import functools
import queue
import time

import numpy as np
import pytest

from codec.messages import make
from nodes.engine.sampling import SamplingParams
from nodes.engine.sources import Feedback
from nodes.verifier.proposer_client import DraftPolicy, ProposerLink, ProposerSource

PROMPT = [1, 2, 3, 4]
VOCAB = 100


class ScriptedProposer:
    """Keeps each session_open (to stream chunks on) and records every pushed commit."""

    def __init__(self, host):
        self.host = host
        self.streams: queue.Queue = queue.Queue()
        self.commits: queue.Queue = queue.Queue()
        self.extends: list = []  # every session_extend message, in order
        host.register_request("session_open", self.streams.put)
        host.register_request("session_extend", self._commit)
        host.register_request("session_close",
                              lambda req: req.reply(make("done", finish_reason="closed")))

    def _commit(self, req):
        self.extends.append(req.message)  # before the put a test waits on
        self.commits.put((req.message["committed"], req.message.tensors[0].tolist()))
        req.reply(make("done", finish_reason="extended"))

    def chunk(self, req, base, tokens, session=None):
        req.reply(make("draft_chunk", session=session or req.message.session, base=base,
                       tensors=[np.asarray(tokens, dtype=np.int32)]), more=True)

    def tree(self, req, chunk):
        req.reply(chunk.to_message(), more=True)


@pytest.fixture
def scripted(host):
    return ScriptedProposer(host)


@pytest.fixture
def make_source(host, scripted):
    made = []

    def make_(policy=None, alive=lambda node_id: True, forced=False):
        policy = policy or DraftPolicy()
        link = ProposerLink("p1", host.server.endpoint, "scripted")
        client = link.direct(host.factory, "verifier", policy.max_queued)
        src = ProposerSource(link, client, PROMPT, SamplingParams(), session_id="s1",
                             vocab_size=VOCAB, fingerprint="fp", max_draft=8, policy=policy,
                             is_alive=alive, forced=forced)
        req = scripted.streams.get(timeout=10)
        made.append(link)
        return src, req

    yield make_
    for link in made:
        link.close()


def read_until_nonwaiting(src, cond, limit_s=10.0):
    """Like `read_until`, with the non-waiting reads a step makes (sleeping in between)."""
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, ("the source never read what was sent", src.link)
        time.sleep(0.02)
        src._drain(0)


def read_until(src, cond, limit_s=10.0):
    """Let the source read replies until `cond()` holds (bounded; a hang fails, not a race)."""
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, ("the source never read what was sent", src.link)
        src._drain(0.05)


def one_step(src, tokens, budget=0):
    """One engine step as a source sees it: asked for `budget` drafts, then one more token
    (numbered past the prompt) committed and fed back."""
    src.propose(tokens, budget)
    tokens.append(len(tokens) + 10)
    src.feedback(Feedback(committed=(tokens[-1],), committed_len=len(tokens), offered=0,
                          accepted=0))


def offered(src, committed, budget=8):
    return src.propose(committed, budget).chain_tokens.tolist()


def test_freshest_chunk_that_extends_the_prefix_is_offered(make_source, scripted):
    src, req = make_source()
    scripted.chunk(req, 4, [5, 6, 7])
    read_until(src, lambda: src.link.chunks == 1)
    assert offered(src, PROMPT) == [5, 6, 7]
    assert offered(src, PROMPT, budget=2) == [5, 6]
    # the verifier committed 5 6 (its own check): the same chunk still extends the prefix
    assert offered(src, PROMPT + [5, 6]) == [7]


def test_a_tree_chunk_offers_every_alternative_that_still_extends_the_prefix(
        make_source, scripted):
    from codec.structs import DraftChunk

    src, req = make_source()
    # chain 5 6 7 after the prompt; alternatives: 8 for the 5, 9 then 10 for the 6, 11 for 7
    scripted.tree(req, DraftChunk("s1", 4, np.array([5, 6, 7]), 1,
                                  alt_tokens=np.array([8, 9, 10, 11]),
                                  alt_parents=np.array([-1, 0, 4, 1]),
                                  conf=np.array([0.6, 0.5, 0.9]),
                                  alt_conf=np.array([0.3, 0.2, 0.8, 0.1])))
    read_until(src, lambda: src.link.chunks == 1)
    paths = src.propose(PROMPT, 8).path_tokens()
    assert [t.tolist() for t, _ in paths] == [[5, 6, 7], [8], [5, 9, 10], [5, 6, 11]]
    assert [np.round(c.astype(float), 3).tolist() for _, c in paths] == [
        [0.6, 0.5, 0.9], [0.3], [0.6, 0.2, 0.8], [0.6, 0.5, 0.1]]
    assert src.proposed == 3  # the first candidate (the chain) is counted as its draft
    # the verifier committed 5: the alternative to it is dead, the others lose their 5
    paths = src.propose(PROMPT + [5], 8).path_tokens()
    assert [t.tolist() for t, _ in paths] == [[6, 7], [9, 10], [6, 11]]
    # ... it committed 5 9 (the runner-up): the branch through 9 lives on, the chain does not
    assert [t.tolist() for t, _ in src.propose(PROMPT + [5, 9], 8).path_tokens()] == [[10]]
    assert src.link.stale == 0
    # ... it committed 5 9 4: nothing extends that; stale, dropped, counted
    assert not len(src.propose(PROMPT + [5, 9, 4], 8)) and src.best is None
    assert src.link.stale == 1


def test_stale_reordered_and_duplicated_chunks(make_source, scripted):
    src, req = make_source()
    scripted.chunk(req, 4, [5, 6, 7])
    scripted.chunk(req, 4, [5, 6, 7])  # duplicated
    scripted.chunk(req, 6, [9, 9])  # based on a commit the verifier has not made... yet
    read_until(src, lambda: src.link.chunks + src.link.bad_replies == 3)
    assert src.link.bad_replies == 1  # base 6 > 4 committed: impossible, counted
    src.failures = 0
    # the commit disagrees with what the chunk assumed (8, not 5): stale, dropped, counted
    assert offered(src, PROMPT + [8]) == []
    assert src.link.stale == 1
    src.feedback(Feedback(committed=(8,), committed_len=5, offered=0, accepted=0))
    # a fresher chunk (base 5), then an older one arriving late (reordered): the fresher wins
    scripted.chunk(req, 5, [3, 3])
    scripted.chunk(req, 4, [8, 1, 1])
    read_until(src, lambda: src.link.chunks == 4)
    assert offered(src, PROMPT + [8]) == [3, 3]
    assert not src.dropped


@pytest.mark.parametrize("lie", ["wrong_session", "other_tokenizer", "wrong_position"])
def test_lying_chunks_are_counted_and_the_proposer_dropped(make_source, scripted, lie):
    src, req = make_source()
    for _ in range(3):
        if lie == "wrong_session":
            scripted.chunk(req, 4, [5], session="not-yours")
        elif lie == "other_tokenizer":
            scripted.chunk(req, 4, [10**6])
        else:
            scripted.chunk(req, 11, [5])
    read_until(src, lambda: src.link.bad_replies == 3)
    assert src.dropped and src.link.chunks == 0
    assert offered(src, PROMPT) == []


def test_commits_are_pushed_with_their_delta_and_never_waited_for(make_source, scripted):
    src, req = make_source()
    src.propose(PROMPT, 8)
    src.feedback(Feedback(committed=(5, 6), committed_len=6, offered=0, accepted=0))
    src.feedback(Feedback(committed=(7,), committed_len=7, offered=0, accepted=0))
    assert scripted.commits.get(timeout=10) == (6, [5, 6])
    assert scripted.commits.get(timeout=10) == (7, [7])
    read_until(src, lambda: not src.commits)  # the replies: round trips, no error
    assert src.link.errors == 0 and src.link.net_s is not None


def test_an_idle_source_holds_its_commits_until_asked_or_every_n_steps(make_source, scripted):
    """Not asked for drafts `idle_after` steps in a row (budget 0), a source pushes its commits
    together: when asked again (with the whole delta, so the proposer catches up) or after
    `idle_push_every` steps' worth of tokens, whichever comes first. It pushes every commit
    again once asked with something to offer."""
    src, req = make_source(DraftPolicy(idle_after=2, idle_push_every=4))
    tokens = list(PROMPT)

    step = functools.partial(one_step, src, tokens)

    step(0)
    assert scripted.commits.get(timeout=10) == (5, [14])
    for _ in range(3):
        step(0)  # idle from the second on: held
    assert scripted.commits.empty()
    step(0)  # 4 steps' worth held: pushed together
    assert scripted.commits.get(timeout=10) == (9, [15, 16, 17, 18])
    step(0)
    assert scripted.commits.empty()
    src.propose(tokens, 8)  # asked again: what was held goes at once
    assert scripted.commits.get(timeout=10) == (10, [19])
    step(8)  # asked, with nothing to offer (a probe of a late source): it stays quiet
    assert scripted.commits.empty()
    scripted.chunk(req, 11, [30, 31])
    read_until(src, lambda: src.link.chunks == 1)
    step(8)  # asked and heard: the held commit goes at once, and every commit after it
    assert scripted.commits.get(timeout=10) == (11, [20])
    assert scripted.commits.get(timeout=10) == (12, [21])


def test_a_quiet_source_shows_no_round_trip_from_its_late_reads(make_source, scripted):
    """A quiet source reads a commit's answer only when it next pushes, `idle_push_every`
    steps on: that time is how seldom it reads, not the path, so the round trip shown stays
    unknown (an int8 proposer on loopback showed 162 ms), while the horizon is still sized by
    every reading. Read every step again (asked and heard), it times its answers."""
    src, req = make_source(DraftPolicy(idle_after=1, idle_push_every=4))
    tokens = list(PROMPT)

    step = functools.partial(one_step, src, tokens)

    for _ in range(8):  # quiet from the first commit: two pushes of four
        step()
    assert scripted.commits.get(timeout=10) == (8, [14, 15, 16, 17])
    assert scripted.commits.get(timeout=10) == (12, [18, 19, 20, 21])
    read_until_nonwaiting(src, lambda: not src.commits)  # both answers, read as it reads
    assert src.link.net_s is not None
    assert src.link.timed_s is None and src.stats()["rtt_ms"] is None
    assert src.link.as_dict()["rtt_ms"] is None
    scripted.chunk(req, 12, [30, 31])
    read_until_nonwaiting(src, lambda: src.link.chunks == 1)
    step(8)  # asked and heard: every commit goes at once and is read the next step
    step(8)
    read_until_nonwaiting(src, lambda: not src.commits)
    assert src.link.timed_s is not None and src.stats()["rtt_ms"] is not None


@pytest.mark.parametrize("draft_tok_s", [1e-6, 1e9, None])
def test_a_proposer_drafting_slower_than_the_verifier_commits_is_asked_for_nothing(
        make_source, scripted, host, draft_tok_s):
    """A proposer whose card says it drafts slower than this verifier commits (pinned here:
    a millionth of a token a second, against a test's steps microseconds apart) can never
    have a draft in time: it is pushed a horizon of 0 (it follows the commits, drafting
    nothing), asked for drafts it offers none and announces none to wait for, and the next
    generation opens its session with a horizon of 0. A fast one, or one whose card does not
    say, drafts ahead and is asked as before."""
    src, req = make_source(DraftPolicy(idle_after=1, idle_push_every=2))
    src.link.draft_tok_s = draft_tok_s
    lags = draft_tok_s == 1e-6
    tokens = list(PROMPT)

    step = functools.partial(one_step, src, tokens)

    for _ in range(5):  # quiet from the first step: pushes of two steps' worth, one held
        step(0)
    assert scripted.commits.get(timeout=10) == (6, [14, 15])
    assert scripted.commits.get(timeout=10) == (8, [16, 17])
    assert src.lags() is lags and src.link.lags is lags
    for push in scripted.extends:  # step time is known from the second step's feedback on
        assert push["horizon"] == 0 if lags else push["horizon"] >= src.policy.min_horizon
    scripted.chunk(req, 8, [30, 31])
    read_until_nonwaiting(src, lambda: src.link.chunks == 1)
    offer = src.propose(tokens, 8).chain_tokens.tolist()  # asked: a probe
    if lags:  # nothing offered, nothing pushed, nothing to wait for
        assert offer == [] and src.expected_wait() is None
        time.sleep(0.2)  # (a push would be on its way: none may come)
        assert scripted.commits.empty()
    else:  # what it has, and the held commit at once, with a whole horizon
        assert scripted.commits.get(timeout=10) == (9, [18])
        assert scripted.extends[-1]["horizon"] >= src.policy.min_horizon
    src.close()
    nxt = ProposerSource(src.link, src.client, PROMPT, SamplingParams(), session_id="s2",
                         vocab_size=VOCAB, fingerprint="fp", max_draft=8)
    opening = scripted.streams.get(timeout=10)
    assert (opening.message["horizon"] == 0) is lags
    nxt.close()


def test_an_idle_eagle_source_holds_its_hidden_states_with_its_commits(host, scripted):
    """A source reading the verifier's hidden states (an EAGLE-3 head) holds them with its
    commits while idle and sends them with the commits, every row in order (its head needs
    the features of every cached position)."""
    import torch

    from codec.structs import SessionExtend

    policy = DraftPolicy(idle_after=1, idle_push_every=3)
    link = ProposerLink("p1", host.server.endpoint, "scripted", hidden_layers=(1, 2))
    src = ProposerSource(link, link.direct(host.factory, "verifier", policy.max_queued), PROMPT,
                         SamplingParams(), session_id="s1", vocab_size=VOCAB, fingerprint="fp",
                         max_draft=8, policy=policy)
    try:
        scripted.streams.get(timeout=10)
        tokens, sent = list(PROMPT), []
        for i in range(7):  # never asked: idle from the second step
            src.propose(tokens, 0)
            rows = torch.full((2, 2, 3), float(i)) + torch.arange(2.0).view(2, 1, 1) / 4
            sent.append(rows)
            tokens += [50 + 2 * i, 51 + 2 * i]
            src.feedback(Feedback(committed=tuple(tokens[-2:]), committed_len=len(tokens),
                                  offered=0, accepted=0, hidden=rows))
        src.propose(tokens, 8)  # asked: what is held goes at once
        read_until(src, lambda: len(scripted.extends) == scripted.commits.qsize() and
                   sum(len(m.tensors[0]) for m in scripted.extends) == 14)
        pushes = [SessionExtend.from_message(m) for m in scripted.extends]
        assert 1 < len(pushes) < 7  # held: fewer pushes than steps
        assert np.concatenate([p.tokens for p in pushes]).tolist() == tokens[len(PROMPT):]
        assert all(len(p.hidden_rows) == len(p.tokens) for p in pushes)
        rows = np.concatenate([p.hidden_rows for p in pushes])
        assert np.array_equal(rows, torch.cat(sent).reshape(14, 6).numpy().astype(np.float16))
    finally:
        link.close()


def test_a_flooding_proposer_is_dropped_and_counted(make_source, scripted):
    src, req = make_source(DraftPolicy(max_chunks_per_step=16))
    for i in range(40):
        scripted.chunk(req, 4, [5] * (i % 5 + 1))
    read_until(src, lambda: src.dropped)
    assert src.link.flooded == 1
    assert offered(src, PROMPT) == []


def test_buffered_chunks_are_bounded(make_source, scripted):
    """Past the client's per-call queue, chunks are dropped and the proposer counted a flood."""
    src, req = make_source(DraftPolicy(max_queued=8, max_chunks_per_step=10**6))
    for _ in range(200):
        scripted.chunk(req, 4, [5])
    read_until(src, lambda: src.dropped)
    assert src.link.flooded == 1 and src.stream.overflowed >= 1
    assert src.link.chunks <= 200


def test_forced_waits_for_a_chunk_and_gives_up_on_a_dead_proposer(make_source, scripted):
    src, req = make_source(forced=True)
    scripted.chunk(req, 4, [5, 6])
    assert offered(src, PROMPT) == [5, 6]  # waited (bounded) for it
    alive = {"p1": True}
    src2, _ = make_source(forced=True, alive=lambda node_id: alive[node_id])
    alive["p1"] = False
    assert offered(src2, PROMPT) == []
    assert src2.dropped


def test_the_chunk_answering_a_commit_is_announced_and_can_be_waited_for(make_source, scripted):
    src, req = make_source()
    assert src.expected_wait() is None  # nothing pushed
    src.feedback(Feedback(committed=(8,), committed_len=5, offered=0, accepted=0))
    # pushed, but no chunk has ever answered one: the first-wait guess, so a wait can be tried
    assert 0 <= src.expected_wait() <= src.policy.first_wait_s
    scripted.chunk(req, 5, [3, 3])
    read_until(src, lambda: src.awaiting is None)  # a waiting read: timed
    assert src.link.fresh_s is not None and src.link.fresh_s >= 0  # push -> answer, measured
    assert offered(src, PROMPT + [8]) == [3, 3]
    src.feedback(Feedback(committed=(3, 3), committed_len=7, offered=2, accepted=2))
    due = src.expected_wait()
    assert due is not None and 0 <= due <= src.link.fresh_s  # announced
    assert scripted.commits.get(timeout=10)[0] == 5
    assert scripted.commits.get(timeout=10)[0] == 7
    scripted.chunk(req, 7, [4, 4, 4])
    assert src.wait(30.0)  # bounded; returns as soon as the answer is in
    assert src.expected_wait() is None
    assert offered(src, PROMPT + [8, 3, 3]) == [4, 4, 4]
    # an answer that does not come: the wait gives up at its bound, the source stays usable
    src.feedback(Feedback(committed=(4,), committed_len=8, offered=3, accepted=1))
    assert not src.wait(0.2) and not src.dropped
    assert src.link.fresh_s >= 0.2  # it takes at least that long: the next wait is no shorter
    assert src.expected_wait() is not None


def test_an_answer_read_a_step_late_is_not_timed(make_source, scripted):
    """The chunk answering a commit found by the next step's non-waiting read arrived some time
    during the verify: timing it then would announce every wait a verify long."""
    src, req = make_source()
    src.feedback(Feedback(committed=(8,), committed_len=5, offered=0, accepted=0))
    scripted.chunk(req, 5, [3, 3])
    scripted.chunk(req, 5, [3, 3, 3])  # the last of what was sent: read, so both were read
    read_until_nonwaiting(src, lambda: src.best is not None and len(src.best.tokens) == 3)
    assert src.awaiting is None  # answered ...
    assert src.link.fresh_s is None  # ... but not timed


def test_two_generations_on_one_link_each_get_their_own_chunks(host, scripted):
    """A batch runs several generations with the same proposer: their sources share the
    link's client, so whichever reads hands the other its replies (issue 24: a batch of
    forced generations hung, each source having read and dropped the other's chunks)."""
    policy = DraftPolicy()
    link = ProposerLink("p1", host.server.endpoint, "scripted")
    try:
        client = link.direct(host.factory, "verifier", policy.max_queued)
        a = ProposerSource(link, client, PROMPT, SamplingParams(), session_id="sa",
                           vocab_size=VOCAB, fingerprint="fp", max_draft=8, policy=policy,
                           forced=True)
        req_a = scripted.streams.get(timeout=10)
        b = ProposerSource(link, client, [7, 8], SamplingParams(), session_id="sb",
                           vocab_size=VOCAB, fingerprint="fp", max_draft=8, policy=policy,
                           forced=True)
        req_b = scripted.streams.get(timeout=10)
        scripted.chunk(req_b, 2, [9, 10])
        scripted.chunk(req_a, 4, [5, 6])
        # a waits for its own chunk, reading b's on the way; b then finds its chunk unread
        assert offered(a, PROMPT) == [5, 6]
        read_until(a, lambda: bool(b.inbox) or b.best is not None)
        assert offered(b, [7, 8]) == [9, 10]
        assert a.link.bad_replies == 0 and not a.dropped and not b.dropped
        a.close()
        assert all(owner is b for owner in link.calls.values())  # a's calls forgotten
        b.close()
        assert not link.calls
    finally:
        link.close()


def test_each_generation_counts_only_its_own_share_of_the_link(host, scripted):
    """`done` stats name what the proposer did for that generation, not for its batch-mates
    (the gateway adds them up per proposer); the link keeps the sum."""
    policy = DraftPolicy()
    link = ProposerLink("p1", host.server.endpoint, "scripted")
    try:
        client = link.direct(host.factory, "verifier", policy.max_queued)
        srcs, reqs = [], []
        for sid in ("sa", "sb"):
            srcs.append(ProposerSource(link, client, PROMPT, SamplingParams(), session_id=sid,
                                       vocab_size=VOCAB, fingerprint="fp", max_draft=8,
                                       policy=policy))
            reqs.append(scripted.streams.get(timeout=10))
        a, b = srcs
        scripted.chunk(reqs[0], 4, [5, 6, 7])
        read_until(a, lambda: a.best is not None)
        assert offered(a, PROMPT) == [5, 6, 7]
        a.feedback(Feedback(committed=(5, 6, 9), committed_len=7, offered=3, accepted=2))
        assert a.stats()["drafts"] == 1 and a.stats()["accepted"] == 2
        assert a.stats()["chunks"] == 1 and a.stats()["acceptance"] == 0.6667
        assert b.stats()["drafts"] == 0 and b.stats()["chunks"] == 0
        assert link.drafts == 1 and link.chunks == 1
        for src in srcs:
            src.close()
    finally:
        link.close()


def test_a_generation_dropping_a_proposer_keeps_it_for_its_batch_mates(host, scripted):
    """Issue 24: a generation that drops its proposer (here: its session answered with a
    fatal error) used to close the link's connection, failing every batch-mate's session on
    it too. Now only its own stream is cancelled while a batch-mate still reads the connection;
    the last one to drop closes it."""
    policy = DraftPolicy()
    link = ProposerLink("p1", host.server.endpoint, "scripted")
    try:
        client = link.direct(host.factory, "verifier", policy.max_queued)
        a = ProposerSource(link, client, PROMPT, SamplingParams(), session_id="sa",
                           vocab_size=VOCAB, fingerprint="fp", max_draft=8, policy=policy)
        req_a = scripted.streams.get(timeout=10)
        b = ProposerSource(link, client, [7, 8], SamplingParams(), session_id="sb",
                           vocab_size=VOCAB, fingerprint="fp", max_draft=8, policy=policy)
        req_b = scripted.streams.get(timeout=10)
        req_a.fail("out_of_sync", "session sa lost its place")
        read_until(a, lambda: a.dropped)
        assert a.stream.done and not b.stream.done  # a's stream is over, b's is not
        assert host.server.endpoint in client.peers  # the connection stays for b
        scripted.chunk(req_b, 2, [9, 10])
        read_until(b, lambda: b.best is not None)
        assert offered(b, [7, 8]) == [9, 10] and not b.dropped
        b.feedback(Feedback(committed=(9,), committed_len=3, offered=2, accepted=1))
        assert scripted.commits.get(timeout=10) == (3, [9])  # b's commits still go out
        b._drop("test: the last reader drops it")
        assert host.server.endpoint not in client.peers  # now the connection is closed
        a.close()
        b.close()
    finally:
        link.close()


def test_a_chunks_classes_name_the_draft_past_the_prefix_and_are_bounded(
        make_source, scripted):
    """The class of the first token past the committed prefix is the step's class; a chunk
    that does not extend the prefix names none; a proposer naming more classes than
    MAX_CLASSES gets the rest judged unclassed (the cost model's estimates stay bounded)."""
    from codec.structs import DraftChunk
    from nodes.verifier.proposer_client import MAX_CLASSES

    src, req = make_source()
    assert src.draft_class(PROMPT) is None  # nothing came yet
    scripted.tree(req, DraftChunk("s1", 4, np.array([5, 6, 7]), 1,
                                  classes=("m1", "", "m5")))
    read_until(src, lambda: src.link.chunks == 1)
    assert src.draft_class(PROMPT) == "m1"
    assert src.draft_class(PROMPT + [5]) is None  # "": the drafter named none there
    assert src.draft_class(PROMPT + [5, 6]) == "m5"
    assert src.draft_class(PROMPT + [5, 6, 7]) is None  # nothing drafted past it
    assert src.draft_class(PROMPT + [9]) is None  # the chunk does not extend the prefix
    labels = tuple(f"c{i}" for i in range(MAX_CLASSES + 4))
    scripted.tree(req, DraftChunk("s1", 4, np.arange(10, 10 + len(labels)), 2,
                                  classes=labels))
    read_until(src, lambda: src.link.chunks == 2)
    seen = [src.draft_class(PROMPT + list(range(10, 10 + i))) for i in range(len(labels))]
    assert len({s for s in seen if s is not None} | {"m1", "m5"}) == MAX_CLASSES
    assert seen[-1] is None and len(src.link.classes) == MAX_CLASSES


def test_a_late_eagle_or_lagging_proposer_sits_out_generations_then_drafts_in_one():
    """A proposer reading hidden states, or drafting slower than the verifier commits, whose
    drafts came too late sits out `every` generations in a row, then drafts in one (where the
    engine probes it); any other, or one not late, never sits out."""
    eagle = ProposerLink("e", "tcp://127.0.0.1:1", "eagle", hidden_layers=(1, 2))
    assert [eagle.sits_out(True, every=3) for _ in range(8)] == [
        True, True, True, False, True, True, True, False]
    assert not eagle.sits_out(False, every=3) and eagle.sat_out == 0
    ngram = ProposerLink("n", "tcp://127.0.0.1:2", "ngram")
    assert not any(ngram.sits_out(True) for _ in range(8))
    # a proposer drafting slower than the verifier commits sits out as an EAGLE head does;
    # a late one that keeps up (a far ngram proposer: the next prompt may be one it copies)
    # never does
    int8 = ProposerLink("i", "tcp://127.0.0.1:3", "int8", lags=True)
    assert [int8.sits_out(True, every=2) for _ in range(6)] == [True, True, False] * 2
    assert not int8.sits_out(False, every=2)
    assert eagle.source_name == "remote:eagle" and ProposerLink("x", "").source_name == "remote:x"
