"""The quantized verifier in real processes with the real SmolLM2 (the product's default,
`--weights auto`: the shipped Q4_1 file's own blocks): speculation through the bus, a batch of
8 arriving together and a proposer SIGKILLed mid-stream each give exactly the verifier's own
plain decoding.

No `--batch-invariant` here: the quantized forward computes every row alone
(nodes/backends/quant_rows.cpp), so requests that share a step get their solo output whatever
the batch's composition and timing.
"""

from __future__ import annotations

import signal
import threading

import pytest

from nodes.cluster_client import ClusterError, GenerateRequest
from tests.nodes.conftest import client_of, one_verifier
from tools.prompts import PROMPTS

pytestmark = pytest.mark.slow

MAX = 40
#: (prompt, max_tokens): mixed lengths and classes, eight requests
REQUESTS = [*((text, 24 + 4 * i) for i, (_, text) in enumerate(PROMPTS)),
            ("Hi", 16), ("Name three rivers in Europe.", 32)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = one_verifier(tmp_path_factory, "--weights", "auto", "--max-batch", "8",
                     "--prefix-cache-mb", "0",
                     proposers=[(name, "--drafter", name, "--threads", "1")
                                for name in ("ngram", "int8")])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with client_of(cluster) as cc:
        cc.wait_for(lambda ms: {"v", "ngram", "int8"} <= {m.card.name for m in ms}, 120)
        yield cc


def _ids(client, *names):
    return [m.node_id for m in client.wait_for(lambda ms: True, 1) if m.card.name in names]


@pytest.fixture(scope="module")
def solo(client):
    return [client.generate(GenerateRequest(text, max_tokens=n, speculate=False))
            .stats["token_ids"] for text, n in REQUESTS]


def test_the_default_serves_the_shipped_files_own_blocks(client):
    card = client.verifiers()[0].card
    assert card.extras.get("weights") == "file"


@pytest.mark.parametrize("names", [("ngram",), ("ngram", "int8")], ids=["ngram", "ngram+int8"])
def test_speculation_through_the_bus_is_the_plain_decoding(client, solo, names):
    """Forced drafting (every block asks these proposers): chains, and the two proposers'
    drafts merged into one token tree."""
    for i in (0, 2, 4):
        text, n = REQUESTS[i]
        got = client.generate(GenerateRequest(text, max_tokens=n, proposers=_ids(client, *names),
                                              force_draft=True))
        assert got.stats["token_ids"] == solo[i], f"request {i}"
        assert got.stats["drafted"] > 0


def test_eight_requests_together_each_give_their_solo_output(client, solo):
    v = client.verifiers()[0]
    proposers = _ids(client, "ngram")
    out: dict[int, object] = {}
    go = threading.Barrier(len(REQUESTS))

    def run(i: int) -> None:
        text, n = REQUESTS[i]
        try:
            go.wait(60)
            req = GenerateRequest(text, max_tokens=n, proposers=proposers if i % 2 else None,
                                  speculate=bool(i % 2))
            out[i] = client.generate(req, v).stats["token_ids"]
        except (ClusterError, threading.BrokenBarrierError) as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(REQUESTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for i in range(len(REQUESTS)):
        assert out[i] == solo[i], f"request {i}"


def test_a_proposer_killed_mid_stream_changes_nothing(cluster, client, solo):
    victim = cluster.start_node("victim", "--role", "proposer", "--drafter", "ngram", seed=True)
    client.wait_for(lambda ms: any(m.node_id == victim.node_id for m in ms), 30)
    text, n = REQUESTS[0]
    chunks = 0
    ids: list[int] = []
    req = GenerateRequest(text, max_tokens=n, proposers=[victim.node_id], force_draft=True)
    try:
        for msg in client.stream(req):
            if msg.type == "token_chunk":
                ids += msg.tensors[0].tolist()
                chunks += 1
                if chunks == 2:
                    victim.signal(signal.SIGKILL)
    finally:
        victim.signal(signal.SIGKILL)
    assert ids == solo[0]
