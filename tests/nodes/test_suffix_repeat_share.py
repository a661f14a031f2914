"""The prompt hash of the shared suffix index (issue 25), in process: a verifier's publication
carries a keyed hash of the prompt even when the prompt is not shared, a suffix proposer files
the answer under it (from publications and snapshots) and drafts the repeat whole, and a
publication whose hash is malformed is dropped and counted. The publisher and subscriber are
the real ones; only the node around them is a stand-in (no sockets)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from bus.streams import RemoteError
from codec.messages import make
from codec.structs import MAX_PUB_TOKENS, SuffixPub, SuffixSnapshot
from discovery.counters import Counters
from nodes.drafters.suffix import SuffixDrafter
from nodes.engine.errors import BUSY
from nodes.node_common.suffix_share import (
    SNAPSHOT_BURST,
    SNAPSHOT_RATE,
    SNAPSHOT_RETRY_S,
    SNAPSHOT_TRIES,
    SUBSCRIBER_COUNTERS,
    Publisher,
    Subscriber,
    prompt_key,
)
from tests.polling import wait_until

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
ANSWER = list(range(200, 240))


class FakeNode:
    """What Publisher.attach and publish use of a node: config, security, gossip, requests."""

    def __init__(self, cluster="c", security=None):
        self.node_id = "v1"
        self.config = SimpleNamespace(cluster=cluster)
        self.security = security
        self.sent = []
        self.gossip = SimpleNamespace(publish=lambda topic, msg: self.sent.append(msg))
        self.handlers = {}

    def register_request(self, name, fn):
        self.handlers[name] = fn


def subscriber(drafter, node):
    sub = Subscriber(drafter.index)
    drafter.index.prompt_key = prompt_key(node)  # what attach does
    sub.counters = Counters(SUBSCRIBER_COUNTERS, is_owner=lambda: True)
    sub._thread.start()
    return sub


@pytest.fixture
def share():
    node = FakeNode()
    pub = Publisher("output", "fp")
    pub.attach(node)
    drafter = SuffixDrafter()
    sub = subscriber(drafter, node)
    yield node, pub, drafter, sub
    sub.close()


def test_the_key_is_the_clusters():
    a, b = prompt_key(FakeNode("c")), prompt_key(FakeNode("d"))
    assert a != b and len(a) == 32
    sec = SimpleNamespace(gossip_key=b"\x01" * 32)
    assert prompt_key(FakeNode("c", sec)) not in (a, b)  # the secret's, not the name's


def test_a_publication_without_the_prompt_still_gives_a_repeat_whole(share):
    node, pub, drafter, sub = share
    pub.publish(PROMPT, ANSWER)
    (msg,) = node.sent
    got = SuffixPub.from_message(msg)
    assert got.output_start == 0 and got.tokens.tolist() == ANSWER  # the prompt is not sent
    assert got.prompt_hash == drafter.index.prompt_digest(PROMPT)
    sub._on_pub("t", msg)
    assert wait_until(lambda: sub.stats().get("indexed", 0) == 1, 10)
    s = drafter.open(PROMPT, None)
    assert s.plan(16, 4).chain == ANSWER[:16]  # from the first token, whole
    assert drafter.open(PROMPT[1:], None).plan(16, 4).chain == []  # another prompt: nothing


def test_snapshots_carry_the_hashes(share):
    node, pub, drafter, sub = share
    pub.publish(PROMPT, ANSWER)
    pub.publish([7, 7], [1, 2, 3])
    replies = []
    node.handlers["suffix_snapshot_req"](SimpleNamespace(reply=replies.append))
    snap = SuffixSnapshot.from_message(replies[0])
    assert snap.prompt_hashes == (drafter.index.prompt_digest(PROMPT),
                                  drafter.index.prompt_digest([7, 7]))
    late = SuffixDrafter()
    sub2 = subscriber(late, node)
    try:
        sub2._on_snapshot(SimpleNamespace(endpoint="v1"), replies[0])
        assert wait_until(lambda: sub2.stats().get("indexed", 0) == 2, 10)
        assert late.open(PROMPT, None).plan(8, 1).chain == ANSWER[:8]
    finally:
        sub2.close()


def test_a_cut_output_carries_no_hash(share):
    node, pub, _, _ = share
    pub.publish(PROMPT, list(range(MAX_PUB_TOKENS + 5)))
    assert SuffixPub.from_message(node.sent[0]).prompt_hash is None


@pytest.mark.parametrize("bad", ["ab" * 15, "AB" * 16, "zz" * 16, "ab" * 17, 12345, ""])
def test_a_malformed_hash_is_dropped_and_counted(share, bad):
    _, _, drafter, sub = share
    msg = make("suffix_pub", cluster="c", tokenizer="fp", output_start=0, prompt_hash=bad,
               tensors=[np.asarray(ANSWER, np.int32)], sender="v1")
    sub._on_pub("t", msg)
    assert sub.stats()["malformed"] == 1 and sub.stats()["queued"] == 0
    assert not drafter.index.docs and not drafter.index.by_prompt


def test_snapshots_past_the_rate_are_answered_busy_and_counted():
    """A snapshot is up to 1 MiB built on the verifier's I/O thread: a member asking in a loop
    gets `busy` past SNAPSHOT_RATE (the clock is the test's: no timing in the verdict)."""
    now = [100.0]
    node = FakeNode()
    pub = Publisher("output", "fp", clock=lambda: now[0])
    pub.attach(node)
    pub.publish(PROMPT, ANSWER)
    replies = []
    req = SimpleNamespace(reply=replies.append,
                          fail=lambda code, text: replies.append((code, text)))
    for _ in range(SNAPSHOT_BURST + 3):
        node.handlers["suffix_snapshot_req"](req)
    served = [r for r in replies if not isinstance(r, tuple)]
    assert len(served) == SNAPSHOT_BURST
    assert [r[0] for r in replies[SNAPSHOT_BURST:]] == [BUSY] * 3
    assert pub.snapshots_refused == 3
    assert SuffixSnapshot.from_message(served[-1]).docs[0][0].tolist() == ANSWER
    now[0] += 1 / SNAPSHOT_RATE  # the bucket refills: one more is served
    node.handlers["suffix_snapshot_req"](req)
    assert not isinstance(replies[-1], tuple) and pub.snapshots_refused == 3


def test_a_proposer_asks_a_busy_verifier_again_later_a_few_times():
    asked, later = [], []
    card = SimpleNamespace(roles=("verifier",), tokenizer="fp", endpoints={"stream": "tcp://v"})
    node = SimpleNamespace(
        config=SimpleNamespace(cluster="c"),
        membership=SimpleNamespace(workers=lambda: [SimpleNamespace(node_id="v1", card=card)]),
        client=SimpleNamespace(request=lambda ep, msg, timeout, on_reply: asked.append(on_reply)),
        loop=SimpleNamespace(call_later=lambda delay, fn: later.append((delay, fn))))
    sub = Subscriber(SuffixDrafter().index)
    sub._node = node
    sub._ask_snapshots()
    for _ in range(SNAPSHOT_TRIES - 1):
        asked[-1](SimpleNamespace(endpoint="tcp://v"), RemoteError(BUSY, "later"))
        delay, fn = later.pop()
        assert delay == SNAPSHOT_RETRY_S
        fn()  # the timer fires: asked again
    assert len(asked) == SNAPSHOT_TRIES
    asked[-1](SimpleNamespace(endpoint="tcp://v"), RemoteError(BUSY, "later"))
    assert not later  # tried enough: publications still come, the snapshot is given up
    sub._ask_snapshots()
    assert len(asked) == SNAPSHOT_TRIES
