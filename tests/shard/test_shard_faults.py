"""SIGKILL a stage mid-generation: the client gets a clear error, no process hangs, and a
restarted stage re-forms the group (real processes on loopback)."""

from __future__ import annotations

import signal

import pytest

from nodes.cluster_client import ClusterClient, ClusterError, GenerateRequest
from tests.shard.test_shard_loopback import shard_flags, start_group
from tools.local_cluster import LocalCluster

pytestmark = pytest.mark.slow

TIMEOUT = "4"  # --shard-timeout: the failure-detection time of the pipeline


def test_killed_stage_fails_the_request_and_restart_reforms(tmp_path):
    with LocalCluster(mdns=False, log_dir=tmp_path / "logs") as c:
        procs, leader = start_group(c, 2, "gk", "--shard-timeout", TIMEOUT)
        rank0, stage = procs
        peers = (stage.stream, leader["endpoints"]["stream"])
        with ClusterClient(c.cluster, interface="127.0.0.1", peers=peers, mdns=False) as cc:
            verifier = cc.verifiers(timeout=30)[0]
            req = GenerateRequest(prompt="Count: one, two, three, four,", max_tokens=400,
                                  chat=False, speculate=False)
            stream = cc.stream(req, verifier, idle_timeout=60)
            seen = []
            with pytest.raises(ClusterError, match="shard pipeline") as err:
                for msg in stream:
                    seen.append(msg.type)
                    if len(seen) == 2:  # tokens are flowing: kill the last stage
                        stage.signal(signal.SIGKILL)
            assert seen[:2] == ["token_chunk", "token_chunk"]
            assert err.value.code == "generation_failed"
        broken = rank0.wait_event(lambda e: e["event"] in ("shard_broken", "eof"), 60)
        assert broken is not None and broken["event"] == "shard_broken"
        stage.reap(10)
        assert stage.proc.returncode == -signal.SIGKILL
        # the same command again: the group forms anew and serves
        again = c.spawn("gk-1b", *shard_flags(2, "gk", "--shard-timeout", TIMEOUT))
        formed = again.wait_event(lambda e: e["event"] in ("shard_formed", "eof"), 240)
        assert formed is not None and formed["event"] == "shard_formed", again.tail_of_log()
        lead = rank0.wait_event(lambda e: e["event"] == "eof" or (
            e["event"] == "shard_formed" and e["t"] > broken["t"]), 240)
        assert lead is not None and lead["event"] == "shard_formed"
        peers = (again.stream, rank0.stream)
        with ClusterClient(c.cluster, interface="127.0.0.1", peers=peers, mdns=False) as cc:
            found = cc.wait_for(lambda ms: any(m.card.extras.get("shard", {}).get("phase")
                                               == "serving" for m in ms), 30)
            verifier = next(m for m in found
                            if m.card.extras.get("shard", {}).get("phase") == "serving")
            out = cc.generate(GenerateRequest(prompt="Hello", max_tokens=4, chat=False,
                                              speculate=False), verifier)
            assert len(out.stats["token_ids"]) == 4
    for p in (*procs, again):  # LocalCluster.stop SIGTERMed everyone: all exited
        assert p.proc.poll() is not None
