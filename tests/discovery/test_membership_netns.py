"""Three "hosts" in network namespaces on one bridge, discovering each other over real
multicast mDNS on 10.77.0.0/24; a host's link going down is detected, and coming back rejoins.

Needs root and iproute2; namespaces and links are removed in teardown even when a test fails.
Nothing here touches a real interface: every address lives inside namespaces we create.
"""

from __future__ import annotations

import signal
import subprocess
import time
import uuid

import pytest

from bus.security import write_secret_file
from tests.lan import lan_or_skip
from tools.local_cluster import NodeProcess, all_see_each_other, event_time, wait_all

pytestmark = [pytest.mark.slow, pytest.mark.netns]

HOSTS = 3


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=10)


@pytest.fixture
def lan():
    """Namespaces `specbus-t-<rand>-{br,1..3}`: a bridge and three hosts 10.77.0.{1..3}."""
    with lan_or_skip(hosts=HOSTS, prefix="specbus-t") as net:
        procs: list[NodeProcess] = []
        try:
            yield {"bridge": net.bridge, "hosts": net.hosts, "procs": procs}
        finally:
            for p in procs:
                if p.proc.poll() is None:
                    p.proc.kill()
                p.proc.wait(10)


def test_multicast_discovery_partition_and_rejoin(lan, tmp_path):
    cluster = f"t-{uuid.uuid4().hex[:8]}"
    secret = write_secret_file(tmp_path / "cluster.key")  # off loopback a secret is required
    nodes = []
    for i, ns in enumerate(lan["hosts"], 1):
        p = NodeProcess(["--role", "proposer", "--cluster", cluster,
                         "--interface", f"10.77.0.{i}", "--secret-file", str(secret)],
                        prefix=["ip", "netns", "exec", ns])
        lan["procs"].append(p)
        nodes.append(p)
    assert wait_all(lambda: all_see_each_other(nodes), 20), [n.view() for n in nodes]
    for i, n in enumerate(nodes, 1):
        assert n.ready["endpoints"]["gossip"].startswith(f"tcp://10.77.0.{i}:")

    cut, *others = nodes
    t_down = time.monotonic()
    _ip("link", "set", "h1", "down", ns=lan["bridge"])
    # generous waits for "it happens"; how fast is `specbus bench membership`'s business
    dt = event_time(others, cut.node_id, "dead", t_down, 20)
    assert dt is not None, "a partitioned node was never declared dead"
    assert cut.wait_event(lambda e: e["event"] == "dead" and e["t"] >= t_down, 20)

    time.sleep(1.0)
    t_up = time.monotonic()
    _ip("link", "set", "h1", "up", ns=lan["bridge"])
    dt = event_time(others, cut.node_id, "join", t_up, 20)
    assert dt is not None, [n.view() for n in others]
    assert wait_all(lambda: all_see_each_other(nodes), 20), [n.view() for n in nodes]

    for n in nodes:
        n.signal(signal.SIGTERM)
    for n in nodes:
        try:
            n.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        assert n.proc.poll() == 0, "\n".join(n.stderr[-150:])
