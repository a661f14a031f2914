"""200 generated JSON schemas (issue 46): every constrained output of the tiny random Llama is
JSON valid against its schema (a small validator of our own: `jsonschema` is not a dependency),
and constrained speculation (ngram drafts + the grammar's forced tokens) commits exactly the
tokens of constrained plain decoding.

The schemas are built by a hypothesis strategy of our own: objects, arrays, enums, consts,
bounded integers and numbers, strings, booleans and nulls, nested two deep, every size bounded
so the output is (a random model finishes it within `MAX_TOKENS`). A bare `"type": "number"`
is not bounded: the grammar allows any number of fraction digits and the random model writes
them until `max_tokens` (an invalid, cut answer): numbers here are multiples of 1/4."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodes.drafters.ngram import NgramDrafter
from nodes.engine import Engine, GenerationParams
from nodes.engine.grammar import Constraint

EXAMPLES = 200
MAX_TOKENS = 160
NAMES = st.sampled_from(["id", "name", "age", "kind", "tags", "ok", "x", "score", "note", "a_b"])
SHORT = st.text(alphabet="abcxyz -_", min_size=0, max_size=5)


@st.composite
def _integer(draw):
    lo = draw(st.integers(-50, 50))
    return {"type": "integer", "minimum": lo, "maximum": lo + draw(st.integers(0, 200))}


@st.composite
def _number(draw):
    lo = draw(st.integers(-10, 10))
    # a multiple of 1/4: a bare "number" lets a random model write digits forever (see below)
    return {"type": "number", "minimum": lo, "maximum": lo + draw(st.integers(1, 100)),
            "multipleOf": 0.25}


@st.composite
def _string(draw):
    hi = draw(st.integers(0, 6))
    return {"type": "string", "minLength": draw(st.integers(0, hi)), "maxLength": hi}


LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    _integer(), _number(), _string(),
    st.lists(st.one_of(SHORT, st.integers(-9, 99), st.booleans()), min_size=1, max_size=4,
             unique_by=lambda v: (type(v).__name__, v)).map(lambda vs: {"enum": vs}),
    st.one_of(SHORT, st.integers(0, 9)).map(lambda v: {"const": v}),
)


def _containers(inner):
    array = st.builds(
        lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo,
                                  "maxItems": lo + extra},
        inner, st.integers(0, 1), st.integers(0, 2))

    @st.composite
    def obj(draw):
        names = draw(st.lists(NAMES, min_size=1, max_size=3, unique=True))
        props = {n: draw(inner) for n in names}
        required = [n for n in names if draw(st.booleans())]
        return {"type": "object", "properties": props, "required": required,
                "additionalProperties": False}

    return st.one_of(array, obj())


#: the top level is an object (what structured output asks for) or, now and then, anything
SCHEMAS = st.one_of(
    _containers(st.recursive(LEAVES, _containers, max_leaves=3)).filter(
        lambda s: s["type"] == "object"),
    st.recursive(LEAVES, _containers, max_leaves=4),
)


def conforms(value, schema) -> bool:
    """`value` valid against `schema` (the keywords SCHEMAS uses)."""
    if "const" in schema:
        return _same(value, schema["const"])
    if "enum" in schema:
        return any(_same(value, v) for v in schema["enum"])
    kind = schema.get("type")
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "null":
        return value is None
    if kind in ("integer", "number"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if kind == "integer" and not (isinstance(value, int) or float(value).is_integer()):
            return False
        return math.isfinite(value) and schema["minimum"] <= value <= schema["maximum"] and \
            (value / schema.get("multipleOf", 1)).is_integer() if kind == "number" else \
            schema["minimum"] <= value <= schema["maximum"]
    if kind == "string":
        return isinstance(value, str) and \
            schema["minLength"] <= len(value) <= schema["maxLength"]
    if kind == "array":
        return isinstance(value, list) and \
            schema["minItems"] <= len(value) <= schema["maxItems"] and \
            all(conforms(v, schema["items"]) for v in value)
    if kind == "object":
        props = schema["properties"]
        return isinstance(value, dict) and set(value) <= set(props) and \
            set(schema["required"]) <= set(value) and \
            all(conforms(v, props[k]) for k, v in value.items())
    raise AssertionError(f"keyword the validator does not know: {schema}")


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b or (
        isinstance(a, int | float) and isinstance(b, int | float)
        and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def test_the_validator_says_no():
    s = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                "maximum": 3}}, "required": ["a"],
         "additionalProperties": False}
    assert conforms({"a": 2}, s)
    assert not conforms({"a": 4}, s) and not conforms({}, s) and not conforms({"a": 1, "b": 1}, s)
    assert not conforms({"a": True}, s) and not conforms({"a": 1.5}, s)
    assert not conforms("x", {"enum": [1, "y"]}) and not conforms(1, {"const": True})


@pytest.fixture(scope="module")
def engines(tiny_torch):
    return (Engine(tiny_torch, grammar_drafts=False),
            Engine(tiny_torch, NgramDrafter(), fixed_k=4))


@pytest.fixture(scope="module")
def seen():
    out = {"runs": 0, "drafted": 0, "accepted": 0, "schemas": set(), "objects": 0,
           "tokens": 0}
    yield out
    assert out["runs"] >= EXAMPLES  # (hypothesis ran them all)
    assert len(out["schemas"]) >= EXAMPLES * 3 // 4 and out["objects"] >= EXAMPLES // 3
    print(f"\n{len(out['schemas'])} distinct schemas, {out['objects']} objects, "
          f"{out['tokens']} tokens, {out['accepted']}/{out['drafted']} drafts accepted")
    assert out["accepted"] > 0  # speculation did accept tokens: the equality is not vacuous


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(schema=SCHEMAS)
def test_generated_schemas_every_output_valid_speculation_identical(engines, prompt_ids, seen,
                                                                    schema):
    plain, spec = engines
    params = GenerationParams(max_tokens=MAX_TOKENS, constraint=Constraint.json_schema(schema))
    ref = plain.generate(prompt_ids, params)
    assert ref.finish_reason == "eos", (schema, ref.text)
    value = json.loads(ref.text)
    assert conforms(value, schema), (schema, ref.text)
    gen = spec.generate(prompt_ids, params)
    assert gen.token_ids == ref.token_ids, (schema, ref.text, gen.text)
    seen["runs"] += 1
    seen["schemas"].add(json.dumps(schema, sort_keys=True))
    seen["objects"] += isinstance(value, dict)
    seen["tokens"] += len(ref.token_ids)
    seen["drafted"] += gen.stats.drafted
    seen["accepted"] += gen.stats.accepted
