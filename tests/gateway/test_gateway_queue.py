"""The gateway's queue (issue 24): more users than a verifier takes at once wait their turn
instead of getting 429; only a full queue answers 429; a user who leaves while queued loses
the place and leaves nothing behind.

Real processes on loopback: one SmolLM2 verifier (`--max-batch 8`, so one connection may
hold 8 + 8 generations) and two gateways: one with the defaults (in flight: what the verifier
admits per connection, from its card; then a queue of 64), one that takes one request and
queues one (`--gateway-max-inflight 1 --gateway-queue 1`) so a full queue is reachable with
three streams. The verifier runs `--batch-invariant`: which requests share a step depends on
when they arrive, and only the invariant mode makes "equal to the solo output" independent of
that (docs/engine.md, "Batching"; the default mode is checked with fixed batch compositions in
tests/engine/test_engine_batch.py). Verdicts come from outputs, status codes and counters; every
wait is a generous upper bound.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.gateway.conftest import MODEL, Http, metrics, sse_events
from tools.local_cluster import LocalCluster

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "List three primary colours:",
    "def fibonacci(n):",
    "The quick brown fox",
    "Water boils at",
    "My favourite season is",
    "The three laws of robotics are",
]
USERS = 16  # two per prompt, all at once through one gateway
LONG = ("Here is the list of the fifty states of the United States in alphabetical order: "
        "Alabama, Alaska,")


@pytest.fixture(scope="module")
def gateways(tmp_path_factory):
    c = LocalCluster(log_dir=tmp_path_factory.mktemp("logs"), mdns=False)
    try:
        c.start_node("v", "--role", "verifier", "--threads", "1", "--max-batch", "8",
                     "--batch-invariant")
        nodes = [c.spawn("gw", "--role", "gateway", "--http", "127.0.0.1:0"),
                 c.spawn("gw-small", "--role", "gateway", "--http", "127.0.0.1:0",
                         "--gateway-max-inflight", "1", "--gateway-queue", "1")]
        for node in nodes:
            node.wait_ready()
        out = {}
        for name in ("gw", "gw-small"):
            client = Http(c.node(name).ready["http"])
            deadline = time.monotonic() + 60
            while client.json("GET", "/health")[0] != 200:  # until it sees the verifier
                assert time.monotonic() < deadline, f"{name} never saw the verifier"
                time.sleep(0.2)
            out[name] = client
        yield out
    finally:
        c.stop()


def complete(client: Http, prompt: str, max_tokens: int = 16):
    return client.json("POST", "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def wait_health(client: Http, pred, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = client.json("GET", "/health")[2]
        if pred(health):
            return health
        if time.monotonic() > deadline:
            raise AssertionError(f"/health never matched: {health}")
        time.sleep(0.1)


def first_chunk(resp) -> dict:
    return json.loads(next(sse_events(resp)))


def send(client: Http, body: dict):
    """Send a request without waiting for its response head (a queued request gets none
    until its turn)."""
    conn = client.conn()
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    return conn


def test_sixteen_users_through_one_gateway_all_get_their_solo_output(gateways):
    """Before issue 24 the verifier took 8 per connection and the gateway 8 per verifier:
    8 of 16 users got 429. Now all 16 are served, each exactly as alone."""
    gw = gateways["gw"]
    solo = {}
    for prompt in PROMPTS:
        status, _, body = complete(gw, prompt)
        assert status == 200, body
        solo[prompt] = body["choices"][0]["text"]
    out: dict[int, tuple] = {}
    go = threading.Barrier(USERS)

    def user(i: int) -> None:
        go.wait(60)
        status, _, body = complete(gw, PROMPTS[i % len(PROMPTS)])
        out[i] = (status, body)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(USERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for i in range(USERS):
        status, body = out[i]
        assert status == 200, (i, body)
        assert body["choices"][0]["text"] == solo[PROMPTS[i % len(PROMPTS)]], i
    m = metrics(gw)
    assert m["specbus_gateway_queue_refused_total"] == 0
    wait_health(gw, lambda h: h["inflight"] == 0 and h["queued"] == 0)


def test_a_full_queue_is_429_and_a_user_who_leaves_loses_the_place(gateways):
    small = gateways["gw-small"]
    wait_health(small, lambda h: h["inflight"] == 0 and h["queued"] == 0)
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 1000, "temperature": 0,
            "stream": True}
    running = send(small, body)
    opened = [running]
    try:
        first_chunk(running.getresponse())  # served: the gateway's one slot is taken
        leaver = send(small, body)  # waits in the queue of one
        opened.append(leaver)
        wait_health(small, lambda h: h["queued"] == 1)
        status, headers, raw = small.request("POST", "/v1/completions",
                                             {**body, "stream": False})
        err = json.loads(raw)["error"]
        assert status == 429 and headers.get("Retry-After") == "1"
        assert err["code"] == "rate_limit_exceeded"
        assert "1 requests already wait for a slot" in err["message"], err
        leaver.close()  # the queued user goes away: its place is given up
        wait_health(small, lambda h: h["queued"] == 0)
        successor = send(small, {**body, "max_tokens": 4})
        opened.append(successor)
        wait_health(small, lambda h: h["queued"] == 1)  # the freed place is taken again
        running.close()  # the running one ends: the queued one is served next
        events = list(sse_events(successor.getresponse()))
        assert events[-1] == "[DONE]" and len(events) >= 3
        final = json.loads(events[-2])
        assert final["choices"][0]["finish_reason"] == "length"
    finally:
        for conn in opened:
            conn.close()
    health = wait_health(small, lambda h: h["inflight"] == 0 and h["queued"] == 0)
    assert health["status"] == "ok"
    m = metrics(small)
    assert m["specbus_gateway_queue_refused_total"] == 1
    assert m["specbus_gateway_queued"] == 0
    assert m["specbus_gateway_cancelled_total"] >= 2  # the leaver and the running one
