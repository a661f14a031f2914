"""Hostile publications for the shared suffix index (issue 25): a member floods a suffix
proposer with malformed, oversized, foreign and far too many publications under changing sender
ids. Everything bad is dropped and counted, the proposer's index stays within its byte budget,
and the node keeps serving. Two in-process nodes on loopback, real gossip."""

from __future__ import annotations

import numpy as np

from codec.messages import make
from codec.structs import SuffixPub
from nodes.drafters.suffix import SuffixDrafter
from nodes.node import Node, NodeConfig
from nodes.node_common.suffix_share import Subscriber, share_topic
from tests.polling import wait_until

BUDGET_MB = 2


def test_a_flood_of_publications_stays_within_the_index_budget(tmp_path):
    drafter = SuffixDrafter.from_spec(f"suffix:budget={BUDGET_MB}")
    sub = Subscriber(drafter.index)
    a = Node(NodeConfig(cluster="flood", roles=("proposer",), mdns=False,
                        state_dir=tmp_path / "a", name="a"))
    sub.attach(a)
    a.start()
    b = Node(NodeConfig(cluster="flood", observer=True, mdns=False, state_dir=tmp_path / "b",
                        peers=(a.server.endpoint,))).start()
    try:
        sub.start()
        assert wait_until(lambda: a.membership.get(b.node_id) is not None, 20)
        topic = share_topic("flood")
        rng = np.random.default_rng(0)
        fed = 0
        seq = 0

        def send(msg):
            nonlocal seq
            seq += 1
            msg.seq = seq
            b.gossip.publish(topic, msg)

        def first_heard() -> bool:
            """The first publication pins the tokenizer; resent until the proposer hears it
            (a new subscription takes a moment to reach the publisher)."""
            send(SuffixPub("flood", "fp", np.arange(1, 50, dtype=np.int32), 0)
                 .to_message(sender="v0"))
            return sub.stats().get("indexed", 0) >= 1

        assert wait_until(first_heard, 20, step=0.2)
        for i in range(600):  # ~19 MiB of token ids under 600 sender ids
            tokens = rng.integers(0, 49152, 8192, dtype=np.int32)
            send(SuffixPub("flood", "fp", tokens, 0).to_message(sender=f"forged-{i}"))
            fed += tokens.nbytes
        for i in range(50):  # malformed, of another tokenizer, oversized
            send(make("suffix_pub", cluster="flood", tokenizer="fp", output_start=5,
                      tensors=[np.arange(3, dtype=np.int32)], sender=f"bad-{i}"))
            send(SuffixPub("flood", "other", np.arange(1, 9, dtype=np.int32), 0)
                 .to_message(sender=f"foreign-{i}"))
            send(make("suffix_pub", cluster="flood", tokenizer="fp", output_start=0,
                      tensors=[np.zeros(9000, np.int32)], sender=f"big-{i}"))
        assert wait_until(lambda: sub.stats()["foreign"] >= 40
                          and sub.stats()["malformed"] >= 80, 60), sub.stats()
        assert wait_until(lambda: sub.stats()["queued"] == 0, 120), sub.stats()
        stats = sub.stats()
        assert fed > 8 * (BUDGET_MB << 20)
        assert stats["indexed"] >= 2 and drafter.index.nbytes() <= BUDGET_MB << 20, stats
        # the node still answers requests
        reply = b.client.request(a.server.endpoint, make("ping", payload="x"),
                                 timeout=10).result(10)
        assert reply.type == "pong"
    finally:
        b.stop()
        a.stop()
        sub.close()
