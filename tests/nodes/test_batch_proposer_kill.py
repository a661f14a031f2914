"""A proposer SIGKILLed while 4 batched sequences draft with it changes no output (issue 24).

Real processes on loopback: a verifier (`--max-batch 4`, the real SmolLM2, no drafter of its
own) and an n-gram proposer. Four greedy requests of different prompts and lengths run at once,
all pinned to the proposer (`force_draft`: asked every block, so all four step together in the
forced-draft engine's batch). The proposer is killed at a point of the generation, not a time:
once every stream has received a block of two or more tokens. The verifier has no drafter of
its own, so such a block is proof that the proposer's drafts were accepted for that sequence
before the kill. Each output must then equal the same request decoded alone without
speculation, byte for byte, and all four must complete.

Both modes run. With `--batch-invariant` (as tests/nodes/test_verifier_batching.py runs) each
output must equal its solo output bit for bit. In the default mode which steps the sequences
share depends on when they arrive and when the proposer dies, and batched CPU matmuls differ
from solo ones in the last bits (docs/engine.md, "Batching"), so a greedy choice between two
tokens whose log probabilities differ by less than that could go either way: there each output
must equal its solo output or leave it only at such a near-tie (the solo run's top-2 log
probabilities at the first differing position within `NEAR_TIE`; every later token then
continues another prefix). That verdict does not depend on timing: a wrong draft accepted, a
lost or repeated token, or a batch-mate's row leaking in would leave the solo output where
the solo model was sure.

Where the kill landed is checked, not assumed: a sequence still running when the verifier
learns that the proposer is gone drops it (`dropped` in its `done` stats) and decodes on its
own. The stream that completed the barrier had just received its first multi-token block
(about 20 tokens in, 100+ still to go), and a proposer can have drafted at most its horizon
(64) past the last commit it saw, so that sequence cannot finish on drafts in hand: it must
drop the proposer. The others may have got further meanwhile (their prompts start over
several steps, and an input-grounded one can take 60 tokens a step), and one that finished on
drafts sent before the kill never learns of it: allowed (a CI run saw it). Measured: 50-85 s a
mode (169 s for both on 2 shared cores), most of it the model's load and the solo runs.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import replace

import pytest

from codec.structs import TokenChunk
from nodes.cluster_client import ClusterError, GenerateRequest
from nodes.telemetry import StatsWatcher
from tests.nodes.conftest import client_of, one_verifier
from tools.monitor_view import ClusterView, role_lines
from tools.prompts import INPUT_GROUNDED, PROMPTS

pytestmark = pytest.mark.slow

#: (prompt, max_tokens): the input-grounded prompts (the n-gram drafter's drafts are accepted
#: there), four prompt lengths, four generation lengths
REQUESTS = [(text, 120 + 12 * i) for i, text in
            enumerate(t for kind, t in PROMPTS if kind == INPUT_GROUNDED)]
assert len(REQUESTS) == 4
#: two tokens closer than this in the solo run's log probabilities are a near-tie (batched
#: logits differ from solo ones by up to ~1e-4 here: docs/engine.md, "Numerics")
NEAR_TIE = 1e-3
MODES = {"batch-invariant": ("--batch-invariant",), "default": ()}


@pytest.fixture(scope="module", params=list(MODES))
def cluster(request, tmp_path_factory):
    c = one_verifier(tmp_path_factory, "--max-batch", "4", *MODES[request.param],
                     proposers=[("ngram", "--drafter", "ngram")])
    c.mode = request.param
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with client_of(cluster, verifiers_s=60) as cc:
        proposer = cluster.node("ngram").node_id
        cc.wait_for(lambda ms: any(m.node_id == proposer for m in ms), 30)
        yield cc


@pytest.fixture(scope="module")
def solo(client):
    """Each request decoded alone, one after another, without speculation: its token ids and,
    per token, the verifier's top-2 {token id: log probability}."""
    out = []
    for text, n in REQUESTS:
        ids, tops = [], []
        req = replace(GenerateRequest(text, max_tokens=n, speculate=False), logprobs=2)
        for msg in client.stream(req, client.verifiers()[0]):
            if msg.type != "token_chunk":
                continue
            chunk = TokenChunk.from_message(msg)
            k = chunk.top_n
            for j, t in enumerate(chunk.tokens.tolist()):
                ids.append(t)
                tops.append(dict(zip(chunk.top_ids[j * k:(j + 1) * k].tolist(),
                                     chunk.top_logprobs[j * k:(j + 1) * k].tolist(),
                                     strict=True)))
        out.append((ids, tops))
    return out


def differs_only_at_a_near_tie(ids: list[int], solo_ids: list[int], tops: list[dict]) -> bool:
    """`ids` is the solo output, or leaves it first where the solo run's top two were within
    NEAR_TIE of each other, with the other of the two."""
    if ids == solo_ids:
        return True
    p = next((j for j, (a, b) in enumerate(zip(ids, solo_ids, strict=False)) if a != b),
             None)
    if p is None:  # one stops early: an end of sequence where the other went on
        return False
    top = tops[p]
    return ids[p] in top and abs(top[ids[p]] - top[solo_ids[p]]) < NEAR_TIE


def test_proposer_killed_under_four_batched_sequences_changes_no_output(cluster, client,
                                                                        solo):
    proposer = cluster.node("ngram")
    verifier = client.verifiers()[0]
    watcher = StatsWatcher(client.node, cluster.cluster)
    n = len(REQUESTS)
    before = watcher.wait(verifier.node_id, lambda v: v["max_batch"] == 4
                          and v["generations"] >= n, "verifier", timeout=30)
    chunks: dict[int, list[list[int]]] = {i: [] for i in range(n)}
    done: dict[int, object] = {}
    killed = threading.Event()

    trigger: list[int] = []  # the stream whose accepted draft completed the barrier

    def kill() -> None:  # by the last stream thread to see the proposer's drafts accepted
        proposer.signal(signal.SIGKILL)
        killed.set()

    used = threading.Barrier(n, action=kill)
    go = threading.Barrier(n)

    def run(i: int) -> None:
        text, max_tokens = REQUESTS[i]
        req = GenerateRequest(text, max_tokens=max_tokens, proposers=[proposer.node_id],
                              force_draft=True)
        waited = False
        try:
            go.wait(60)
            for msg in client.stream(req, verifier):
                if msg.type == "token_chunk":
                    chunks[i].append(msg.tensors[0].tolist())
                    if not waited and len(chunks[i][-1]) >= 2:
                        waited = True  # the proposer's drafts were accepted for this one
                        if used.wait(300) == n - 1:  # the last to arrive: it set off the kill
                            trigger.append(i)
                elif msg.type == "done":
                    done[i] = msg
            if not waited:
                used.abort()  # it never used the proposer: the others must not wait for it
        except (ClusterError, threading.BrokenBarrierError) as exc:
            done[i] = exc
            used.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert killed.is_set(), {i: [len(c) for c in chunks[i]] for i in range(n)}
    assert proposer.proc.wait(30) is not None

    dropped: dict[int, bool] = {}
    for i in range(n):
        msg = done.get(i)
        assert getattr(msg, "type", None) == "done", f"request {i}: {msg!r}"
        stats = msg["stats"]
        ids = [t for chunk in chunks[i] for t in chunk]
        solo_ids, tops = solo[i]
        assert stats["token_ids"] == ids, f"request {i}"
        if cluster.mode == "batch-invariant":
            assert ids == solo_ids, f"request {i}"
        else:
            assert differs_only_at_a_near_tie(ids, solo_ids, tops), f"request {i}"
            if ids != solo_ids:  # allowed, and worth seeing (-rP)
                print(f"request {i}: left its solo output at a near-tie")
        used_by = stats["proposers"][proposer.node_id]
        assert used_by["drafts"] >= 1 and used_by["accepted"] >= 1, used_by
        dropped[i] = used_by["dropped"]
    # the kill hit the batch: the sequence whose first accepted draft set it off still had
    # most of its output to make, so the verifier learnt the proposer was gone while it ran
    assert dropped[trigger[0]], (trigger, dropped)
    if not all(dropped.values()):  # finished on drafts already in hand: allowed (-rP)
        print(f"not dropped (done on drafts sent before the kill): {dropped}")

    # the four shared steps: sequences carried per step > 1 over these generations
    after = watcher.wait(verifier.node_id,
                         lambda v: v["generations"] >= before["generations"] + n, "verifier",
                         timeout=60)
    steps, stepped = (after[k] - before[k] for k in ("steps", "stepped"))
    assert stepped > steps > 0, (before, after)
    # the monitor shows it from the gossiped stats: more than one sequence per step since start
    view = ClusterView()
    view.refresh(client.node.membership.members(include_self=False))
    view.on_stats(verifier.node_id, watcher.latest(verifier.node_id))
    line = next(li for li in role_lines(view)[0] if li.startswith("  batch "))
    assert line.startswith("  batch 0/4  per step: sequences ")
    assert float(line.split("sequences")[1].split()[0]) > 1.0, line
