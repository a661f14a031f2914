"""The verifier role over a real ROUTER with a tiny random model and the real tokenizer:
bad values are typed errors naming the field, over-long input is refused before any compute,
chat messages render through the chat template, forced drafting pins speculation, and
telemetry never races the compute thread."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from bus.streams import RemoteError
from codec.messages import encode, make
from nodes.assemble import Roles
from nodes.drafters.ngram import NgramDrafter
from nodes.engine.core import Engine
from nodes.proposer.role import ProposerRole
from nodes.verifier.proposer_client import DraftPolicy
from nodes.verifier.role import VerifierRole
from tests.nodes.conftest import BusHost

CONTEXT = 1024  # the tiny model's max_position_embeddings
PROMPT = "Copy this: one two three four, one two three four, one two three four"


class FakeMembership:
    """The two calls the verifier makes on membership, over a list we control."""

    def __init__(self) -> None:
        self.members: list = []

    def add_proposer(self, node_id: str, endpoint: str, name: str = "",
                     extras: dict | None = None) -> None:
        card = SimpleNamespace(roles=("proposer",), node_id=node_id, name=name or node_id,
                               tokenizer="any", vocab=0, endpoints={"stream": endpoint},
                               extras=extras or {})
        self.members.append(SimpleNamespace(node_id=node_id, card=card, is_self=False,
                                            state=SimpleNamespace(value="alive")))

    def workers(self):
        return list(self.members)

    def get(self, node_id):
        return next((m for m in self.members if m.node_id == node_id), None)


class Counting:
    """Counts calls to a wrapped callable (here: the backend's prefill)."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        return self.fn(*a, **kw)


@pytest.fixture
def verifier(host, tiny_backend, monkeypatch):
    host.membership = FakeMembership()
    prefill = Counting(tiny_backend.prefill)
    monkeypatch.setattr(tiny_backend, "prefill", prefill)
    role = VerifierRole(Engine(tiny_backend, None, max_draft=4),
                        policy=DraftPolicy(forced_s=5.0))
    role.prefills = prefill
    role.attach(host)
    yield role
    role.close()


def generate(host, timeout=60.0, tensors=(), **fields):
    fields.setdefault("max_tokens", 8)
    msg = make("generate_req", tensors=list(tensors), **fields)
    return host.client.request(host.server.endpoint, msg, timeout=timeout).result(timeout)


def refused(host, **kw) -> RemoteError:
    with pytest.raises(RemoteError) as info:
        generate(host, **kw)
    return info.value


@pytest.mark.parametrize("fields, field", [
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": math.inf}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"prompt": ""}, "prompt"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ({"draft": "force"}, "proposers"),
])
def test_bad_values_are_bad_requests_naming_the_field(host, verifier, fields, field):
    fields = {"prompt": PROMPT, **fields}
    err = refused(host, **fields)
    assert err.code == "bad_request", err
    assert field in str(err)
    assert verifier.prefills.calls == 0
    assert generate(host, prompt=PROMPT)["finish_reason"] in ("length", "eos")


def test_token_prompt_problems_are_refused(host, verifier, tiny_backend):
    vocab = tiny_backend.vocab_size
    err = refused(host, tensors=[np.array([1, vocab], np.int32)])
    assert err.code == "bad_request" and "tokens" in str(err) and "vocabulary" in str(err)
    err = refused(host, prompt=PROMPT, tensors=[np.array([1, 2], np.int32)])
    assert err.code == "bad_request" and "tokens" in str(err)
    assert verifier.prefills.calls == 0


def test_a_two_dimensional_token_tensor_is_a_typed_error_naming_tokens(host, verifier):
    """The schema says 1-D: the ROUTER's decode answers before the role sees it."""
    import zmq

    ok = encode(make("generate_req", rid=7, tensors=[np.array([1, 2, 3, 4], np.int32)]),
                inline_max_bytes=0)  # a real tensor frame, so its shape can be forged
    header = ok[0].replace(b"\x91\x04", b"\x92\x02\x02")  # shape [4] -> [2, 2] in msgpack
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(host.server.endpoint)
    try:
        raw.send_multipart([header, ok[1].tobytes()])
        assert raw.poll(10000)
        from codec.messages import decode

        reply = decode(raw.recv_multipart())
    finally:
        raw.close()
    assert reply.type == "error" and reply.rid == 7
    assert reply["code"] == "bad_shape" and "'tokens'" in reply["message"]
    assert verifier.prefills.calls == 0


def test_over_long_prompt_is_refused_before_compute_and_the_next_is_served(host, verifier):
    err = refused(host, tensors=[np.arange(1, CONTEXT + 500, dtype=np.int32)])
    assert err.code == "too_long" and "tokens" in str(err)
    err = refused(host, prompt="word " * 2000, chat=False)
    assert err.code == "too_long" and "prompt" in str(err)
    err = refused(host, tensors=[np.arange(1, 1000, dtype=np.int32)], max_tokens=100)
    assert err.code == "too_long"
    assert verifier.prefills.calls == 0  # no model work for any of them
    assert verifier.stats.generations == 0
    done = generate(host, prompt=PROMPT)
    assert done.type == "done" and len(done["stats"]["token_ids"]) == 8
    assert verifier.prefills.calls == 1


def test_messages_render_with_the_chat_template(host, verifier, tiny_backend):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say one two three."}]
    ids = tiny_backend.tokenizer.encode_messages(messages)
    # the same rendering as a chat prompt with a system message (both end in the assistant turn)
    assert ids == tiny_backend.tokenizer.encode("Say one two three.", chat=True,
                                                system="Be brief.")
    assert tiny_backend.tokenizer.decode(ids[-3:]).strip().endswith("assistant")
    by_messages = generate(host, messages=messages)
    by_tokens = generate(host, tensors=[np.asarray(ids, np.int32)])
    assert by_messages["stats"]["prompt_tokens"] == len(ids)
    assert by_messages["stats"]["token_ids"] == by_tokens["stats"]["token_ids"]
    err = refused(host, messages=[{"role": "robot", "content": "x"}])
    assert err.code == "bad_request" and "messages[0].role" in str(err)


@pytest.fixture
def ngram_proposer(bus):
    h = BusHost(*bus, node_id="ngram-1")
    role = ProposerRole(NgramDrafter(), vocab_size=0)
    role.attach(h)
    yield h, role
    role.close()


def test_forced_drafting_asks_the_named_proposer_every_block(host, verifier, ngram_proposer):
    proposer_host, proposer = ngram_proposer
    host.membership.add_proposer("ngram-1", proposer_host.server.endpoint, name="ngram")
    plain = generate(host, prompt=PROMPT, max_tokens=24, speculate=False)
    forced = generate(host, prompt=PROMPT, max_tokens=24, proposers=["ngram"], draft="force")
    stats = forced["stats"]
    assert stats["token_ids"] == plain["stats"]["token_ids"]
    link = stats["proposers"]["ngram-1"]
    # protocol 2: every step waited (bounded) for a chunk extending the prefix (the tiny random
    # model's text gives the ngram little to copy, so the chunks are mostly "nothing past here")
    assert 1 <= link["chunks"] <= proposer.stats.drafts_served
    assert link["timeouts"] == 0 and link["bad_replies"] == 0 and link["errors"] == 0
    assert not link["dropped"]
    # forcing a proposer the verifier does not know is an error, not silent plain decoding
    err = refused(host, prompt=PROMPT, proposers=["nobody"], draft="force")
    assert err.code == "no_proposer" and "nobody" in str(err)


def test_a_proposer_cards_drafting_speed_reaches_its_link_and_bad_ones_say_nothing(verifier):
    """`extras.draft_tok_s` (what a proposer measured of itself) is what the verifier judges
    a lagging proposer by; extras are free-form, so a bad value reads as unknown (None), never
    as an error, and a card that changes it is followed."""
    members = FakeMembership()
    verifier._node = SimpleNamespace(membership=members, node_id="v")
    cases = {"fast": 2500.0, "int": 30, "none": None, "str": "fast", "bool": True,
             "nan": float("nan"), "inf": float("inf"), "zero": 0.0, "neg": -3.0}
    for name, rate in cases.items():
        members.add_proposer(name, "tcp://127.0.0.1:1", extras={"draft_tok_s": rate})
    # a generation drafts with a few proposers at most: each named in turn
    links = {k: verifier._compatible_links([k])[0] for k in cases}
    assert {k: links[k].draft_tok_s for k in cases} == {
        "fast": 2500.0, "int": 30.0, **dict.fromkeys(list(cases)[2:])}
    members.get("none").card.extras["draft_tok_s"] = 12.5
    assert verifier._compatible_links(["none"])[0].draft_tok_s == 12.5


def test_telemetry_never_iterates_links_the_compute_thread_mutates(verifier):
    """Links are added on one thread while telemetry reads on another, as in a node."""
    members = FakeMembership()
    verifier._node = SimpleNamespace(membership=members, node_id="v")
    roles = Roles(verifier=verifier)
    stop = threading.Event()
    errors: list[BaseException] = []

    def compute():  # what the compute thread does when a generation picks proposers
        i = 0
        while not stop.is_set() and i < 1500:
            members.add_proposer(f"p{i}", f"tcp://127.0.0.1:{10000 + i}")
            verifier._compatible_links(None)
            if i % 50 == 0:
                verifier._publish()
            i += 1
        stop.set()

    def io():
        while not stop.is_set():
            try:
                roles.telemetry()
            except RuntimeError as exc:  # "dictionary changed size during iteration"
                errors.append(exc)
                stop.set()

    threads = [threading.Thread(target=compute), threading.Thread(target=io)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    verifier._publish()
    assert len(roles.telemetry()["verifier"]["proposers"]) == len(verifier.links) > 0


def test_an_anonymous_clients_work_is_dropped_when_it_vanishes(host, verifier):
    """Issue 21: a raw DEALER (never a member) that queues long generations and vanishes
    without a word once held the verifier for its whole queue (~80 minutes with 16 x 4,096
    tokens). Its connection is probed: queued and running work is dropped and counted. The
    first generation is held in prefill until the drops are seen, so nothing can finish
    first (no timing in the verdict)."""
    import zmq

    from tests.polling import wait_until

    gate = threading.Event()
    prefill = verifier.prefills.fn
    verifier.prefills.fn = lambda *a, **kw: (gate.wait(60), prefill(*a, **kw))[1]
    ctx = zmq.Context()
    try:
        raw = ctx.socket(zmq.DEALER)
        raw.connect(host.server.endpoint)
        for rid in range(1, 5):
            msg = make("generate_req", prompt=PROMPT, max_tokens=512, chat=False)
            msg.rid = rid
            raw.send_multipart(encode(msg))
        assert wait_until(lambda: verifier.prefills.calls == 1 and verifier.queued == 3, 30)
        raw.close(linger=0)  # gone: no cancel, no leave, and it was never a member
        assert wait_until(lambda: verifier.admission.snapshot()["orphans_dropped"] == 4, 30), \
            verifier.admission.snapshot()
        assert verifier.queued == 0
    finally:
        gate.set()
        ctx.term()
    # the running one stopped within a block; the next client is served at once
    assert generate(host, prompt=PROMPT, chat=False, max_tokens=4).type == "done"


def test_token_chunks_carry_the_verifiers_logprobs_when_asked(host, verifier, tiny_backend):
    """Over the wire as in process: one log probability per token, and N alternatives."""
    from codec.structs import TokenChunk
    from nodes.engine.core import GenerationParams

    msg = make("generate_req", prompt=PROMPT, max_tokens=8, logprobs=3)
    call = host.client.request(host.server.endpoint, msg, timeout=60)
    chunks = [TokenChunk.from_message(m) for m in call.replies(60) if m.type == "token_chunk"]
    tokens = [int(t) for c in chunks for t in c.tokens]
    got = np.concatenate([c.logprobs for c in chunks])
    assert all(c.top_n == 3 and len(c.top_ids) == 3 * len(c.tokens) for c in chunks)
    ids = tiny_backend.tokenizer.encode(PROMPT, chat=True)
    local = [b for b in Engine(tiny_backend).stream(ids, GenerationParams(max_tokens=8,
                                                                           logprobs=3))]
    assert tokens == [t for b in local for t in b.token_ids]
    np.testing.assert_allclose(got, np.concatenate([b.logprobs.logprobs for b in local]),
                               atol=1e-5)
    call = host.client.request(host.server.endpoint, make("generate_req", prompt=PROMPT,
                                                          max_tokens=8), timeout=60)
    plain = [TokenChunk.from_message(m) for m in call.replies(60) if m.type == "token_chunk"]
    assert plain and all(len(c.logprobs) == 0 and c.top_n is None for c in plain)  # not asked


def test_a_connection_may_fill_the_batch_plus_a_bounded_queue_and_others_go_first(
        host, tiny_backend):
    """Issue 24: one connection (a gateway carrying all its users) may hold the batch plus
    `generations_per_peer` (8) queued; one more is `busy`, saying why. Another connection's
    request, queued after all of those, joins the batch before the hog's queued ones (the
    queue is taken fewest-running-connection first). The compute thread is held in its first
    request's start until everything is queued, so the order is not a matter of timing."""
    from bus.streams import StreamClient
    from nodes.node_common.admission import AdmissionLimits
    from tests.polling import wait_until

    role = VerifierRole(Engine(tiny_backend, None, max_draft=4), max_batch=2)
    assert role.slots.per_peer == 2 + AdmissionLimits().generations_per_peer == 10
    gate, started = threading.Event(), []
    begin = role._begin

    def held_begin(req, parsed):
        started.append(req.message.get("prompt"))
        gate.wait(60)
        return begin(req, parsed)

    role._begin = held_begin
    role.attach(host)
    other = StreamClient(host.loop, host.factory, sender="other")
    try:
        def ask(client, prompt):
            return client.request(host.server.endpoint, make(
                "generate_req", prompt=prompt, max_tokens=4, chat=False), timeout=120)

        calls = [ask(host.client, f"hog {i}") for i in range(12)]
        assert wait_until(lambda: role.queued == 9 and started == ["hog 0"], 30)
        for call in calls[10:]:
            with pytest.raises(RemoteError) as err:
                call.result(30)
            assert err.value.code == "busy" and "has 10 generations queued or running" in str(
                err.value)
        mine = ask(other, "other")
        assert wait_until(lambda: role.queued == 10, 30)
        gate.set()
        assert mine.result(120).type == "done"
        assert all(call.result(120).type == "done" for call in calls[:10])
        assert started[:2] == ["hog 0", "other"]
        assert role.admission.snapshot()["rejected_busy"] == 2
    finally:
        gate.set()
        other.close()
        role.close()


def test_a_repeated_prompt_starts_from_the_prefix_cache_and_says_so(host, tiny_backend):
    """The request's `done` stats name the prompt positions the verifier did not prefill
    (`cached_tokens`, the gateway's `usage.prompt_tokens_details`), and the output is the
    same."""
    from nodes.engine.prefix_cache import PrefixCache

    host.membership = FakeMembership()
    pc = PrefixCache(tiny_backend, 64 << 20)
    role = VerifierRole(Engine(tiny_backend, None, max_draft=4, prefix_cache=pc),
                        policy=DraftPolicy(forced_s=5.0))
    role.attach(host)
    try:
        first = generate(host, prompt=PROMPT, chat=False)["stats"]
        again = generate(host, prompt=PROMPT, chat=False)["stats"]
        longer = generate(host, prompt=PROMPT + " five", chat=False)["stats"]
        telemetry = Roles(verifier=role).telemetry()["verifier"]
    finally:
        role.close()
    assert first["cached_tokens"] == 0
    assert again["cached_tokens"] == first["prompt_tokens"] - 1
    assert again["token_ids"] == first["token_ids"]
    # the first answer's tokens are kept too: a prompt continuing it reuses them
    assert longer["cached_tokens"] >= first["prompt_tokens"] - 1
    assert telemetry["reused"] == again["cached_tokens"] + longer["cached_tokens"]


def test_a_grammar_compiles_off_the_compute_thread(host, verifier, monkeypatch):
    """Issue 46: a request's grammar compiles on the grammar thread as it arrives
    (`Grammars.prepare`); the compute thread starts it only once it is compiled, so a slow
    compile never stalls the requests behind (or beside) it. The compile is held on a gate:
    a free request sent after the constrained one is served to the end meanwhile, and the
    constrained one then completes, valid. A grammar that does not compile is a
    `bad_request` saying why, and the queue goes on. With `speculate: false` nothing is
    drafted, the grammar's forced tokens included: the baseline is plain decoding."""
    import json

    import nodes.engine.grammar as grammar_module

    gate, entered = threading.Event(), threading.Event()
    build = grammar_module._build

    def held(ll, c):
        entered.set()
        gate.wait(60)
        return build(ll, c)

    monkeypatch.setattr(grammar_module, "_build", held)
    schema = {"type": "object", "properties": {"held": {"type": "integer"}},
              "required": ["held"], "additionalProperties": False}
    constrained = host.client.request(host.server.endpoint, make(
        "generate_req", prompt=PROMPT, max_tokens=24,
        grammar={"kind": "json_schema", "text": json.dumps(schema)}), timeout=120)
    try:
        assert entered.wait(60)
        assert generate(host, prompt=PROMPT)["finish_reason"] in ("length", "eos")
        assert not constrained.done
    finally:
        gate.set()
    done = constrained.result(120)
    if done["finish_reason"] == "eos":
        assert set(json.loads(done["text"])) == {"held"}
    else:
        assert done["text"].startswith('{"held":')
    # `speculate: false` is the baseline: plain decoding, not even the grammar's forced tokens
    plain = generate(host, prompt=PROMPT, max_tokens=24, speculate=False,
                     grammar={"kind": "json_schema", "text": json.dumps(schema)})
    assert plain["stats"]["drafted"] == 0 and plain["text"] == done["text"]
    monkeypatch.setattr(grammar_module, "_build", build)
    err = refused(host, prompt=PROMPT, grammar={"kind": "json_schema",
                                                "text": '{"type": "objectx"}'})
    assert err.code == "bad_request" and "json_schema does not compile: Invalid type" in str(err)
    assert generate(host, prompt=PROMPT)["finish_reason"] in ("length", "eos")
