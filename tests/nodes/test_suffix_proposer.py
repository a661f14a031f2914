"""A suffix proposer as its own process on loopback (`specbus node --role proposer --drafter
suffix`), drafting for a tiny-model verifier process with forced drafting: the output is the
verifier's own, and the proposer's global index, fed by the first session's close, drafts the
repeated request (the proposer role is unchanged: the drafter is all that differs)."""

from __future__ import annotations

import pytest

from nodes.cluster_client import ClusterClient, GenerateRequest
from tools.local_cluster import LocalCluster

PROMPT = "Write the numbers from one to twenty in words, separated by commas."
MAX = 24


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from nodes import models
    from tests.engine.conftest import build_tiny

    folder = tmp_path_factory.mktemp("tiny-suffix")
    build_tiny(folder, models.resolve(models.DEFAULT_MODEL).path, seed=0)
    return folder


def test_a_suffix_proposer_process_drafts_and_the_output_is_the_verifiers(tmp_path, tiny_model):
    with LocalCluster(log_dir=tmp_path, mdns=False) as c:
        # --no-share: the verifier publishes nothing (tests/nodes/test_suffix_share.py covers
        # publication), so the proposer's index holds only what its own sessions wrote
        v = c.start_node("v", "--role", "verifier", "--model", str(tiny_model), "--threads", "1",
                         "--no-share")
        p = c.start_node("suffix", "--role", "proposer", "--drafter", "suffix",
                         "--suffix-budget", "4")
        with ClusterClient(c.cluster, peers=(v.stream,), mdns=False) as cc:
            seen = cc.wait_for(lambda ms: {"v", "suffix"} <= {m.card.name for m in ms}, 60)
            assert {"v", "suffix"} <= {m.card.name for m in seen}
            target = next(m for m in cc.verifiers() if m.card.name == "v")
            card = next(m.card for m in seen if m.card.name == "suffix")
            assert card.extras["drafter"] == "suffix"
            plain = cc.generate(GenerateRequest(PROMPT, max_tokens=MAX, speculate=False), target)
            runs = [cc.generate(GenerateRequest(PROMPT, max_tokens=MAX, proposers=[p.node_id],
                                                force_draft=True), target) for _ in range(2)]
    for res in runs:
        assert res.stats["token_ids"] == plain.stats["token_ids"]
        assert res.stats["proposers"][p.node_id]["chunks"] >= 1
        assert res.stats["proposers"][p.node_id]["bad_replies"] == 0
    # the first answer entered the proposer's index when its session closed: the second is
    # drafted from it (most of it accepted; forwards counted, never timed)
    first, second = (r.stats["proposers"][p.node_id] for r in runs)
    assert second["accepted"] > first["accepted"] and second["accepted"] >= MAX // 2, runs
