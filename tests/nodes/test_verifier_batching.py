"""A batching verifier (`--max-batch 8`) in a real process with the real SmolLM2: requests
that run together each give exactly their solo output, one cancelled mid-batch changes no
other, and neither does a long prompt joining a running batch.

Prompts longer than 64 tokens are prefilled in chunks (`--prefill-chunk 64`), one per step,
solo and batched alike. The verifier runs `--batch-invariant`: which requests share a step
depends on when they arrive, and batched CPU matmuls differ from solo ones in the last bits
(docs/engine.md, "Batching"), so only the invariant mode makes the verdict independent of
timing. The batched forward itself is checked with deterministic batch compositions in
tests/engine/test_engine_batch.py. Its own ngram drafter serves the requests that speculate,
so plain and speculative sequences share the batch.
"""

from __future__ import annotations

import threading

import pytest

from nodes.cluster_client import ClusterError, GenerateRequest
from tests.nodes.conftest import client_of, one_verifier
from tools.prompts import PROMPTS

pytestmark = pytest.mark.slow

#: (prompt, max_tokens, speculate): mixed prompt lengths, lengths and drafting
REQUESTS = [
    *((text, 24 + 4 * i, i % 2 == 0) for i, (_, text) in enumerate(PROMPTS)),
    ("Hi", 16, True),
    ("Name three rivers in Europe.", 40, False),
]
#: a prompt of several hundred tokens (several prefill chunks)
LONG = ("Summarise these notes in one sentence:\n\n" + "\n".join(t for _, t in PROMPTS[:4]), 16,
        True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = one_verifier(tmp_path_factory, "--drafter", "ngram", "--max-batch", "8",
                     "--batch-invariant", "--prefill-chunk", "64")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with client_of(cluster, verifiers_s=60) as cc:
        yield cc


def _request(i: int) -> GenerateRequest:
    text, n, speculate = REQUESTS[i] if i >= 0 else LONG
    return GenerateRequest(text, max_tokens=n, speculate=speculate)


@pytest.fixture(scope="module")
def solo(client):
    """Each request alone (one after another: a batch of one each); index -1 is `LONG`."""
    out = [client.generate(_request(i)).stats["token_ids"] for i in range(len(REQUESTS))]
    return [*out, client.generate(_request(-1)).stats["token_ids"]]


def _together(client, which, cancel=None, late=None):
    """Stream the requests `which` at once, each in its own thread; the one numbered `cancel`
    is closed after its second chunk; the one numbered `late` starts once every other one
    has streamed its first chunk (it joins a running batch). Returns {i: token ids, or the
    exception}."""
    v = client.verifiers()[0]
    out: dict[int, object] = {}
    early = [i for i in which if i != late]
    go = threading.Barrier(len(early))
    started = threading.Barrier(len(which))

    def run(i):
        ids: list[int] = []
        try:
            if i == late:
                started.wait(300)
            else:
                go.wait(60)
            stream = client.stream(_request(i), v)
            for msg in stream:
                if msg.type == "token_chunk":
                    if not ids and late is not None and i != late:
                        started.wait(300)
                    ids += msg.tensors[0].tolist()
                    if i == cancel and len(ids) >= 2:
                        stream.close()  # cancels the verifier's work
                        break
            out[i] = ids
        except (ClusterError, threading.BrokenBarrierError) as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in which]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return out


def test_eight_concurrent_requests_each_equal_their_solo_output(client, solo):
    out = _together(client, range(len(REQUESTS)))
    for i in range(len(REQUESTS)):
        assert out[i] == solo[i], f"request {i}: {REQUESTS[i][1:]}"


def test_a_request_cancelled_mid_batch_changes_no_other(client, solo):
    which = [0, 1, 2, 3, 7]
    out = _together(client, which, cancel=2)
    for i in which:
        if i == 2:
            assert out[i] == solo[i][: len(out[i])] and len(out[i]) < len(solo[i])
        else:
            assert out[i] == solo[i], f"request {i}"
    # the verifier is free again: the cancelled slot was released, the next request is served
    assert client.generate(_request(6)).stats["token_ids"] == solo[6]


def test_a_long_prompt_joining_mid_batch_changes_no_other(client, solo):
    which = [1, 4, 6, -1]
    out = _together(client, which, late=-1)
    for i in which:
        assert out[i] == solo[i], f"request {i}"
