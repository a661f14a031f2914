"""A monitor attached to a real verifier + proposer: its stats agree with the verifier's own
report, and attaching or detaching changes nothing (no work sent to it, same output)."""

from __future__ import annotations

import argparse

import pytest

from nodes.cluster_client import ClusterClient, GenerateRequest
from tests.polling import wait_until as poll
from tools.monitor import Attached

pytestmark = pytest.mark.slow

PROMPT = ("Copy the following sentence exactly, word for word: The committee will meet on "
          "Tuesday at the main office to review the budget for the next fiscal year.")


def test_monitor_figures_match_and_attaching_changes_nothing(model_cluster):
    c = model_cluster
    v, p = c.node("v1"), c.node("ngram")
    seeds = (v.stream,)
    with ClusterClient(c.cluster, peers=seeds, mdns=False) as client:
        client.wait_for(lambda ms: {v.node_id, p.node_id} <= {m.node_id for m in ms}, 60)
        verifier = next(m for m in client.verifiers() if m.node_id == v.node_id)
        # speculation pinned to the ngram proposer: the figures below must have drafts in them
        req = GenerateRequest(PROMPT, max_tokens=40, proposers=[p.node_id], force_draft=True)
        before = client.generate(req, verifier)

        args = argparse.Namespace(cluster=c.cluster, interface="127.0.0.1",
                                  peer=[s.removeprefix("tcp://") for s in seeds],
                                  no_mdns=True)
        events = []
        mon = Attached(args, emit=events.append).start()
        try:
            def verifier_stats():
                ns = mon.view.stats(v.node_id)
                return ns.latest.get("verifier") if ns else None

            assert wait_until(lambda: verifier_stats() is not None), events[-5:]
            seen = verifier_stats()["generations"]
            with_monitor = client.generate(req, verifier)
            # the verifier's telemetry reports the acceptance of its last generation
            assert wait_until(lambda: verifier_stats()["generations"] == seen + 1), events[-5:]
            reported = verifier_stats()
            assert reported["acceptance"] == pytest.approx(
                with_monitor.stats["acceptance"], abs=1e-4)
            assert p.node_id in reported["proposers"]
            assert reported["proposers"][p.node_id]["drafts"] >= 1
            # the monitor is an observer: never offered work
            assert mon.node.node_id not in with_monitor.stats["proposers"]
            assert not mon.node.membership.card.is_worker
            kinds = {e["event"] for e in events}
            assert {"join", "stats"} <= kinds
        finally:
            mon.stop()
        after = client.generate(req, verifier)
    assert before.stats["token_ids"] == with_monitor.stats["token_ids"] == \
        after.stats["token_ids"]


def wait_until(pred, timeout: float = 60.0) -> bool:
    return poll(pred, timeout, step=0.2)
