"""Three stages on loopback, real processes: greedy output byte-identical to the unsharded
model and to HF greedy, plain and with the ngram proposer; bad configurations fail at start."""

from __future__ import annotations

import pytest

from nodes.cluster_client import ClusterClient, GenerateRequest
from tools.local_cluster import LocalCluster, free_port_pair

pytestmark = pytest.mark.slow

PROMPT = "Copy exactly, word for word: The committee will meet on Tuesday at the main office."
MAX_TOKENS = 16
LOOP = ("--interface", "127.0.0.1", "--threads", "1")


def shard_flags(n: int, group: str, *extra: str) -> tuple[str, ...]:
    """A fixed --port: the process rejoins on the same address after a re-forming round, so
    the seeds others were given stay valid (without mDNS)."""
    return ("--role", "verifier", "--shards", str(n), "--shard-group", group,
            "--port", str(free_port_pair()), *LOOP, *extra)


def start_group(c: LocalCluster, n: int, group: str, *extra: str):
    """Spawn n shard processes; once formed, return them in rank order and rank 0's event."""
    first = c.start_node(f"{group}-0", *shard_flags(n, group, *extra))
    procs = [first] + [c.spawn(f"{group}-{i}", *shard_flags(n, group, *extra))
                       for i in range(1, n)]
    formed = [p.wait_event(lambda e: e["event"] in ("shard_formed", "eof"), 240) for p in procs]
    assert all(f and f["event"] == "shard_formed" for f in formed), [p.tail_of_log() for p in procs]
    leader = next(f for f in formed if f["rank"] == 0)
    assert sorted(f["rank"] for f in formed) == list(range(n))
    return sorted(procs, key=lambda p: formed[procs.index(p)]["rank"]), leader


def hf_greedy(prompt_ids: list[int]) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    from nodes import models

    ref = models.resolve(None)
    model = AutoModelForCausalLM.from_pretrained(str(ref.path), dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def group3(tmp_path_factory):
    with LocalCluster(mdns=False, log_dir=tmp_path_factory.mktemp("logs")) as c:
        procs, leader = start_group(c, 3, "g3")
        yield c, procs, leader


def generate(c: LocalCluster, leader: dict, **kw):
    peers = tuple(n.stream for n in c.nodes if n.proc.poll() is None)
    with ClusterClient(c.cluster, interface="127.0.0.1", peers=peers, mdns=False) as cc:
        verifiers = cc.verifiers(timeout=30)
        assert [v.node_id for v in verifiers] == [leader["node_id"]]  # stages are never routed
        card = verifiers[0].card
        assert card.extras["shard"]["stages"] == leader["members"][1:]
        req = GenerateRequest(prompt=PROMPT, max_tokens=MAX_TOKENS, chat=False, **kw)
        return cc.generate(req, verifiers[0])


def test_three_stages_match_unsharded_and_hf(group3):
    from nodes.backends.torch_backend import TorchBackend
    from nodes.engine.core import Engine, GenerationParams

    c, procs, leader = group3
    sharded = generate(c, leader, speculate=False)
    backend = TorchBackend.load(None, device="cpu")
    ids = backend.tokenizer.encode(PROMPT, chat=False)
    whole = Engine(backend, None).generate(
        ids, GenerationParams(max_tokens=MAX_TOKENS, eos_token_ids=frozenset()))
    assert sharded.stats["token_ids"] == list(whole.token_ids)
    assert sharded.stats["token_ids"] == hf_greedy(ids)


def test_three_stages_with_ngram_proposer(group3):
    c, procs, leader = group3
    plain = generate(c, leader, speculate=False)
    p = c.start_node("ngram", "--role", "proposer", "--drafter", "ngram", *LOOP)
    spec = generate(c, leader, proposers=[p.node_id], force_draft=True)
    assert spec.stats["token_ids"] == plain.stats["token_ids"]
    assert spec.stats["proposers"][p.node_id]["drafts"] >= 1
