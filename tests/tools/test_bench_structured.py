"""`specbus bench structured`'s pieces without a model: its workloads' constraints compile,
its validator and tool-call check say yes and no, and it is registered."""

from __future__ import annotations

import json

from nodes.engine.grammar import Constraint, validate
from nodes.gateway.tools import parse_tools, render_call, tool_grammar
from tools import bench
from tools import bench_structured as bs


def test_registered():
    assert bench.SUBCOMMANDS["structured"][0] == "tools.bench_structured"


def test_constraints_compile_and_answers_are_judged():
    for _, schema in bs.EXTRACTION:
        validate(Constraint.json_schema(schema))
    g = tool_grammar(parse_tools(bs.TOOLS, "required", False))
    validate(Constraint(g["kind"], g["text"]))
    review = bs.EXTRACTION[3][1]
    good = {"product": "X200", "sentiment": "mixed", "rating": 3, "pros": ["sound"],
            "cons": ["cushions"]}
    assert bs._valid_json(json.dumps(good), review)
    assert not bs._valid_json(json.dumps({**good, "rating": 6}), review)
    assert not bs._valid_json(json.dumps({**good, "extra": 1}), review)
    assert not bs._valid_json('{"product": "X2', review)
    call = render_call("get_weather", json.dumps({"city": "Oslo", "unit": "celsius"}))
    assert bs._valid_calls(call)
    assert not bs._valid_calls(render_call("get_weather", json.dumps({"city": "Oslo"})))
    assert not bs._valid_calls(render_call("launch", "{}"))
    assert not bs._valid_calls("It is sunny.")
