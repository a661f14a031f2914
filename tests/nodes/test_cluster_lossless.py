"""Real node processes on loopback, the real SmolLM2: output through the bus is identical to
the verifier alone and to Hugging Face greedy, whatever proposers take part."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from codec.messages import decode
from codec.sampling import SamplingParams
from nodes.cluster_client import ClusterClient, GenerateRequest

pytestmark = pytest.mark.slow

PROMPT = ("Copy the following sentence exactly, word for word: The committee will meet on "
          "Tuesday at the main office to review the budget for the next fiscal year.")
MAX = 40


@pytest.fixture(scope="module")
def cluster(model_cluster):
    """The session's shared model cluster (tests/conftest.py): v1, v2, ngram, int8, mlx."""
    return model_cluster


@pytest.fixture(scope="module")
def client(cluster):
    names = {"v1", "v2", "ngram", "int8", "mlx"}
    with ClusterClient(cluster.cluster, peers=(cluster.node("v1").stream,), mdns=False) as cc:
        seen = cc.wait_for(lambda ms: names <= {m.card.name for m in ms}, 120)
        assert names <= {m.card.name for m in seen}, [m.card.name for m in seen]
        yield cc


def verifier(client, name):
    return next(m for m in client.verifiers() if m.card.name == name)


def node_id(cluster, name):
    return next(n.node_id for n in cluster.nodes if n.name == name)


@pytest.fixture(scope="module")
def plain(client):
    return client.generate(GenerateRequest(PROMPT, max_tokens=MAX, speculate=False),
                           verifier(client, "v1"))


def test_plain_through_the_bus_matches_hugging_face_greedy(plain):
    import torch
    from transformers import AutoModelForCausalLM

    from nodes.backends.tokenizer import Tokenizer
    from nodes.models import resolve

    folder = resolve("smollm2-135m").path
    ids = Tokenizer(folder).encode(PROMPT, chat=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True,
                                                 dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), max_new_tokens=MAX, do_sample=False)
    assert plain.stats["token_ids"] == out[0, len(ids):].tolist()


@pytest.mark.parametrize("who", ["ngram", "int8", "mlx", "all"])
def test_speculative_output_is_identical(client, cluster, plain, who):
    names = ("ngram", "int8", "mlx") if who == "all" else (who,)
    only = [node_id(cluster, n) for n in names]
    # forced drafting: every named proposer is asked every block, whatever the verifier
    # would judge of its speed, so "speculation happened" does not depend on that judgement
    res = client.generate(GenerateRequest(PROMPT, max_tokens=MAX, proposers=only,
                                          force_draft=True),
                          verifier(client, "v1"))
    assert res.stats["token_ids"] == plain.stats["token_ids"]
    assert res.text == plain.text
    used = res.stats["proposers"]
    assert set(used) == set(only)
    # speculation really happened over the bus, with every proposer taking part; merged into
    # one tree, a proposer whose drafts the others already covered may be credited none, so
    # with several it is "every proposer streamed drafts, and drafts were used"
    assert all(p["chunks"] >= 1 for p in used.values()), list(used.values())
    if len(names) == 1:
        assert used[only[0]]["drafts"] >= 1, used
    else:
        assert sum(p["drafts"] for p in used.values()) >= 1, list(used.values())
    assert all(p["bad_replies"] == 0 for p in used.values())


def test_two_verifiers_share_one_proposer_concurrently(client, cluster, plain):
    ngram = [node_id(cluster, "ngram")]
    results = {}

    def run(name):
        results[name] = client.generate(GenerateRequest(PROMPT, max_tokens=MAX, proposers=ngram,
                                                        force_draft=True),
                                        verifier(client, name))

    threads = [threading.Thread(target=run, args=(n,)) for n in ("v1", "v2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert set(results) == {"v1", "v2"}
    for r in results.values():
        assert r.stats["token_ids"] == plain.stats["token_ids"]
        assert r.stats["proposers"][ngram[0]]["drafts"] >= 1


def test_garbage_to_a_nodes_router_is_answered_and_real_clients_still_served(client, cluster,
                                                                            plain):
    for name in ("v1", "ngram"):
        node = next(n for n in cluster.nodes if n.name == name)
        # from the client's factory: a member's socket (CURVE keys with --cluster-secret)
        raw = client.node.factory.dealer()
        raw.connect(node.stream)
        try:
            for junk in ([b"\x00\xffgarbage"], [b"\x81\xa1v\x01", b"x" * 10], [b""] * 3):
                raw.send_multipart(junk)
                assert raw.poll(5000), f"{name} did not answer garbage"
                assert decode(raw.recv_multipart()).type == "error"
        finally:
            raw.close(linger=0)
    res = client.generate(GenerateRequest(PROMPT, max_tokens=MAX), verifier(client, "v1"))
    assert res.stats["token_ids"] == plain.stats["token_ids"]


def test_a_seeded_sample_is_the_same_text_with_or_without_drafts(client, cluster):
    """The sampled token at each position depends on the seed, the position and the
    verifier's distribution alone (nodes/engine/sampling.py): forced drafts from the int8
    proposer, or none, or another verifier, give one text."""
    def run(name, **kw):
        return client.generate(GenerateRequest(PROMPT, max_tokens=24,
                                               sampling=SamplingParams(0.8, seed=3), **kw),
                               verifier(client, name))

    res = run("v2", proposers=[node_id(cluster, "int8")], force_draft=True)
    stats = res.stats["proposers"][node_id(cluster, "int8")]
    assert stats["bad_replies"] == 0 and stats["drafts"] >= 1
    assert np.all(np.asarray(res.stats["token_ids"]) < 49152)
    alone = run("v1", speculate=False)
    assert res.stats["token_ids"] == alone.stats["token_ids"]


def test_a_conversations_next_turn_goes_back_to_its_verifier_though_it_is_busier(client):
    """The client sends a turn to the verifier that served the conversation so far (prefix
    affinity), whose prefix cache holds it, although another verifier is less loaded: the
    holder carries one more generation of this client, a stream kept open (so the verdict
    does not hang on timing), within the affinity's slack."""
    # start from idle cards: a load left over from an earlier test must not decide the choice
    client.wait_for(lambda ms: all(m.card.load == 0 for m in ms if "verifier" in m.card.roles),
                    30)
    turn1 = [{"role": "user", "content": "Name two planets and say one thing about each."}]
    first = client.generate(GenerateRequest(messages=turn1, max_tokens=24, speculate=False))
    holder = first.stats["verifier"]
    busy = client.stream(GenerateRequest(PROMPT, max_tokens=MAX, speculate=False),
                         next(m for m in client.verifiers() if m.node_id == holder))
    try:
        assert next(busy).type == "token_chunk"  # its slot is held until the stream closes
        turn2 = turn1 + [{"role": "assistant", "content": first.text},
                         {"role": "user", "content": "Which one is closer to the Sun?"}]
        second = client.generate(GenerateRequest(messages=turn2, max_tokens=24,
                                                 speculate=False))
    finally:
        busy.close()
    assert second.stats["verifier"] == holder
    assert second.stats["cached_tokens"] >= first.stats["prompt_tokens"]
