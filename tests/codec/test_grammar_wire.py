"""`generate_req.grammar` travels as a `{kind, text}` map, bounded; absent when free."""

import pytest

from codec.errors import BadRequest
from codec.messages import decode, encode
from codec.structs import MAX_GRAMMAR_BYTES, GenerateReq


def test_grammar_round_trips_and_is_absent_when_free():
    req = GenerateReq(prompt="hi", grammar={"kind": "regex", "text": "[0-9]+"})
    back = GenerateReq.from_message(decode(encode(req.to_message(sender="n", seq=1, rid=2))))
    assert back.grammar == {"kind": "regex", "text": "[0-9]+"}
    free = GenerateReq(prompt="hi").to_message(sender="n", seq=1, rid=2)
    assert "grammar" not in free.fields


@pytest.mark.parametrize("grammar, field", [
    ({"kind": "xml", "text": "<a/>"}, "grammar.kind"),
    ({"kind": "regex", "text": "x" * (MAX_GRAMMAR_BYTES + 1)}, "grammar.text"),
    ({"kind": "regex", "text": 3}, "grammar.text"),
    ({"kind": "regex", "text": "a", "more": 1}, "grammar"),
    ("[0-9]+", "grammar"),
])
def test_bad_grammars_name_the_field(grammar, field):
    with pytest.raises(BadRequest) as err:
        GenerateReq(prompt="hi", grammar=grammar)
    assert err.value.field == field
