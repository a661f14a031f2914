"""The proposer role over a real ROUTER: sessions, idempotent deltas, leases, bad input."""

import time

import numpy as np
import pytest

from bus.streams import RemoteError
from codec.messages import make
from nodes.drafters.ngram import NgramDrafter
from nodes.roles.proposer import ProposerRole

PROMPT = np.array([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], dtype=np.int32)


@pytest.fixture
def proposer(host):
    role = ProposerRole(NgramDrafter(), vocab_size=100, sweep_every=0.05)
    role.attach(host)
    yield role
    role.close()


def ask(host, msg, timeout=5.0):
    return host.client.request(host.server.endpoint, msg, timeout=timeout).result(timeout)


def open_session(host, sid="s1", lease=5.0, prompt=PROMPT):
    return ask(host, make("session_open", session=sid, lease_s=lease, tensors=[prompt]))


def draft(host, sid, k, committed, delta=()):
    return ask(host, make("draft_req", session=sid, k=k, committed=committed,
                          tensors=[np.asarray(delta, dtype=np.int32)]))


def test_open_then_draft_continues_the_ngram(host, proposer):
    assert open_session(host)["finish_reason"] == "opened"
    reply = draft(host, "s1", 3, committed=len(PROMPT))
    assert reply.type == "draft_reply" and reply["committed"] == len(PROMPT)
    assert reply.tensors[0].tolist() == [7, 8, 5]  # "... 5 6" -> most recent "5 6" -> 7 8 5
    assert reply.session == "s1"


def test_deltas_are_idempotent_and_gaps_are_refused(host, proposer):
    open_session(host)
    n = len(PROMPT)
    draft(host, "s1", 2, committed=n + 2, delta=[7, 8])
    # the same delta again (e.g. its first request timed out on the verifier): applied once
    reply = draft(host, "s1", 2, committed=n + 2, delta=[7, 8])
    assert reply["committed"] == n + 2
    assert reply.tensors[0].tolist() == [5, 6]
    # overlapping delta: only the new tail is applied
    reply = draft(host, "s1", 2, committed=n + 3, delta=[8, 5])
    assert reply["committed"] == n + 3 and reply.tensors[0].tolist() == [6, 7]
    # a delta starting past what the session has: tokens are missing
    with pytest.raises(RemoteError) as info:
        draft(host, "s1", 2, committed=n + 10, delta=[1])
    assert info.value.code == "out_of_sync"


def test_never_pads_and_zero_k_gives_zero_tokens(host, proposer):
    open_session(host, prompt=np.array([1, 2, 3], np.int32))
    assert draft(host, "s1", 4, committed=3).tensors[0].tolist() == []
    open_session(host, sid="s2")
    assert draft(host, "s2", 0, committed=len(PROMPT)).tensors[0].tolist() == []


def test_unknown_session_and_bad_input_are_typed_errors(host, proposer):
    with pytest.raises(RemoteError) as info:
        draft(host, "nope", 2, committed=3)
    assert info.value.code == "unknown_session"
    with pytest.raises(RemoteError) as info:
        ask(host, make("session_open", session="x", lease_s=-1.0, tensors=[PROMPT]))
    assert info.value.code == "bad_request"
    with pytest.raises(RemoteError) as info:
        ask(host, make("session_open", session="x", lease_s=5.0,
                       tensors=[np.array([1, 500], np.int32)]))
    assert "vocabulary" in info.value.message
    with pytest.raises(RemoteError) as info:
        ask(host, make("session_open", lease_s=5.0, tensors=[PROMPT]))  # no session id
    assert info.value.code == "bad_request"
    # still serving
    assert open_session(host, sid="ok")["finish_reason"] == "opened"


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
    open_session(host, sid="short", lease=0.2)
    open_session(host, sid="long", lease=30.0)
    assert proposer.open_sessions == 2
    time.sleep(0.5)
    assert proposer.open_sessions == 1
    assert proposer.stats.sessions_expired == 1
    with pytest.raises(RemoteError):
        draft(host, "short", 2, committed=len(PROMPT))


def test_close_ends_a_session(host, proposer):
    open_session(host)
    assert ask(host, make("session_close", session="s1"))["finish_reason"] == "closed"
    assert proposer.open_sessions == 0


def test_stale_requests_are_skipped_not_drafted(host, proposer):
    open_session(host)
    n = len(PROMPT)
    reply = ask(host, make("draft_req", session="s1", k=3, committed=n, budget_s=0.0,
                           tensors=[np.zeros(0, np.int32)]))
    assert reply.tensors[0].tolist() == []
    assert proposer.stats.stale_skipped == 1


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
    assert open_session(host, sid="ok")["finish_reason"] == "opened"


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
        assert open_session(host, sid="s")["finish_reason"] == "opened"
        with pytest.raises(RemoteError) as info:
            draft(host, "s", 2, committed=5000, delta=np.ones(5000 - len(PROMPT), np.int32))
        assert info.value.code == "too_long" and "committed" in info.value.message
        assert draft(host, "s", 2, committed=len(PROMPT)).type == "draft_reply"
    finally:
        role.close()


def test_default_context_cap_is_sane():
    assert ProposerRole(NgramDrafter(), vocab_size=0).max_context == 8192
