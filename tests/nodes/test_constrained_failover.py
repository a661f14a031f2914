"""Constrained greedy (a JSON schema) through the cluster client survives the faults of a real
cluster token for token: a forced proposer SIGKILLed mid-generation, and the serving verifier
SIGKILLed mid-generation with a second one up (the generation resumes there with the tokens
received as prompt and `resumed` saying so: the new verifier's grammar matcher starts after
them, not at the start). Each output equals constrained plain decoding of the same prompt ids
in process (nodes.engine.Engine, no drafter, the verifiers' fp32 SmolLM2 weights) and is valid
against the schema. Plus the failover state machine setting `resumed`, without sockets.

Real processes on loopback: the session's shared model cluster (tests/conftest.py) plus a
proposer and a verifier this module starts and kills.
"""

from __future__ import annotations

import json
import signal

import pytest

from nodes.cluster_client import GenerateRequest
from nodes.cluster_client.choice import Balancer
from nodes.cluster_client.failover import Failover, Final, Resuming

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 24},
                         "country": {"type": "string", "maxLength": 24},
                         "population": {"type": "integer", "minimum": 0},
                         "landmarks": {"type": "array", "items": {"type": "string",
                                                                  "maxLength": 24},
                                       "minItems": 2, "maxItems": 3}},
          "required": ["city", "country", "population", "landmarks"],
          "additionalProperties": False}
GRAMMAR = {"kind": "json_schema", "text": json.dumps(SCHEMA)}
PROMPT = ("Describe Paris as a JSON object with its city, country, population and two or "
          "three landmarks.")
MAX = 96


def check(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == set(SCHEMA["required"])
    assert all(isinstance(obj[k], str) and len(obj[k]) <= 24 for k in ("city", "country"))
    assert isinstance(obj["population"], int) and obj["population"] >= 0
    assert 2 <= len(obj["landmarks"]) <= 3
    assert all(isinstance(x, str) and len(x) <= 24 for x in obj["landmarks"])


# ---- the state machine: a resumed request says how much it resumes -----------------------------
def test_the_failover_sends_resumed_with_the_grammar():
    from tests.nodes.test_cluster_client_failover import View, chunk, verifier

    view = View(verifier("a"), verifier("b", load=1))
    req = GenerateRequest("hi", max_tokens=5, grammar=GRAMMAR)
    core = Failover(req, view, Balancer(), model="m", prompt_ids=(7, 8))
    att = core.begin(now=0)
    assert "resumed" not in att.message.fields  # a first attempt resumes nothing
    core.reply(att, chunk(0, 1, 2), now=1)
    view.dead["a"] = "gone"
    assert isinstance(core.quiet(att, now=2)[-1], Resuming)
    core.end(att)
    sent = core.begin(now=3).message
    assert list(sent.tensors[0]) == [7, 8, 1, 2] and sent["max_tokens"] == 3
    assert sent["resumed"] == 2 and json.loads(sent["grammar"]["text"]) == SCHEMA


def test_a_verifier_lost_after_its_eos_is_not_resumed():
    """Its end-of-sequence token arrived, its `done` did not: the generation is over (a
    resume would ask for tokens after the end; the grammar, for more than one object)."""
    from tests.nodes.test_cluster_client_failover import Tok, View, chunk, verifier

    class EosTok(Tok):
        eos_token_ids = frozenset({5})

    view = View(verifier("a"), verifier("b"))
    core = Failover(GenerateRequest("hi", max_tokens=9, grammar=GRAMMAR), view, Balancer(),
                    model="m", prompt_ids=(7, 8), tokenizer=EosTok())
    att = core.begin(now=0)
    core.reply(att, chunk(0, 1, 2, 5), now=1)
    view.dead["a"] = "gone"
    out = core.quiet(att, now=2)
    assert core.finished and isinstance(out[-1], Final)
    assert out[-1].finish_reason == "eos" and out[-1].token_ids == (1, 2, 5)


# ---- real processes (the shared model cluster: `cluster`, `client` in tests/nodes/conftest.py) --
@pytest.fixture(scope="module")
def reference():
    """(prompt ids, constrained plain decoding's tokens and text) in process, on the weights
    the verifier processes serve (SmolLM2, fp32: SPECBUS_WEIGHTS in tests/conftest.py)."""
    import torch

    from nodes import models
    from nodes.backends.torch_backend import TorchBackend
    from nodes.engine import Engine, GenerationParams
    from nodes.engine.grammar import Constraint

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the verifiers (--threads 1)
    try:
        backend = TorchBackend.load(models.resolve(models.DEFAULT_MODEL).path, device="cpu")
        ids = [int(t) for t in backend.tokenizer.encode(PROMPT, chat=True)]
        out = Engine(backend, grammar_drafts=False).generate(ids, GenerationParams(
            max_tokens=MAX, constraint=Constraint.from_wire(GRAMMAR)))
    finally:
        torch.set_num_threads(before)
    assert out.finish_reason == "eos"
    text = backend.tokenizer.decode(out.token_ids)
    check(text)
    return ids, list(out.token_ids), text


def _request(ids, **kw):
    return GenerateRequest(tokens=ids, max_tokens=MAX, grammar=GRAMMAR, **kw)


@pytest.mark.slow
def test_a_proposer_killed_mid_generation_changes_nothing(cluster, client, reference):
    ids, tokens, text = reference
    victim = cluster.start_node("json-victim", "--role", "proposer", "--drafter", "ngram",
                                seed=True)
    pieces: list[str] = []

    def on_text(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 2:  # forced drafting: it has drafted for the second block
            victim.signal(signal.SIGKILL)

    try:
        client.wait_for(lambda ms: any(m.node_id == victim.node_id for m in ms), 30)
        result = client.generate(_request(ids, proposers=[victim.node_id], force_draft=True),
                                 on_text=on_text)
    finally:
        victim.signal(signal.SIGKILL)
    print(f"{len(tokens)} tokens; proposer killed after {len(pieces[0]) + len(pieces[1])} "
          f"chars of {len(text)}")
    assert result.stats["token_ids"] == tokens
    assert result.text == "".join(pieces) == text
    check(result.text)
    # it drafted before it went away (its chains, unconstrained, are pruned by the grammar
    # where they leave it: what reaches a tree may be nothing)
    assert result.stats["proposers"][victim.node_id]["chunks"] >= 1


@pytest.mark.slow
def test_a_verifier_killed_mid_generation_resumes_inside_the_grammar(cluster, client,
                                                                      reference):
    ids, tokens, text = reference
    doomed = cluster.start_node("v-json-doomed", "--role", "verifier", "--threads", "1",
                                seed=True)
    pieces: list[str] = []

    def on_text(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 1:
            doomed.signal(signal.SIGKILL)

    try:
        client.wait_for(lambda ms: any(m.node_id == doomed.node_id for m in ms), 60)
        target = next(m for m in client.verifiers() if m.node_id == doomed.node_id)
        result = client.generate(_request(ids), target, on_text=on_text)
    finally:
        doomed.signal(signal.SIGKILL)
    assert doomed.proc.wait(30) is not None
    print(f"{len(tokens)} tokens; verifier killed after {pieces[0]!r}")
    assert result.stats["failovers"] == 1 and result.stats["verifiers"][0] == doomed.node_id
    assert result.stats["token_ids"] == tokens
    assert result.text == "".join(pieces) == text
    check(result.text)


@pytest.mark.slow
def test_a_proposer_that_takes_the_grammar_drafts_inside_it(cluster, client, reference):
    """The shared int8 proposer says on its card that it takes a grammar; a constrained
    request forced onto it sends the grammar with the session, the proposer drafts from its
    logits masked by it, and the output is still constrained plain decoding's."""
    from tests.nodes.conftest import gossiped_stats
    from tests.polling import wait_until

    ids, tokens, text = reference
    members = client.wait_for(lambda ms: any(m.card.name == "int8" for m in ms), 60)
    int8 = next(m for m in members if m.card.name == "int8")
    assert int8.card.extras.get("grammar") is True
    ngram = next((m for m in members if m.card.name == "ngram"), None)
    assert ngram is None or "grammar" not in ngram.card.extras  # no tokenizer: drafts free
    stats = gossiped_stats(cluster, client, int8.node_id, "proposer")
    assert wait_until(lambda: stats(), 30)
    before = stats().get("constrained", 0)
    result = client.generate(_request(ids, proposers=[int8.node_id], force_draft=True))
    assert result.stats["token_ids"] == tokens and result.text == text
    check(result.text)
    drafts = result.stats["proposers"][int8.node_id]
    assert drafts["drafted"] > 0
    # its session took the grammar
    assert wait_until(lambda: stats().get("constrained", 0) > before, 30)
