"""Work whose client is gone is dropped; a verifier that dies is reported at once; a verifier
that stalls finishes its generation.

Real processes on loopback with the real SmolLM2 verifier: a client process that queues
generations and is SIGKILLed (or leaves normally) mid-work, a verifier stopped for 5 s
(SIGSTOP, then SIGCONT) and one SIGKILLed mid-stream. Verdicts come from counters, order and
error codes, never from elapsed times (every wait below is a generous upper bound).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from discovery.table import State
from nodes.cluster_client import ClusterError, GenerateRequest
from nodes.telemetry import StatsWatcher
from tests.nodes.conftest import client_of, one_verifier

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Write a long story about a lighthouse keeper and the sea."
QUEUED = 4  # generations the orphaned client leaves behind: 1 running + 3 queued


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # one at a time: the orphaned client's work is one running generation and three queued
    # ones, so both the queue and the running job are dropped (a batch would run all four)
    c = one_verifier(tmp_path_factory, "--max-batch", "1")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with client_of(cluster, verifiers_s=60) as cc:
        cc.stats = StatsWatcher(cc.node, cluster.cluster)
        yield cc


@pytest.fixture(scope="module")
def verifier_id(cluster):
    return cluster.node("v").node_id


def start_orphan_client(cluster, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("orphan_client.py")), cluster.cluster,
         cluster.node("v").stream, str(QUEUED), "400", mode],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    assert line.startswith("ready "), f"orphan client did not start: {line!r}"
    return proc


def test_a_killed_clients_queued_and_running_work_is_dropped(cluster, client, verifier_id):
    stats = client.stats
    before = stats.wait(verifier_id, lambda v: v["active"] == 0 and v["queued"] == 0,
                        "verifier")
    proc = start_orphan_client(cluster, "hang")
    try:
        stats.wait(verifier_id, lambda v: v["active"] == 1 and v["queued"] == QUEUED - 1,
                   "verifier")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        after = stats.wait(verifier_id, lambda v: v["orphans_dropped"]
                           >= before["orphans_dropped"] + QUEUED, "verifier")
    finally:
        proc.kill()
        proc.wait()
    after = stats.wait(verifier_id, lambda v: v["active"] == 0 and v["queued"] == 0,
                        "verifier")
    assert after["orphans_dropped"] == before["orphans_dropped"] + QUEUED
    # the next user is served at once: none of the orphans ran to completion before it
    result = client.generate(GenerateRequest("Say hello.", max_tokens=8))
    assert result.finish_reason in ("length", "eos")
    done = stats.wait(verifier_id, lambda v: v["generations"] > before["generations"],
                        "verifier")
    assert done["generations"] == before["generations"] + 1


def test_a_client_that_exits_cancels_its_work(cluster, client, verifier_id):
    stats = client.stats
    before = stats.wait(verifier_id, lambda v: v["active"] == 0 and v["queued"] == 0,
                        "verifier")
    proc = start_orphan_client(cluster, "exit")
    assert proc.wait(60) == 0
    after = stats.wait(verifier_id, lambda v: v["active"] == 0 and v["queued"] == 0,
                        "verifier")
    # cancelled by the client itself on close: not orphans, and nothing ran to completion
    assert after["orphans_dropped"] == before["orphans_dropped"]
    assert after["generations"] == before["generations"]


def stream_with(client, req, verifier, when_first, out):
    """Stream `req` in a thread; call `when_first()` once the first chunk is in."""

    def run():
        msgs = []
        try:
            for msg in client.stream(req, verifier):
                msgs.append(msg)
                if len(msgs) == 1:
                    when_first()
            out["msgs"] = msgs
        except ClusterError as exc:
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_stalled_verifier_finishes_the_generation(cluster, client, verifier_id):
    """SIGSTOP for 5 s (long enough for membership to declare it dead), then SIGCONT: the
    stream goes on with every chunk exactly once and the text of an uninterrupted run."""
    node = cluster.node("v")
    v = next(m for m in client.verifiers() if m.node_id == verifier_id)
    req = GenerateRequest(PROMPT, max_tokens=48, speculate=False)
    plain = client.generate(req, v)
    first = threading.Event()
    out: dict = {}
    t = stream_with(client, req, v, first.set, out)
    assert first.wait(120)
    node.signal(signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        deadline = stopped_at + 60
        while client.node.membership.get(verifier_id).state is not State.DEAD:
            assert time.monotonic() < deadline, "membership never declared the verifier dead"
            time.sleep(0.05)
        time.sleep(max(0.0, stopped_at + 5.0 - time.monotonic()))
    finally:
        node.signal(signal.SIGCONT)
    t.join(300)
    assert "error" not in out, out.get("error")
    msgs = out["msgs"]
    chunks = [m for m in msgs if m.type == "token_chunk"]
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    assert msgs[-1].type == "done"
    assert msgs[-1]["stats"]["token_ids"] == plain.stats["token_ids"]
    assert sum(len(c.tensors[0]) for c in chunks) == len(plain.stats["token_ids"])


def test_a_killed_verifier_is_reported_at_once(cluster, client):
    """SIGKILL mid-stream: a clear `verifier_lost` error, not the 120 s idle timeout."""
    victim = cluster.start_node("victim", "--role", "verifier", "--threads", "1", seed=True)
    client.wait_for(lambda ms: any(m.node_id == victim.node_id for m in ms), 60)
    v = next(m for m in client.verifiers() if m.node_id == victim.node_id)
    out: dict = {}
    t = stream_with(client, GenerateRequest(PROMPT, max_tokens=400, speculate=False), v,
                    lambda: victim.signal(signal.SIGKILL), out)
    t.join(300)
    err = out.get("error")
    assert isinstance(err, ClusterError), out
    assert err.code == "verifier_lost", err
    assert f"verifier {victim.node_id} died mid-generation" in str(err)
