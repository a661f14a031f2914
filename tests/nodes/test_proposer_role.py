"""The proposer role over a real ROUTER (protocol 2): streamed drafts ahead, rollback on a
disagreeing commit, idempotent commits, leases, bad input."""

import time

import numpy as np
import pytest

from bus.streams import RemoteError
from codec.messages import make
from nodes.drafters.ngram import NgramDrafter
from nodes.proposer.role import ProposerRole

PROMPT = np.array([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], dtype=np.int32)


@pytest.fixture
def proposer(host):
    role = ProposerRole(NgramDrafter(), vocab_size=100, sweep_every=0.05)
    role.attach(host)
    yield role
    role.close()


def ask(host, msg, timeout=5.0):
    return host.client.request(host.server.endpoint, msg, timeout=timeout).result(timeout)


def open_stream(host, sid="s1", lease=5.0, prompt=PROMPT, horizon=6):
    """Open a session; its reply is the stream of draft chunks."""
    return host.client.request(host.server.endpoint,
                               make("session_open", session=sid, lease_s=lease,
                                    horizon=horizon, tensors=[prompt]), timeout=None)


def open_session(host, sid="s1", lease=5.0, prompt=PROMPT):
    """Open a session and check the first reply of its stream (not the end of it)."""
    call = open_stream(host, sid, lease, prompt)
    first = call.next(5.0)
    if first.type == "error":
        raise RemoteError(first["code"], first["message"])
    return first


def commit(host, sid, committed, delta=(), **fields):
    return ask(host, make("session_extend", session=sid, committed=committed, **fields,
                          tensors=[np.asarray(delta, dtype=np.int32)]))


def chunk_at(call, base, timeout=5.0):
    """The next chunk of the stream based on committed length `base` (older ones skipped)."""
    while True:
        msg = call.next(timeout)
        assert msg.type == "draft_chunk", msg.type
        if msg["base"] == base:
            return msg


def test_open_streams_a_draft_ahead_up_to_the_horizon(host, proposer):
    call = open_stream(host, horizon=6)
    chunks = [call.next(5.0)]
    while len(chunks[-1].tensors[0]) < 6:  # each chunk resends what it assumed, then more
        chunks.append(call.next(5.0))
    assert all(c.type == "draft_chunk" and c.session == "s1" for c in chunks)
    assert all(c["base"] == len(PROMPT) for c in chunks)
    # "... 5 6" -> the loop "5 6 7 8" -> 7 8 5 6 7 8 (the ngram copy goes on with the
    # period where it runs into the tip, or, chunk by chunk, on its own assumption)
    first = chunks[0].tensors[0].tolist()
    assert first and first == [7, 8, 5, 6, 7, 8][:len(first)]
    assert chunks[-1].tensors[0].tolist() == [7, 8, 5, 6, 7, 8]


def test_a_horizon_of_0_follows_the_commits_and_drafts_nothing(host, proposer):
    """What a verifier sends a proposer slower than its commits: each commit is answered (an
    empty chunk at the new base, so the verifier hears it) and nothing is drafted ahead, nor is
    a commit counted as a rollback (nothing was assumed); a later horizon drafts again."""
    call = open_stream(host, horizon=0)
    n = len(PROMPT)
    assert chunk_at(call, n).tensors[0].tolist() == []
    for k in (2, 4):
        commit(host, "s1", n + k, [7, 8], horizon=0)
        assert chunk_at(call, n + k).tensors[0].tolist() == []
    assert proposer.stats.draft_tokens == 0 and proposer.stats.rollbacks == 0
    commit(host, "s1", n + 5, [5], horizon=4)  # asked again: drafts from the commits
    got = chunk_at(call, n + 5).tensors[0].tolist()
    while len(got) < 4:
        got = chunk_at(call, n + 5).tensors[0].tolist()
    assert got[:3] == [6, 7, 8]  # "... 7 8 5" goes on as in the prompt
    assert proposer.stats.draft_tokens >= 4 and proposer.stats.rollbacks == 0


def test_commits_confirm_or_roll_back_and_are_idempotent(host, proposer):
    call = open_stream(host, horizon=4)
    n = len(PROMPT)
    assert chunk_at(call, n).tensors[0].tolist() == [7, 8, 5, 6]
    # a commit that agrees with the assumed draft: the draft goes on from there
    assert commit(host, "s1", n + 2, [7, 8])["finish_reason"] == "extended"
    assert chunk_at(call, n + 2).tensors[0].tolist() == [5, 6, 7, 8]
    # the same delta again: applied once
    commit(host, "s1", n + 2, [7, 8])
    # a commit that disagrees (9 instead of 5): rolled back, drafting continues from it
    commit(host, "s1", n + 3, [8, 9])  # overlapping: only 9 is new
    got = chunk_at(call, n + 3).tensors[0].tolist()
    assert got == [] or got[0] != 6  # "... 8 9" was never seen before 9: nothing to copy
    assert proposer.stats.rollbacks == 1
    # its own cumulative acceptance (issue 47): 7 8 confirmed (once), 9 was not its draft
    assert proposer.stats.confirmed == 2
    figures = proposer.stats.as_dict()
    assert figures["acceptance_cumulative"] == round(2 / proposer.stats.draft_tokens, 4)
    # a delta starting past what the session has: tokens are missing
    with pytest.raises(RemoteError) as info:
        commit(host, "s1", n + 10, [1])
    assert info.value.code == "out_of_sync"


def test_never_pads(host, proposer):
    call = open_stream(host, prompt=np.array([1, 2, 3], np.int32))
    assert call.next(5.0).tensors[0].tolist() == []


def test_unknown_session_and_bad_input_are_typed_errors(host, proposer):
    with pytest.raises(RemoteError) as info:
        commit(host, "nope", 3)
    assert info.value.code == "unknown_session"
    with pytest.raises(RemoteError) as info:
        ask(host, make("session_open", session="x", lease_s=-1.0, tensors=[PROMPT]))
    assert info.value.code == "bad_request"
    with pytest.raises(RemoteError) as info:
        ask(host, make("session_open", session="x", lease_s=5.0, horizon=10**6,
                       tensors=[PROMPT]))
    assert info.value.code == "bad_request"
    with pytest.raises(RemoteError) as info:
        ask(host, make("session_open", session="x", lease_s=5.0,
                       tensors=[np.array([1, 500], np.int32)]))
    assert "vocabulary" in info.value.message
    with pytest.raises(RemoteError) as info:
        ask(host, make("session_open", lease_s=5.0, tensors=[PROMPT]))  # no session id
    assert info.value.code == "bad_request"
    # still serving
    assert open_session(host, sid="ok").type == "draft_chunk"


def test_tokenizer_mismatch_is_refused(host):
    class Fixed(NgramDrafter):
        fingerprint = "aaaa"

    role = ProposerRole(Fixed(), vocab_size=100)
    role.attach(host)
    try:
        with pytest.raises(RemoteError) as info:
            ask(host, make("session_open", session="s", lease_s=5.0, tokenizer="bbbb",
                           tensors=[PROMPT]))
        assert info.value.code == "tokenizer_mismatch"
    finally:
        role.close()


def test_sessions_expire_after_their_lease(host, proposer):
    short = open_stream(host, sid="short", lease=0.2)
    open_session(host, sid="long", lease=30.0)
    short.next(5.0)
    end = short.result(10.0)  # the stream ends when the lease does
    assert end.type == "done" and end["finish_reason"] == "expired"
    assert proposer.stats.sessions_expired == 1
    with pytest.raises(RemoteError):
        commit(host, "short", len(PROMPT))


def test_close_ends_a_session_and_its_stream(host, proposer):
    call = open_stream(host)
    call.next(5.0)
    assert ask(host, make("session_close", session="s1"))["finish_reason"] == "closed"
    assert call.result(5.0)["finish_reason"] == "closed"
    assert proposer.open_sessions == 0


@pytest.mark.parametrize("sampling, field", [
    ({"top_p": 0.0}, "sampling.top_p"),
    ({"temperature": -1.0}, "sampling.temperature"),
    ({"temperature": float("nan")}, "sampling.temperature"),
    ({"top_k": -3}, "sampling.top_k"),
    ({"seed": -1}, "sampling.seed"),
])
def test_bad_sampling_is_a_bad_request_naming_the_field(host, proposer, sampling, field):
    with pytest.raises(RemoteError) as info:
        ask(host, make("session_open", session="x", lease_s=5.0, sampling=sampling,
                       tensors=[PROMPT]))
    assert info.value.code == "bad_request" and field in info.value.message
    assert proposer.open_sessions == 0
    assert open_session(host, sid="ok").type == "draft_chunk"


class CountingNgram(NgramDrafter):
    opened = 0

    def open(self, prompt, params):
        CountingNgram.opened += 1
        return super().open(prompt, params)


def test_a_million_token_session_is_refused_before_any_work(host):
    role = ProposerRole(CountingNgram(), vocab_size=100, max_context=4096)
    role.attach(host)
    try:
        huge = np.ones(1_000_000, dtype=np.int32)
        with pytest.raises(RemoteError) as info:
            ask(host, make("session_open", session="big", lease_s=5.0, tensors=[huge]))
        assert info.value.code == "too_long" and "1000000" in info.value.message
        assert CountingNgram.opened == 0 and role.open_sessions == 0
        # a session cannot grow past the cap either
        assert open_session(host, sid="s").type == "draft_chunk"
        with pytest.raises(RemoteError) as info:
            commit(host, "s", 5000, np.ones(5000 - len(PROMPT), np.int32))
        assert info.value.code == "too_long" and "committed" in info.value.message
        assert commit(host, "s", len(PROMPT))["finish_reason"] == "extended"
    finally:
        role.close()


def test_default_context_cap_is_sane():
    assert ProposerRole(NgramDrafter(), vocab_size=0).max_context == 8192


def test_alternatives_stream_as_a_tree_and_lapse_with_their_position(host):
    """A proposer with tree width > 1 sends its drafter's alternatives beside the chain; a
    commit that confirms the chain's token drops the alternatives to it."""
    from codec.structs import DraftChunk

    role = ProposerRole(NgramDrafter(), vocab_size=100, sweep_every=0.05, tree_width=3)
    role.attach(host)
    try:
        # "9 1 2" was followed by 4 (the chain); "1 2" also by 3 (an alternative to the 4)
        prompt = np.array([1, 2, 3, 9, 1, 2, 4, 9, 1, 2], np.int32)
        n = len(prompt)
        call = open_stream(host, prompt=prompt, horizon=4)
        first = DraftChunk.from_message(chunk_at(call, n))
        assert first.tokens.tolist() == [4, 9, 1, 2]
        assert first.alt_tokens.tolist() == [3, 9, 1, 2]
        assert first.alt_parents.tolist() == [-1, 4, 5, 6]  # a branch at the base
        assert first.conf is None  # n-grams have no probabilities
        commit(host, "s1", n + 1, [4])
        later = DraftChunk.from_message(chunk_at(call, n + 1))
        # the branch at the old base lapsed; drafting on found "1 2" again, with its new
        # alternative: 3 instead of the chain's 4, under the chain's "2"
        assert later.tokens.tolist() == [9, 1, 2, 4]
        assert later.alt_tokens.tolist() == [3] and later.alt_parents.tolist() == [2]
    finally:
        role.close()


class OneAtATime(NgramDrafter):
    """Streams a chunk per drafted token, as model drafters do (their tokens are slow)."""

    ahead_chunk = 1


def test_a_commit_confirming_drafts_is_answered_before_drafting_more(host):
    """A slow drafter's next token would hold back what the verifier waits for: the drafts
    past the commit it already has."""
    role = ProposerRole(OneAtATime(), vocab_size=100, sweep_every=0.05)
    role.attach(host)
    try:
        call = open_stream(host, horizon=4)
        n = len(PROMPT)
        chunk = chunk_at(call, n)
        while len(chunk.tensors[0]) < 4:  # one token a chunk, up to the horizon
            chunk = chunk_at(call, n)
        assert chunk.tensors[0].tolist() == [7, 8, 5, 6]
        commit(host, "s1", n + 2, [7, 8])
        assert chunk_at(call, n + 2).tensors[0].tolist() == [5, 6]  # nothing drafted first
        assert chunk_at(call, n + 2).tensors[0].tolist() == [5, 6, 7]  # then on, a token a time
    finally:
        role.close()


def test_each_drafted_token_carries_the_class_of_the_draft_it_came_from(host, proposer):
    """The ngram drafter names the length of the match each draft continued (`match_class`);
    the chunk carries each token's own class (the (j+1)-th token of a draft from a match of L
    continues one of L + j: `class_at`), and a commit keeps the classes of what it left
    assumed."""
    from codec.structs import DraftChunk

    prompt = np.array([1, 2, 3, 9, 2, 3], np.int32)  # the tip "2 3" occurred once before
    n = len(prompt)
    call = open_stream(host, prompt=prompt, horizon=6)
    chunk = DraftChunk.from_message(chunk_at(call, n))
    while len(chunk.tokens) < 6:
        chunk = DraftChunk.from_message(chunk_at(call, n))
    # "2 3" -> 9 2 3 (a 2-token match); then "3 9 2 3"... matched 5 tokens -> 9 2 3 again
    assert chunk.tokens.tolist() == [9, 2, 3, 9, 2, 3]
    assert chunk.classes == ("m2", "m3", "m3", "m5", "m5", "m5")
    commit(host, "s1", n + 2, [9, 2])
    later = DraftChunk.from_message(chunk_at(call, n + 2))
    assert later.tokens.tolist()[:4] == [3, 9, 2, 3]
    assert later.classes[:4] == ("m3", "m5", "m5", "m5")


def test_the_verifier_reads_a_real_proposers_classes(host, proposer):
    """End to end over the bus: a verifier's source for a real ngram proposer names the class
    of the draft past each committed prefix, and none where no chunk extends it."""
    from nodes.engine.sampling import SamplingParams
    from nodes.verifier.proposer_client import DraftPolicy, ProposerLink, ProposerSource

    policy = DraftPolicy()
    link = ProposerLink("p1", host.server.endpoint, "ngram")
    client = link.direct(host.factory, "verifier", policy.max_queued)
    prompt = [1, 2, 3, 9, 2, 3]
    src = ProposerSource(link, client, prompt, SamplingParams(), session_id="s1",
                         vocab_size=100, fingerprint="", max_draft=8, policy=policy)
    try:
        deadline = time.monotonic() + 10
        while src.best is None or len(src.best.tokens) < 6:  # bounded: a hang fails
            assert time.monotonic() < deadline, "no chunk of 6 tokens came"
            src._drain(0.05)
        assert src.draft_class(prompt) == "m2"
        assert src.draft_class(prompt + [9, 2, 3]) == "m5"
        assert src.draft_class(prompt + [9, 4]) is None  # the chunk does not extend it
        assert link.classes == {"m2", "m5"}
    finally:
        src.close()
        link.close()


def test_a_suffix_session_for_another_tokenizer_keeps_out_of_the_global_index(host):
    """A suffix proposer serves verifiers of any tokenizer, but its global index holds one
    tokenizer's ids (`GlobalIndex.pin`): a session whose verifier names that tokenizer drafts
    the filed answer to its prompt; one naming another drafts from its own text only, and its
    text never enters the index."""
    from codec.structs import DraftChunk
    from nodes.drafters.suffix import SuffixDrafter

    drafter = SuffixDrafter()
    prompt = [*range(10, 20), 10, 11]  # its own text continues "10 11" with 12 13 14 ...
    answer = list(range(100, 130))
    filed = drafter.open(prompt, None)
    filed.for_tokenizer("aaaa")  # the index is aaaa's from here on
    filed.extend(answer)
    filed.close()
    docs = len(drafter.index.docs)
    role = ProposerRole(drafter, vocab_size=200, sweep_every=0.05)
    role.attach(host)
    try:
        first = {}
        for sid, tokenizer in (("own", "aaaa"), ("other", "bbbb")):
            call = host.client.request(
                host.server.endpoint,
                make("session_open", session=sid, lease_s=5.0, horizon=6, tokenizer=tokenizer,
                     tensors=[np.asarray(prompt, dtype=np.int32)]), timeout=None)
            first[sid] = DraftChunk.from_message(chunk_at(call, len(prompt))).tokens.tolist()
        assert first["own"] == answer[:6]  # the repeat, from the index
        assert first["other"] == [12, 13, 14, 15, 16, 17]  # its own text only
        commit(host, "other", len(prompt) + 2, [12, 13])
        ask(host, make("session_close", session="other"))
        assert role.open_sessions == 1 and len(drafter.index.docs) == docs
        assert drafter.index.tokenizer == "aaaa"
    finally:
        role.close()
