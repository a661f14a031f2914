"""`specbus bench flood` end to end on the tiny random Llama: real verifier and proposer
processes, a small flood with every hostile kind in it. The bench's own verdict (index within
its budget, the same answer before and after, the proposer still drafting) is its exit code;
the JSON has the figures docs/benchmarks.md quotes. Memory is printed, never judged here."""

from __future__ import annotations

import json

import pytest

from nodes.cli import main

pytestmark = pytest.mark.slow


def test_a_small_flood_keeps_the_index_within_its_budget_and_the_proposer_drafting(
        tmp_path, tiny_folder):
    out = tmp_path / "flood.json"
    rc = main(["bench", "flood", "--gib", "0.02", "--budget", "1", "--senders", "64",
               "--max-tokens", "8", "--model", str(tiny_folder), "--json", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0, {k: doc[k] for k in ("within_budget", "answers_identical",
                                         "drafted_by_proposer_after")}
    flood, idx = doc["flood"], doc["index"]
    assert flood["publications"] == 655 and flood["sent_mib"] > 19
    assert all(flood["kinds"][k] >= 6 for k in ("malformed", "foreign", "oversized"))
    # what the proposer took: the valid ones it could index, the rest counted by kind
    assert idx["indexed"] >= 2 and idx["foreign"] >= 1 and idx["malformed"] >= 1
    assert doc["max_index_bytes"] <= 1 << 20 and idx["index_bytes"] <= 1 << 20
    assert doc["rss_mb"]["peak"] >= doc["rss_mb"]["before"] > 0
