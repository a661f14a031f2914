"""Typed structs: every bad value is a BadRequest naming its field; good ones round-trip."""

import math

import numpy as np
import pytest

from codec.errors import BadRequest
from codec.messages import decode, encode, make
from codec.sampling import SamplingParams
from codec.structs import (
    MAX_ALTERNATIVES,
    DraftChunk,
    GenerateReq,
    SessionOpen,
    parse,
)

TOKENS = np.array([1, 2, 3], dtype=np.int32)


def wire(msg):
    return decode(encode(msg))


def gen(**fields):
    fields.setdefault("prompt", "hello")
    return GenerateReq.from_message(wire(make("generate_req", **fields)))


@pytest.mark.parametrize("fields, field", [
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"prompt": "   "}, "prompt"),
    ({"stop": [""]}, "stop[0]"),
    ({"proposers": [""]}, "proposers[0]"),
    ({"draft": "please"}, "draft"),
    ({"draft": "force"}, "proposers"),
    ({"draft": "force", "proposers": ["p"], "speculate": False}, "draft"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),  # with the prompt
])
def test_bad_generate_values_name_the_field(fields, field):
    with pytest.raises(BadRequest) as info:
        gen(**fields)
    assert info.value.code == "bad_request"
    assert info.value.field == field
    assert field in str(info.value)


def test_prompt_and_tokens_together_is_a_bad_request():
    with pytest.raises(BadRequest) as info:
        GenerateReq.from_message(wire(make("generate_req", prompt="x", tensors=[TOKENS])))
    assert info.value.field == "tokens"


@pytest.mark.parametrize("messages, field", [
    ([], "messages"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": "a"}, "b"], "messages[1]"),
    ([{"role": "user", "content": "a"}] * 257, "messages"),
])
def test_bad_messages_name_the_entry(messages, field):
    with pytest.raises(BadRequest) as info:
        GenerateReq.from_message(wire(make("generate_req", messages=messages)))
    assert info.value.field == field


def test_nothing_to_generate_from_is_a_bad_request():
    with pytest.raises(BadRequest) as info:
        GenerateReq.from_message(wire(make("generate_req", max_tokens=3)))
    assert info.value.field == "prompt"


def test_two_dimensional_or_negative_tokens_are_refused_by_the_struct():
    with pytest.raises(BadRequest) as info:
        GenerateReq(tokens=np.zeros((2, 3), dtype=np.int32))
    assert info.value.field == "tokens" and "1-D" in str(info.value)
    with pytest.raises(BadRequest) as info:
        GenerateReq.from_message(wire(make("generate_req",
                                           tensors=[np.array([3, -1], np.int32)])))
    assert info.value.field == "tokens"


def test_defaults_apply_only_to_absent_fields_and_round_trip():
    req = gen()
    assert (req.max_tokens, req.sampling, req.stop, req.chat, req.speculate) == (
        128, SamplingParams(), (), True, True)
    full = GenerateReq(messages=({"role": "user", "content": "hi"},), max_tokens=7,
                       sampling=SamplingParams(0.7, 0.9, 40, 5), stop=("\n",),
                       proposers=("a", "b"), draft="force")
    back = GenerateReq.from_message(wire(full.to_message()))
    assert back.messages == full.messages and back.sampling == full.sampling
    assert (back.max_tokens, back.stop, back.proposers, back.force_draft) == (
        7, ("\n",), ("a", "b"), True)
    # nil on the wire means "not given"
    assert gen(top_p=None).sampling.top_p == 1.0


def test_sampling_is_one_type_with_one_check_in_both_wire_forms():
    """Flat in generate_req, a `sampling` map in session_open: the same SamplingParams, the
    same refusal (named after the map there)."""
    sp = SamplingParams(0.5, 0.9, 7, 11)
    req = GenerateReq.from_message(wire(GenerateReq(prompt="x", sampling=sp).to_message()))
    opened = SessionOpen.from_message(wire(SessionOpen("s", TOKENS, 5.0, sp).to_message()))
    assert req.sampling == opened.sampling == sp
    bad = SamplingParams(top_p=0.0)  # construction does not check: the engine reports its own
    for build, field in [(lambda: bad.check(), "top_p"),
                         (lambda: GenerateReq(prompt="x", sampling=bad), "top_p"),
                         (lambda: SessionOpen("s", TOKENS, 5.0, bad), "sampling.top_p")]:
        with pytest.raises(BadRequest) as info:
            build()
        assert info.value.field == field


def test_every_struct_field_is_in_its_schema():
    """Each message's kind-level schema is derived from its one declaration."""
    from codec.structs import STRUCTS

    assert GenerateReq.SCHEMA.optional["top_p"] == "float"  # a flat record's fields
    assert SessionOpen.SCHEMA.optional["sampling"] == "map"
    assert SessionOpen.SCHEMA.required == {"lease_s": "float"}
    for cls in STRUCTS.values():
        schema = cls.SCHEMA
        named = {*schema.required, *schema.optional, *(r.name for r in schema.tensors)}
        for name in cls.__dataclass_fields__:
            assert name in named or name in ("session", "sampling"), (cls.TYPE, name)


def test_session_open_checks_lease_sampling_and_tokens():
    def open_(**kw):
        fields = {"lease_s": 5.0, **kw}
        tensors = fields.pop("tensors", [TOKENS])
        return SessionOpen.from_message(wire(make("session_open", session="s", tensors=tensors,
                                                  **fields)))

    assert open_().tokens.tolist() == [1, 2, 3]
    for kw, field in [({"lease_s": 0.0}, "lease_s"), ({"lease_s": 1e9}, "lease_s"),
                      ({"sampling": {"top_p": 0.0}}, "sampling.top_p"),
                      ({"sampling": {"seed": -1}}, "sampling.seed"),
                      ({"sampling": {"temperature": "hot"}}, "sampling.temperature"),
                      ({"tensors": [np.zeros(0, np.int32)]}, "tokens")]:
        with pytest.raises(BadRequest) as info:
            open_(**kw)
        assert info.value.field == field, kw
    with pytest.raises(BadRequest) as info:
        SessionOpen.from_message(wire(make("session_open", lease_s=1.0, tensors=[TOKENS])))
    assert info.value.field == "sid"


def test_a_draft_chunk_tree_round_trips_and_a_chain_stays_one_tensor():
    tree = DraftChunk("s", 7, np.array([5, 6, 7], np.int32), 2,
                      alt_tokens=np.array([9, 10, 11], np.int32),
                      alt_parents=np.array([-1, 1, 4], np.int32),  # 11 hangs under 10
                      conf=np.array([0.5, 0.6, 0.7], np.float32),
                      alt_conf=np.array([0.2, 0.3, 1.0], np.float32))
    back = parse(wire(tree.to_message(more=True)))
    assert back.is_tree and back.base == 7 and back.chunk == 2
    assert back.alt_tokens.tolist() == [9, 10, 11] and back.alt_parents.tolist() == [-1, 1, 4]
    assert np.allclose(back.conf, [0.5, 0.6, 0.7]) and np.allclose(back.alt_conf, [.2, .3, 1])
    chain = DraftChunk("s", 7, np.array([5, 6], np.int32))
    msg = wire(chain.to_message())
    assert len(msg.tensors) == 1 and not parse(msg).is_tree and parse(msg).conf is None
    # alternatives without probabilities (an n-gram proposer): three tensors
    ngram = DraftChunk("s", 7, np.array([5], np.int32), alt_tokens=np.array([9], np.int32),
                       alt_parents=np.array([-1], np.int32))
    msg = wire(ngram.to_message())
    assert len(msg.tensors) == 3 and parse(msg).conf is None


def test_draft_classes_round_trip_one_per_chain_token_or_none():
    classed = DraftChunk("s", 7, np.array([5, 6, 7], np.int32), classes=("m5", "m5", ""))
    assert parse(wire(classed.to_message())).classes == ("m5", "m5", "")
    assert parse(wire(DraftChunk("s", 7, np.array([5], np.int32)).to_message())).classes == ()
    # an older proposer's chunk (no field at all) decodes as "no classes"
    msg = wire(DraftChunk("s", 7, np.array([5], np.int32)).to_message())
    msg.fields.pop("classes", None)
    assert parse(msg).classes == ()


@pytest.mark.parametrize("classes, why", [
    (("m5",), "must be 3 labels"),  # one per chain token
    (("m5", "m5", "x" * 17), "characters"),
    (("m5", "m5", 5), "string"),
])
def test_bad_draft_classes_name_the_field(classes, why):
    with pytest.raises(BadRequest) as info:
        DraftChunk("s", 7, np.array([5, 6, 7], np.int32), classes=classes)
    assert info.value.field.startswith("classes") and why in str(info.value)


@pytest.mark.parametrize("kw, field", [
    ({"alt_parents": np.array([-1, 5], np.int32)}, "alt_parents"),  # 5: itself (n + 1 = 4)
    ({"alt_parents": np.array([-2, 0], np.int32)}, "alt_parents"),
    ({"alt_parents": np.array([0], np.int32)}, "alt_parents"),  # one parent for two
    ({"alt_tokens": np.array([9, -1], np.int32)}, "alt_tokens"),
    ({"alt_tokens": np.zeros(MAX_ALTERNATIVES + 1, np.int32),
      "alt_parents": np.full(MAX_ALTERNATIVES + 1, -1, np.int32),
      "alt_conf": np.zeros(MAX_ALTERNATIVES + 1, np.float32)}, "alt_tokens"),
    ({"conf": np.array([0.5, 1.5, 0.1], np.float32)}, "conf"),
    ({"conf": np.array([0.5, np.nan, 0.1], np.float32)}, "conf"),
    ({"alt_conf": np.array([0.5], np.float32)}, "alt_conf"),
    ({"alt_conf": None}, "conf"),  # one without the other
])
def test_bad_draft_chunk_trees_name_the_field(kw, field):
    args = {"alt_tokens": np.array([9, 10], np.int32),
            "alt_parents": np.array([-1, 3], np.int32),
            "conf": np.array([0.5, 0.6, 0.7], np.float32),
            "alt_conf": np.array([0.2, 0.1], np.float32), **kw}
    with pytest.raises(BadRequest) as info:
        DraftChunk("s", 7, np.array([5, 6, 7], np.int32), 1, **args)
    assert info.value.field == field



def test_suffix_publications_and_snapshots_are_checked():
    from codec.structs import MAX_PUB_TOKENS, SuffixPub, SuffixSnapshot

    pub = SuffixPub("c", "fp", np.array([5, 6, 7], np.int32), output_start=1)
    back = parse(wire(pub.to_message()))
    assert back.tokens.tolist() == [5, 6, 7] and back.output_start == 1
    for kw, field in [({"tokens": np.zeros(MAX_PUB_TOKENS + 1, np.int32)}, "tokens"),
                      ({"output_start": 3}, "output_start"), ({"tokenizer": ""}, "tokenizer"),
                      ({"tokens": np.array([-1], np.int32)}, "tokens")]:
        args = {"cluster": "c", "tokenizer": "fp", "tokens": np.array([5, 6, 7], np.int32),
                "output_start": 0, **kw}
        with pytest.raises(BadRequest) as info:
            SuffixPub(**args)
        assert info.value.field == field, kw
    snap = SuffixSnapshot.of("fp", ((np.array([1, 2, 3], np.int32), 0),
                                    (np.array([4], np.int32), 0)))
    got = parse(wire(snap.to_message()))
    assert [(t.tolist(), st) for t, st in got.docs] == [([1, 2, 3], 0), ([4], 0)]
    bad = snap.to_message()
    bad.tensors[1] = np.array([3, 3], np.int32)  # lengths that do not add up to the tokens
    with pytest.raises(BadRequest):
        parse(wire(bad))


def test_suffix_prompt_hashes_are_optional_and_checked():
    from codec.structs import SuffixPub, SuffixSnapshot

    h = "0123456789abcdef" * 2
    pub = SuffixPub("c", "fp", np.array([5, 6, 7], np.int32), 0, h)
    assert parse(wire(pub.to_message())).prompt_hash == h
    bare = SuffixPub("c", "fp", np.array([5, 6, 7], np.int32), 0).to_message()
    assert "prompt_hash" not in bare.fields and parse(wire(bare)).prompt_hash is None
    for bad in ("0123", h.upper(), h[:-1] + "g", h + "0", 7):
        with pytest.raises(BadRequest) as info:
            SuffixPub("c", "fp", np.array([5], np.int32), 0, bad)
        assert info.value.field == "prompt_hash", bad
    docs = ((np.array([1, 2], np.int32), 0), (np.array([3], np.int32), 0))
    snap = parse(wire(SuffixSnapshot.of("fp", docs, (h, None)).to_message()))
    assert snap.prompt_hashes == (h, "")
    assert "prompt_hashes" not in SuffixSnapshot.of("fp", docs, (None, "")).to_message().fields
    for hashes, field in (((h,), "prompt_hashes"), ((h, "x" * 32), "prompt_hashes[1]")):
        with pytest.raises(BadRequest) as info:
            SuffixSnapshot("fp", np.array([1, 2, 3], np.int32), np.array([2, 1], np.int32),
                           np.array([0, 0], np.int32), hashes)
        assert info.value.field == field
