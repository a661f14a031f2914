"""`specbus bench structured --gateway-only` end to end on the tiny random Llama: real node
processes on loopback (a verifier per configuration, an ngram proposer, a gateway; a cluster of
its own each round) and the openai client. What it pins: the run comes up with a verifier per
configuration under its own served name (the bench refuses to run unless the gateway lists
exactly those two, and each request names its configuration's), every speculative answer equals
plain's, and the JSON carries the figures docs/benchmarks.md quotes. Speeds are printed, never
judged (docs/testing.md)."""

from __future__ import annotations

import json

import pytest

from nodes.cli import main

pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from nodes import models
    from tests.engine.conftest import build_tiny

    folder = tmp_path_factory.mktemp("tiny_bench_structured_gateway")
    build_tiny(folder, models.resolve(models.DEFAULT_MODEL).path, seed=0)
    return folder


@pytest.mark.slow
def test_gateway_rows_a_verifier_per_configuration(tmp_path, tiny_folder):
    out = tmp_path / "gw.json"
    rc = main(["bench", "structured", "--gateway-only", "--quick", "--no-agent", "--weights",
               "fp32", "--max-tokens", "12", "--model", str(tiny_folder), "--json", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())["gateway"]
    assert rep["verifiers"] == {"plain": "bench-plain", "speculative": "bench-speculative"}
    assert rep["speculative_not_equal_plain"] == 0
    assert rep["invalid_outputs"] == 0
    assert rep["rounds"] == 2 and rep["proposers"] == ["ngram"]
    for w in ("extraction", "tools"):
        assert rep[w]["requests"] == 3 and rep[w]["speedup_worst"] > 0
    for r in rep["per_request"]:
        assert len(r["plain_s"]) == len(r["speculative_s"]) == 2
