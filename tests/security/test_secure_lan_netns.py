"""A secured cluster across network namespaces: verifier, proposer and client on three hosts
with the cluster secret, strangers on a fourth. On the bridge, nothing of the prompt, the output
or its token ids appears in plaintext (and nothing of the secret); strangers with no key or a
wrong key are listed nowhere, get no generation and no draft session, and their attempts are
counted by the members; a node off loopback without a secret refuses to start.

Needs root and iproute2 (skipped otherwise) and the real SmolLM2 (slow).
"""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus.security import read_secret_file
from tests.lan import lan_or_skip
from tools.local_cluster import LocalCluster, NodeProcess

pytestmark = [pytest.mark.slow, pytest.mark.netns]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PROMPT = ("Copy exactly, word for word: the purple walrus audits quarterly ledgers at "
          "Zanzibar harbour.")


@pytest.fixture
def lan():
    with lan_or_skip(hosts=4, prefix="specbus-s") as net:
        yield net


def cli(lan, host, *args, timeout=300):
    return subprocess.run([*lan.prefix(host), sys.executable, "-m", "nodes.cli", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def members(lan, host, cluster, *extra):
    out = cli(lan, host, "members", "--cluster", cluster, "--interface", lan.address(host),
              "--wait", "4", "--json", *extra, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return {r["node_id"]: r for r in json.loads(out.stdout)}


def test_secured_cluster_across_hosts_keeps_strangers_out_and_traffic_private(
        lan, tmp_path, secret_file, other_secret_file):
    right, wrong = ["--secret-file", str(secret_file)], ["--secret-file", str(other_secret_file)]
    sniff_out = tmp_path / "bridge.bin"
    with LocalCluster(log_dir=tmp_path / "logs") as c:
        v = c.start_node("v", "--role", "verifier", "--interface", lan.address(1), *right,
                         prefix=lan.prefix(1))
        p = c.start_node("p", "--role", "proposer", "--drafter", "ngram", "--interface",
                         lan.address(2), *right, prefix=lan.prefix(2))
        # strangers on host 4, same cluster name: a wrong key, and no key at all (--insecure)
        s_wrong = c.start_node("s-wrong", "--role", "proposer", "--drafter", "ngram",
                               "--interface", lan.address(4), *wrong, prefix=lan.prefix(4))
        s_none = c.start_node("s-none", "--role", "proposer", "--drafter", "ngram",
                              "--interface", lan.address(4), "--insecure",
                              prefix=lan.prefix(4))

        sniffer = subprocess.Popen(
            ["ip", "netns", "exec", lan.bridge, sys.executable, str(HERE / "sniff.py"), "br0",
             str(sniff_out)], stdout=subprocess.PIPE, text=True)
        try:
            assert sniffer.stdout.readline().strip() == "capturing"
            gen = cli(lan, 3, "generate", "--cluster", c.cluster, "--interface",
                      lan.address(3), *right, "--prompt", PROMPT, "--max-tokens", "24",
                      "--json", "--wait", "30", "--force-draft", "--proposer", "p")
            assert gen.returncode == 0, gen.stderr[-2000:]
            result = json.loads(gen.stdout.strip().splitlines()[-1])
            seen = members(lan, 3, c.cluster, *right)
            time.sleep(1.0)  # let the last packets of the generation reach the capture
        finally:
            sniffer.send_signal(signal.SIGTERM)
            sniffer.wait(10)

        # the cluster works, with speculation from the secured proposer
        assert result["proposers"][p.node_id]["drafts"] >= 1
        # members see each other, never the strangers
        assert {v.node_id, p.node_id} <= set(seen)
        assert s_wrong.node_id not in seen and s_none.node_id not in seen
        # strangers see no member and get nothing
        for flags in (wrong, ["--insecure"]):
            theirs = members(lan, 4, c.cluster, *flags)
            assert v.node_id not in theirs and p.node_id not in theirs
            if flags == ["--insecure"]:
                assert theirs[s_none.node_id]["insecure"] is True  # shown as such
        for flags in (wrong, ["--insecure"]):
            out = cli(lan, 4, "generate", "--cluster", c.cluster, "--interface",
                      lan.address(4), *flags, "--prompt", "hi", "--max-tokens", "4",
                      "--wait", "4", timeout=120)
            assert out.returncode != 0 and "no verifier found" in out.stderr
        # the four probes are independent (each mostly waits out its timeouts): run them at once
        probes = [subprocess.Popen([*lan.prefix(4), sys.executable, str(HERE / "stranger.py"),
                                    target, *key], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                   env={"PYTHONPATH": str(ROOT)})
                  for key in ([str(other_secret_file)], []) for target in (p.stream, v.stream)]
        for probe in probes:
            stdout, stderr = probe.communicate(timeout=120)
            assert probe.returncode == 0, stderr[-2000:]
            got = json.loads(stdout)  # what came back: never a reply, only failures
            assert set(got) == {"session_open", "generate_req"}
            assert set(got.values()) <= {"RequestTimeout", "PeerUnavailable"}, got

        # no plaintext of the prompt, the output, its token ids, or the secret on the wire
        wire = sniff_out.read_bytes()
        assert b"_specbus" in wire  # the capture saw the LAN (mDNS is plaintext by design)
        for needle in (b"purple walrus", b"Zanzibar", result["text"].strip()[:12].encode(),
                       read_secret_file(secret_file), read_secret_file(secret_file).hex()
                       .encode()):
            assert needle and needle not in wire, needle
        ids = result["token_ids"]
        for i in range(len(ids) - 2):
            assert struct.pack("<3i", *ids[i:i + 3]) not in wire

        # a graceful exit on a loaded CI machine can take longer than the default 10 s grace
        # (a fresh-clone run saw a node SIGKILLed before its exit line)
        c.stop(timeout=120)
        exits = {n.name: n.wait_event(lambda e: e["event"] == "exit", 10) for n in (v, p)}
    # every stranger attempt was refused at the handshake and counted
    assert exits["p"]["handshakes_failed"] >= 1 and exits["v"]["handshakes_failed"] >= 1


def test_a_node_off_loopback_needs_a_secret_or_insecure(lan):
    node = NodeProcess(["--role", "proposer", "--drafter", "ngram", "--no-mdns",
                        "--interface", lan.address(1)], prefix=lan.prefix(1))
    assert node.proc.wait(60) == 2
    node.wait_event(lambda e: e["event"] == "eof", 10)
    assert "without a cluster secret" in "\n".join(node.stderr)
