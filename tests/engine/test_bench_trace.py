"""`specbus bench decode --trace` end to end on the tiny random Llama: every row decodes every
request and agrees with HF greedy (token ids and bytes), the JSON has the figures the docs
quote. Speeds are printed, never judged here (docs/testing.md)."""

from __future__ import annotations

import json

import pytest

from nodes.cli import main


def _bench(tmp_path, tiny_folder, *extra: str) -> dict:
    out = tmp_path / "trace.json"
    rc = main(["bench", "decode", "--trace", "agent_tools,file_edits", "--limit", "2",
               "--max-tokens", "6", "--model", str(tiny_folder), "--json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_trace_bench_in_process_rows_and_singles(tmp_path, tiny_folder):
    doc = _bench(tmp_path, tiny_folder, "--no-cluster", "--singles", "--singles-rounds", "2")
    assert doc["traces"] == ["agent_tools", "file_edits"]
    for name in doc["traces"]:
        recs = doc["requests"][name]
        assert [r["request"] for r in recs] == [0, 1]
        for r in recs:
            assert set(r["rows"]) == {"plain", "ngram", "suffix", "hf-plain", "hf-prompt-lookup"}
            assert all(r["identical_to_hf"].values()), r["identical_to_hf"]
        assert doc["summary"][name]["all"]["identical_to_hf"] == 2
        # the oracle ceiling of every request (tools/trace_ceiling.py, tested there)
        assert all(r["ceiling"]["suffix_vs_plain"] > 0 for r in recs)
        assert set(doc["summary"][name]["all"]["ceiling"]) >= {"suffix_vs_plain",
                                                               "suffix_vs_ngram"}
    # traces are taken in turn: request 0 of each, then request 1 of each
    order = sorted((r["run_order"], r["trace"], r["request"])
                   for recs in doc["requests"].values() for r in recs)
    assert [(t, j) for _, t, j in order] == [("agent_tools", 0), ("file_edits", 0),
                                              ("agent_tools", 1), ("file_edits", 1)]
    # the in-process suffix index kept what the run wrote (warm-up included)
    assert doc["index"]["documents"] >= 1 and doc["index"]["bytes"] <= doc["index"]["budget"]
    classes = doc["singles_summary"]
    assert set(classes) == {"input-grounded", "open-ended"}
    assert all(s["identical_to_hf"] == s["prompts"] for s in classes.values())
    assert all(s["ceiling"]["suffix_vs_hf_lookup"]["median"] > 0 for s in classes.values())
    assert all(s["plain-again_vs_plain"]["worst"] > 0 for s in classes.values())
    # every single ran in both rounds, every run checked against HF greedy; each row's
    # figure is one of its runs
    for s in doc["singles"]:
        assert s["rounds"] == 2 and all(s["identical_to_hf"].values()), s["identical_to_hf"]
        # the A/A control: a second plain engine, measured like the rows it judges
        assert set(s["rows"]) == {"plain", "ngram", "suffix", "plain-again", "hf-plain",
                                  "hf-prompt-lookup"}
        assert s["vs_plain"]["plain-again"] > 0 and "plain-again" not in s["vs_ngram"]
        for row in s["rows"].values():
            assert len(row["s_runs"]) == 2 and row["s"] in row["s_runs"]
    assert "late" not in doc


@pytest.mark.slow
def test_trace_bench_with_the_shared_cluster_and_a_late_verifier(tmp_path, tiny_folder):
    """Real node processes: 2 verifiers, a suffix proposer each, then a late pair."""
    doc = _bench(tmp_path, tiny_folder, "--late", "1")
    for recs in doc["requests"].values():
        for r in recs:
            assert {"suffix-shared", "bus-plain"} <= set(r["rows"])
            assert all(r["identical_to_hf"].values()), r["identical_to_hf"]
            # requests alternate between the verifiers, each drafting with its own proposer
            v = r["verifier"]
            assert r["rows"]["suffix-shared"]["proposers_used"], r["rows"]["suffix-shared"]
            assert v == f"v{r['run_order'] % 2}"
    late = doc["late"]
    assert late["start"]["snapshots"] >= 1
    assert [(r["trace"], r["request"]) for r in late["requests"]] == [("agent_tools", 0),
                                                                       ("file_edits", 0)]
    for r in late["requests"]:
        assert all(r["identical_to_plain"].values()), r


def test_a_pinned_thread_can_be_moved_to_another_core():
    """In-process rows pin this thread to the verifier's core and back: the second pin must not
    be limited by the first (a thread's own affinity, once pinned, names one core only)."""
    import os

    from tools import bench_trace

    allowed = bench_trace._ALLOWED
    if len(allowed) < 2:
        pytest.skip("needs two cores")
    a, b = sorted(allowed)[:2]
    before = os.sched_getaffinity(0)
    try:
        bench_trace._pin({a})
        assert os.sched_getaffinity(0) == {a}
        bench_trace._pin({b})
        assert os.sched_getaffinity(0) == {b}
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.slow
def test_trace_bench_shared_row_with_an_int8_proposer_beside_the_suffix_ones(tmp_path,
                                                                            tiny_folder):
    """`--shared-int8`: the shared row's verifiers draft with their suffix proposer and one
    int8 proposer; with `--bus-ngram` the same verifier also drafts with an ngram proposer in
    the suffix one's place, beside the same int8 proposer; every output still equals HF
    greedy's."""
    doc = _bench(tmp_path, tiny_folder, "--late", "0", "--shared-int8", "--bus-ngram")
    assert doc["shared_proposers"] == "suffix+int8"
    assert doc["bus_ngram_proposers"] == "ngram+int8"
    for recs in doc["requests"].values():
        for r in recs:
            assert all(r["identical_to_hf"].values()), r["identical_to_hf"]
            shared, ngram = r["rows"]["suffix-shared"], r["rows"]["bus-ngram"]
            assert len(shared["proposers_used"]) == 2, r["rows"]
            # both rows ran on one verifier with the same int8 proposer; only the other
            # proposer differs
            assert len(ngram["proposers_used"]) == 2, r["rows"]
            assert set(shared["proposers_used"]) != set(ngram["proposers_used"])
            assert r["shared_vs_bus_ngram"] > 0
        assert doc["summary"][next(iter(doc["requests"]))]["all"]["shared_vs_bus_ngram"]
