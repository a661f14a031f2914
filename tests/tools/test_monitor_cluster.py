"""A monitor attached to a real verifier + proposer: its stats agree with the verifier's own
report, and attaching or detaching changes nothing (no work sent to it, same output)."""

from __future__ import annotations

import argparse
import time

import pytest

from nodes.cluster_client import ClusterClient, GenerateRequest
from tools.local_cluster import LocalCluster
from tools.monitor import Attached

pytestmark = pytest.mark.slow

PROMPT = ("Copy the following sentence exactly, word for word: The committee will meet on "
          "Tuesday at the main office to review the budget for the next fiscal year.")


def test_monitor_figures_match_and_attaching_changes_nothing(tmp_path):
    with LocalCluster(log_dir=tmp_path / "logs", mdns=False) as c:
        v = c.start_node("v", "--role", "verifier")
        p = c.start_node("ngram", "--role", "proposer", seed=True)
        seeds = (v.stream, p.stream)
        with ClusterClient(c.cluster, peers=seeds, mdns=False) as client:
            client.wait_for(lambda ms: len([m for m in ms if m.card.is_worker]) >= 2, 20)
            req = GenerateRequest(PROMPT, max_tokens=40)
            before = client.generate(req)

            args = argparse.Namespace(cluster=c.cluster, interface="127.0.0.1",
                                      peer=[s.removeprefix("tcp://") for s in seeds],
                                      no_mdns=True)
            events = []
            mon = Attached(args, emit=events.append).start()
            try:
                with_monitor = client.generate(req)
                # the verifier's telemetry reports the acceptance of its last generation
                deadline = time.monotonic() + 10
                reported = None
                while time.monotonic() < deadline:
                    ns = mon.view.stats(v.node_id)
                    if ns and ns.latest.get("verifier", {}).get("generations") == 2:
                        reported = ns.latest["verifier"]
                        break
                    time.sleep(0.2)
                assert reported is not None, events[-5:]
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
            after = client.generate(req)
        assert before.stats["token_ids"] == with_monitor.stats["token_ids"] == \
            after.stats["token_ids"]
