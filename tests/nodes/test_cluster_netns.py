"""Multi-host: verifier and proposer in different network namespaces find each other over
real multicast mDNS and decode together; the client runs in a third namespace."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bus.security import write_secret_file
from tests.lan import lan_or_skip
from tools.local_cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.netns]

PROMPT = "Copy exactly, word for word: The committee will meet on Tuesday at the main office."


@pytest.fixture
def lan():
    with lan_or_skip(hosts=3, prefix="specbus-n") as net:
        yield net


def generate(lan, cluster, host, *extra, secret=None):
    extra = (*extra, "--secret-file", str(secret)) if secret else extra
    out = subprocess.run(
        [*lan.prefix(host), sys.executable, "-m", "nodes.cli", "generate", "--cluster", cluster,
         "--interface", lan.address(host), "--prompt", PROMPT, "--max-tokens", "24", "--json",
         "--wait", "20", *extra],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_verifier_and_proposer_on_different_hosts(lan, tmp_path):
    secret = write_secret_file(tmp_path / "cluster.key")  # off loopback a secret is required
    with LocalCluster(log_dir=tmp_path / "logs", env={"SPECBUS_SECRET_FILE": str(secret)}) as c:
        v = c.start_node("v", "--role", "verifier", "--interface", lan.address(1),
                         prefix=lan.prefix(1))
        p = c.start_node("p", "--role", "proposer", "--interface", lan.address(2),
                         prefix=lan.prefix(2))
        assert v.stream.startswith("tcp://10.77.0.1:") and p.stream.startswith("tcp://10.77.0.2:")
        # pinned: drafts stream in ahead and are not waited for unless forced (protocol 2)
        spec = generate(lan, c.cluster, 3, "--proposer", p.node_id, "--force-draft",
                        secret=secret)
        plain = generate(lan, c.cluster, 3, "--no-speculate", secret=secret)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["proposers"][p.node_id]["drafts"] >= 1
