"""Two stages on two hosts (network namespaces): the group finds itself over mDNS, activations
cross the veth link on gloo, and greedy output matches the unsharded model, plain and with an
ngram proposer on a third host."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bus.security import write_secret_file
from tests.lan import lan_or_skip
from tools.local_cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.netns]

PROMPT = "Copy exactly, word for word: The committee will meet on Tuesday at the main office."
MAX_TOKENS = 16


@pytest.fixture
def lan():
    with lan_or_skip(hosts=3, prefix="specbus-s") as net:
        yield net


def generate(lan, cluster, host, *extra, env=None):
    out = subprocess.run(
        [*lan.prefix(host), sys.executable, "-m", "nodes.cli", "generate", "--cluster", cluster,
         "--interface", lan.address(host), "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS),
         "--json", "--wait", "30", *extra],
        capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def unsharded_greedy() -> list[int]:
    from nodes.backends.torch_backend import TorchBackend
    from nodes.engine.core import Engine, GenerationParams

    backend = TorchBackend.load(None, device="cpu")
    ids = backend.tokenizer.encode(PROMPT, chat=True)
    out = Engine(backend, None).generate(
        ids, GenerationParams(max_tokens=MAX_TOKENS, eos_token_ids=frozenset()))
    return list(out.token_ids)


def test_two_stages_on_two_hosts(lan, tmp_path):
    flags = ("--role", "verifier", "--shards", "2", "--shard-group", "wide", "--threads", "1")
    secret = write_secret_file(tmp_path / "cluster.key")  # off loopback a secret is required
    env = {**os.environ, "SPECBUS_SECRET_FILE": str(secret)}
    with LocalCluster(log_dir=tmp_path / "logs", env={"SPECBUS_SECRET_FILE": str(secret)}) as c:
        a = c.start_node("s1", *flags, "--interface", lan.address(1), prefix=lan.prefix(1))
        b = c.spawn("s2", *flags, "--interface", lan.address(2), prefix=lan.prefix(2))
        formed = [p.wait_event(lambda e: e["event"] in ("shard_formed", "eof"), 240)
                  for p in (a, b)]
        assert all(f and f["event"] == "shard_formed" for f in formed), b.tail_of_log()
        leader = next(f for f in formed if f["rank"] == 0)
        assert leader["endpoints"]["stream"].startswith("tcp://10.77.0.")
        p = c.start_node("p", "--role", "proposer", "--drafter", "ngram", "--interface",
                         lan.address(3), prefix=lan.prefix(3))
        plain = generate(lan, c.cluster, 3, "--no-speculate", env=env)
        spec = generate(lan, c.cluster, 3, "--proposer", p.node_id, "--force-draft", env=env)
    assert plain["verifier"] == leader["node_id"]
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["proposers"][p.node_id]["drafts"] >= 1
    assert plain["token_ids"][:MAX_TOKENS] == unsharded_greedy()
