"""The shared suffix index across processes (issue 25): a verifier publishes what it generates,
suffix proposers index it, a proposer that joins late starts warm from a verifier's snapshot,
and a verifier started after the first answer gets the repeated request drafted whole.

Tiny-model verifiers and suffix proposers as real processes on loopback. The first answer is
decoded plainly (`speculate=False`): no proposer sees it but through a publication. Verdicts
count tokens (forced drafting, never timed); every output equals the plain one.
"""

from __future__ import annotations

import pytest

from nodes.cluster_client import ClusterClient, GenerateRequest
from nodes.telemetry import StatsWatcher
from tests.nodes.test_suffix_proposer import tiny_model  # noqa: F401 - fixture
from tests.polling import wait_until
from tools.bench_trace import INDEX
from tools.local_cluster import LocalCluster

pytestmark = pytest.mark.slow

PROMPT = "Write the numbers from one to twenty in words, separated by commas."
MAX = 24


def forced(cc, target, proposer_id):
    return cc.generate(GenerateRequest(PROMPT, max_tokens=MAX, proposers=[proposer_id],
                                       force_draft=True), target)


def test_answers_are_shared_across_verifiers_and_late_proposers(tmp_path, tiny_model):  # noqa: F811
    tiny = ("--model", str(tiny_model), "--threads", "1")
    with LocalCluster(log_dir=tmp_path, mdns=False) as c:
        v1 = c.start_node("v1", "--role", "verifier", *tiny)
        p1 = c.start_node("suffix1", "--role", "proposer", "--drafter", "suffix",
                          "--suffix-budget", "4")
        quiet = c.start_node("quiet", "--role", "verifier", "--no-share", *tiny)
        with ClusterClient(c.cluster, peers=(v1.stream,), mdns=False) as cc:
            tel = StatsWatcher(cc.node, c.cluster)
            cc.wait_for(lambda ms: {"v1", "suffix1", "quiet"} <= {m.card.name for m in ms}, 60)
            target = next(m for m in cc.verifiers() if m.card.name == "v1")
            plain = cc.generate(GenerateRequest(PROMPT, max_tokens=MAX, speculate=False),
                                target)
            # the answer reached the proposer as a publication only (no session saw it)
            assert wait_until(lambda: tel.latest(p1.node_id, *INDEX).get("indexed", 0) >= 1, 60), \
                tel.latest(p1.node_id, *INDEX)

            # a verifier started after the answer was given: the repeat is drafted from it
            v2 = c.start_node("v2", "--role", "verifier", *tiny, seed=True)
            cc.wait_for(lambda ms: any(m.node_id == v2.node_id for m in ms), 60)
            late_verifier = next(m for m in cc.verifiers() if m.node_id == v2.node_id)
            again = forced(cc, late_verifier, p1.node_id)
            assert again.stats["token_ids"] == plain.stats["token_ids"]
            first_use = again.stats["proposers"][p1.node_id]
            assert first_use["accepted"] >= MAX // 2, first_use

            # a proposer started after the answer: warm from a verifier's snapshot
            p2 = c.start_node("suffix2", "--role", "proposer", "--drafter", "suffix",
                              "--suffix-budget", "4", seed=True)
            assert wait_until(lambda: tel.latest(p2.node_id, *INDEX).get("snapshots", 0) >= 1
                              and tel.latest(p2.node_id, *INDEX).get("indexed", 0) >= 1, 60), \
                tel.latest(p2.node_id, *INDEX)
            cc.wait_for(lambda ms: any(m.node_id == p2.node_id for m in ms), 60)
            warm = forced(cc, target, p2.node_id)
            assert warm.stats["token_ids"] == plain.stats["token_ids"]
            assert warm.stats["proposers"][p2.node_id]["accepted"] >= MAX // 2

            # --no-share publishes nothing
            quiet_m = next(m for m in cc.verifiers() if m.node_id == quiet.node_id)
            cc.generate(GenerateRequest("Name a colour.", max_tokens=4, speculate=False),
                        quiet_m)
            assert wait_until(
                lambda: tel.latest(quiet.node_id, "verifier").get("generations", 0) >= 1, 30)
            assert "suffix_published" not in tel.latest(quiet.node_id, "verifier")
            assert tel.latest(v1.node_id, "verifier").get("suffix_published", 0) >= 1
