"""Real `python -m nodes` processes on loopback, discovering each other over mDNS on 127.0.0.1.

Every test uses its own random cluster name, so parallel runs (and other tests) never mix.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tools.local_cluster import NodeProcess, all_see_each_other, event_time, wait_all

pytestmark = pytest.mark.slow

# How long a test waits for an event. A verdict never depends on timing: these are generous
# waits for "it happens", not targets (`specbus bench membership` measures the times).
EVENTUALLY_S = 20.0
SPECBUS = "import sys; from nodes.cli import main; sys.exit(main())"


@pytest.fixture
def cluster():
    procs: list[NodeProcess] = []
    name = f"t-{uuid.uuid4().hex[:8]}"

    def spawn(*extra: str, cluster: str = name, role: str = "proposer",
              module: str = "nodes") -> NodeProcess:
        p = NodeProcess(["--role", role, "--cluster", cluster, *extra], module=module)
        procs.append(p)
        return p

    spawn.name = name
    yield spawn
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
        p.proc.wait(10)


def test_mdns_join_kill_and_leave(cluster):
    nodes = [cluster("--drafter", "ngram") for _ in range(4)]
    assert wait_all(lambda: all_see_each_other(nodes), EVENTUALLY_S), [n.view() for n in nodes]
    victim, leaver, *rest = nodes

    t_kill = victim.signal(signal.SIGKILL)
    dt = event_time([leaver, *rest], victim.node_id, "dead", t_kill, EVENTUALLY_S)
    assert dt is not None, "a SIGKILLed node was never declared dead"

    t_term = leaver.signal(signal.SIGTERM)
    dt = event_time(rest, leaver.node_id, "leave", t_term, EVENTUALLY_S)
    assert dt is not None, "a SIGTERMed node's leave was never seen"
    assert leaver.proc.wait(5) == 0
    # a graceful leave is never a suspicion first
    assert all(not n.events_about(leaver.node_id, "suspect") for n in rest)


def test_a_whole_cluster_stopped_at_once_exits_cleanly(cluster):
    """Six nodes told to stop together: each one's peers disconnect while it closes its own
    connections. A DEALER monitor disabled after its reader was closed deadlocked a node here
    (2 of 16 such stops); a zeroconf lookup caught by shutdown held the exit ~11.5 s."""
    nodes = [cluster("--drafter", "ngram") for _ in range(6)]
    assert wait_all(lambda: all_see_each_other(nodes), EVENTUALLY_S), [n.view() for n in nodes]
    for n in nodes:
        n.signal(signal.SIGTERM)
    for n in nodes:
        try:
            n.proc.wait(EVENTUALLY_S)
        except subprocess.TimeoutExpired:
            pass
        # a stop slower than 8 s prints every thread's stack to the node's stderr
        assert n.proc.poll() == 0, "\n".join(n.stderr[-120:])


def test_cpu_bound_main_thread_is_never_suspected(cluster):
    busy_s = 4.0
    idle = [cluster() for _ in range(2)]
    busy = cluster("--busy-s", str(busy_s), module="tools.busy_node")
    nodes = [*idle, busy]
    assert wait_all(lambda: all_see_each_other(nodes), EVENTUALLY_S), [n.view() for n in nodes]
    time.sleep(busy_s + 0.5)
    for n in idle:
        assert n.events_about(busy.node_id, "suspect") == []
        assert n.view()[busy.node_id] == "alive"
    # the busy node itself also kept up with everyone
    assert [e for e in busy.events if e["event"] in ("suspect", "dead")] == []
    busy.signal(signal.SIGINT)  # SIGINT leaves gracefully too
    assert busy.proc.wait(5) == 0
    assert all(n.wait_event(lambda e: e["event"] == "leave" and e["node_id"] == busy.node_id,
                               EVENTUALLY_S)
               for n in idle)


def test_other_cluster_is_never_listed(cluster):
    mine = [cluster() for _ in range(2)]
    other = cluster(cluster=f"{cluster.name}-other")
    assert wait_all(lambda: all_see_each_other(mine), EVENTUALLY_S), [n.view() for n in mine]
    other.wait_ready()
    time.sleep(1.5)  # mDNS had every chance to show it
    for n in mine:
        assert other.node_id not in n.view()
    assert other.view() == {}
    out = subprocess.run(
        [sys.executable, "-c", SPECBUS, "members", "--cluster", cluster.name, "--json",
         "--wait", "1.5"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert {r["node_id"] for r in rows} == {n.node_id for n in mine}
    for r in rows:
        assert {"node_id", "name", "roles", "state", "incarnation", "endpoints", "backend",
                "model"} <= set(r)
        assert r["roles"] == ["proposer"] and r["state"] == "alive"


def test_restart_rejoins_with_higher_incarnation(cluster, tmp_path):
    a = cluster()
    first = cluster("--name", "phoenix", "--state-dir", str(tmp_path))
    assert wait_all(lambda: all_see_each_other([a, first]), EVENTUALLY_S), [a.view(), first.view()]
    inc = first.ready["incarnation"]
    first.proc.kill()  # crash, no leave
    first.proc.wait(5)
    assert a.wait_event(lambda e: e["event"] == "dead" and e["node_id"] == first.node_id,
                        EVENTUALLY_S)
    again = cluster("--name", "phoenix", "--state-dir", str(tmp_path))
    assert again.node_id == first.node_id and again.ready["incarnation"] == inc + 1
    ev = a.wait_event(lambda e: e["event"] == "join" and e["node_id"] == again.node_id
                      and e["incarnation"] == inc + 1, EVENTUALLY_S)
    assert ev is not None and a.view()[again.node_id] == "alive"


def test_seeds_work_without_mdns(cluster):
    a = cluster("--no-mdns")
    b = cluster("--no-mdns", "--peer", a.stream.removeprefix("tcp://"))
    c = cluster("--no-mdns", "--peer", b.stream)
    assert wait_all(lambda: all_see_each_other([a, b, c]), EVENTUALLY_S), [
        n.view() for n in (a, b, c)]


def test_node_cli_rejects_bad_flags():
    for args, match in ((["--role", "chef"], "unknown role"),
                        (["--role", "proposer", "--peer", "nowhere"], "HOST:PORT"),
                        (["--role", "proposer", "--cluster", "bad name"], "cluster name"),
                        (["--role", "proposer", "--interface", "nosuchif9"], "no such interface"),
                        (["--role", "proposer", "--suspect-after", "5"], "timeouts")):
        out = subprocess.run([sys.executable, "-m", "nodes", *args], capture_output=True,
                             text=True, timeout=30)
        assert out.returncode != 0 and match in out.stderr, (args, out.stderr)
