"""The cluster client's decisions, without sockets: `failover.Failover` fed scripted replies and
membership, and its async face over a stand-in StreamClient. (The real thing, with verifiers
killed and stopped: test_cluster_faults.py, test_client_liveness.py, tests/gateway.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bus.streams import PeerUnavailable
from codec.structs import Done, ErrorReply, TokenChunk
from nodes.cluster_client import GenerateRequest, aio
from nodes.cluster_client.choice import Balancer, VerifierInfo
from nodes.cluster_client.failover import ClusterError, Failover, Final, Piece, Resuming, Started

WORD = {1: "one ", 2: "two ", 3: "three ", 4: "four ", 5: "five "}


class Tok:
    fingerprint = "fp"

    def decode(self, ids):
        return "".join(WORD[i] for i in ids)


class View:
    """Membership as the test says it is."""

    def __init__(self, *verifiers: VerifierInfo) -> None:
        self.alive = list(verifiers)
        self.dead: dict[str, str] = {}

    def verifiers(self):
        return [v for v in self.alive if v.node_id not in self.dead]

    def gone(self, v):
        return self.dead.get(v.node_id)


def verifier(node_id: str, model: str = "m", tokenizer: str = "fp", load: float = 0.0):
    return VerifierInfo(node_id, node_id, f"tcp://{node_id}", model, tokenizer, 10.0, load)


def chunk(index: int, *ids: int):
    return TokenChunk(index, np.array(ids, np.int32), "".join(WORD[i] for i in ids)).to_message()


def done(text: str | None, reason: str = "length"):
    return Done(reason, text, {"drafted": 0}).to_message()


def core_for(view, balancer=None, **kw):
    kw.setdefault("prompt_ids", (7, 8))
    kw.setdefault("tokenizer", Tok())
    return Failover(GenerateRequest("hi", max_tokens=5), view, balancer or Balancer(), model="m",
                    **kw)


def test_a_lost_verifier_resumes_on_another_from_prompt_and_received_tokens():
    view = View(verifier("a"), verifier("b", load=1))
    balancer = Balancer()
    core = core_for(view, balancer)
    att = core.begin(now=0)
    assert att.verifier.node_id == "a" and balancer.inflight == {"a": 1}
    assert core.started(att) == [Started("a")]
    out = core.reply(att, chunk(0, 1, 2), now=1)
    view.dead["a"] = "membership says dead; connection closed"
    out += core.quiet(att, now=2)
    assert not att.open and isinstance(out[-1], Resuming) and out[-1].tokens == 2
    core.end(att)
    assert balancer.inflight == {}
    att = core.begin(now=3)
    assert att.verifier.node_id == "b"
    sent = att.message
    assert list(sent.tensors[0]) == [7, 8, 1, 2] and sent["max_tokens"] == 3
    out += core.reply(att, chunk(0, 3, 4, 5), now=4)  # b numbers its own chunks from 0
    out += core.reply(att, done("three four five "), now=5)
    text = "".join(e.text for e in out if isinstance(e, Piece))
    final = out[-1]
    assert isinstance(final, Final) and core.finished and not att.open
    assert text == final.text == "one two three four five "
    assert final.token_ids == (1, 2, 3, 4, 5) and final.verifiers == ("a", "b")
    assert final.failovers == 1 and final.prompt_tokens == 2


def test_a_lost_verifier_without_prompt_ids_is_an_error():
    view = View(verifier("a"), verifier("b"))
    core = core_for(view, prompt_ids=None, tokenizer=None)
    att = core.begin()
    core.reply(att, chunk(0, 1))
    with pytest.raises(ClusterError) as err:
        core.reply(att, PeerUnavailable("gone"))
    assert err.value.code == "verifier_lost" and "a died mid-generation" in str(err.value)


def test_no_other_verifier_after_a_loss_is_no_verifier():
    view = View(verifier("a"), verifier("other-model", model="x"), verifier("b", tokenizer="x"))
    core = core_for(view)
    att = core.begin()
    core.reply(att, PeerUnavailable("gone"))
    core.end(att)
    with pytest.raises(ClusterError) as err:
        core.begin()
    assert err.value.code == "no_verifier" and "failed mid-generation" in str(err.value)


def test_busy_before_output_tries_another_then_says_busy():
    view = View(verifier("a"), verifier("b", load=1))
    core = core_for(view)
    for expected in ("a", "b"):
        att = core.begin()
        assert att.verifier.node_id == expected
        busy = ErrorReply("busy", "queue full").to_message()
        assert core.reply(att, busy) == [] and not att.open
        core.end(att)
    with pytest.raises(ClusterError) as err:
        core.begin()
    assert err.value.code == "busy"


def test_the_verifiers_own_error_keeps_its_code():
    core = core_for(View(verifier("a")))
    att = core.begin()
    with pytest.raises(ClusterError) as err:
        core.reply(att, ErrorReply("too_long", "prompt over the context").to_message())
    assert err.value.code == "too_long" and err.value.remote
    assert err.value.detail == "prompt over the context"


def test_a_stall_moves_only_where_another_verifier_can_take_over():
    view = View(verifier("a"))
    core = core_for(view, stall_s=15.0)
    att = core.begin(now=0)
    core.reply(att, chunk(0, 1), now=1)
    assert core.quiet(att, now=100) == [] and att.open  # alone: waited for
    view.alive.append(verifier("b"))
    out = core.quiet(att, now=100)
    assert isinstance(out[0], Resuming) and "no reply for 15s" in out[0].why


def test_silence_past_the_idle_limit_is_a_timeout():
    core = core_for(View(verifier("a")), idle_s=5.0)
    att = core.begin(now=0)
    assert core.quiet(att, now=4) == []
    with pytest.raises(ClusterError) as err:
        core.quiet(att, now=6)
    assert err.value.code == "timeout"


def test_a_missing_chunk_is_a_broken_stream():
    core = core_for(View(verifier("a")))
    att = core.begin()
    core.reply(att, chunk(0, 1))
    with pytest.raises(ClusterError) as err:
        core.reply(att, chunk(2, 2))
    assert err.value.code == "broken_stream"


def test_a_full_verifier_is_not_picked_and_all_full_is_busy():
    balancer = Balancer(max_inflight=1)
    view = View(verifier("a"), verifier("b"))
    first = core_for(view, balancer).begin()
    second = core_for(view, balancer).begin()
    assert {first.verifier.node_id, second.verifier.node_id} == {"a", "b"}
    with pytest.raises(ClusterError) as err:
        core_for(view, balancer).begin()
    assert err.value.code == "busy"


class Client:
    """A StreamClient stand-in: each request gets its script of replies, or none (silence)."""

    def __init__(self, scripts):
        self.scripts = list(scripts)
        self.sent = []
        self.cancelled = 0

    def request(self, endpoint, message, on_reply):
        self.sent.append((endpoint, message))
        for item in self.scripts.pop(0):
            on_reply(self, item)
        return self

    @property
    def done(self):
        return False

    def cancel(self):
        self.cancelled += 1


def test_the_async_face_fails_over_and_frees_every_slot():
    view = View(verifier("a"), verifier("b", load=1))
    balancer = Balancer()
    core = core_for(view, balancer)
    client = Client([[chunk(0, 1, 2), PeerUnavailable("connection closed")],
                     [chunk(0, 3, 4, 5), done(None)]])

    async def run():
        return [ev async for ev in aio.events(core, client, asyncio.get_running_loop())]

    events = asyncio.run(run())
    assert [type(e).__name__ for e in events] == [
        "Started", "Piece", "Resuming", "Started", "Piece", "Final"]
    assert events[-1].text == "one two three four five "
    assert [ep for ep, _ in client.sent] == ["tcp://a", "tcp://b"]
    assert balancer.inflight == {} and client.cancelled == 2


def test_closing_the_async_face_cancels_the_call_and_frees_the_slot():
    balancer = Balancer()
    core = core_for(View(verifier("a")), balancer)
    client = Client([[]])

    async def run():
        gen = aio.events(core, client, asyncio.get_running_loop())
        assert isinstance(await anext(gen), Started)
        assert balancer.inflight == {"a": 1}
        await gen.aclose()  # the HTTP client went away

    asyncio.run(run())
    assert balancer.inflight == {} and client.cancelled == 1


# -- the line: generations waiting for a verifier slot (issue 24) -------------------------------
def test_beyond_the_limit_generations_wait_in_line_first_come_first_served():
    balancer = Balancer(max_inflight=1, queue=2, queue_wait_s=60.0)
    view = View(verifier("a"))
    first = core_for(view, balancer)
    running = first.begin(now=0)
    assert running.verifier.node_id == "a"
    second, third = core_for(view, balancer), core_for(view, balancer)
    woken = []
    second.wake, third.wake = (lambda: woken.append(2)), (lambda: woken.append(3))
    assert second.begin(now=1) is None and third.begin(now=2) is None  # both wait
    assert balancer.waiting == 2 and balancer.inflight == {"a": 1}
    # the line is full: the next one is busy at once, saying so
    with pytest.raises(ClusterError) as err:
        core_for(view, balancer).begin(now=3)
    assert err.value.code == "busy" and "2 requests already wait" in str(err.value)
    first.end(running)  # a slot frees: every waiter is woken ...
    assert sorted(woken) == [2, 3]
    assert third.begin(now=4) is None  # ... but the later one stays behind the earlier
    att = second.begin(now=5)
    assert att.verifier.node_id == "a" and balancer.waiting == 1
    assert balancer.inflight == {"a": 1}
    second.end(att)
    assert third.begin(now=6).verifier.node_id == "a" and balancer.waiting == 0


def test_a_waiter_that_leaves_gives_its_place_to_the_next():
    balancer = Balancer(max_inflight=1, queue=4)
    view = View(verifier("a"))
    holder = core_for(view, balancer)
    running = holder.begin(now=0)
    leaver, next_ = core_for(view, balancer), core_for(view, balancer)
    assert leaver.begin(now=1) is None and next_.begin(now=2) is None
    leaver.close()  # its client went away while queued
    assert balancer.waiting == 1
    holder.end(running)
    assert next_.begin(now=3).verifier.node_id == "a"
    assert balancer.waiting == 0 and balancer.refused == 0


def test_a_wait_past_its_limit_is_busy_and_leaves_the_line():
    balancer = Balancer(max_inflight=1, queue=4, queue_wait_s=10.0)
    view = View(verifier("a"))
    core_for(view, balancer).begin(now=0)
    waiter = core_for(view, balancer)
    assert waiter.begin(now=1) is None and 0 < waiter.wait_s(now=1) <= 1.0
    assert waiter.begin(now=10) is None
    with pytest.raises(ClusterError) as err:
        waiter.begin(now=11)
    assert err.value.code == "busy" and "waited 10s" in str(err.value)
    assert balancer.waiting == 0 and balancer.refused == 1


def test_a_waiter_for_another_model_is_not_held_up():
    balancer = Balancer(max_inflight=1, queue=4)
    view = View(verifier("a"), verifier("x", model="other"))
    core_for(view, balancer).begin(now=0)
    assert core_for(view, balancer).begin(now=1) is None  # waits for `a`
    other = Failover(GenerateRequest("hi", max_tokens=5), view, balancer, model="other")
    assert other.begin(now=2).verifier.node_id == "x"


def test_the_verifiers_card_sets_the_limit_and_the_client_can_only_lower_it():
    card = VerifierInfo("a", "a", "tcp://a", "m", "fp", 10.0, 0.0, per_client=16)
    assert Balancer(max_inflight=None).limit(card) == 16
    assert Balancer(max_inflight=4).limit(card) == 4
    assert Balancer(max_inflight=32).limit(card) == 16
    assert Balancer(max_inflight=None).limit(verifier("old")) is None  # says nothing: no cap
    assert Balancer(max_inflight=None, unknown_cap=8).limit(verifier("old")) == 8


def test_the_async_face_waits_in_line_and_a_closed_waiter_leaks_nothing():
    balancer = Balancer(max_inflight=1, queue=4)
    view = View(verifier("a"))
    holder, waiter, leaver = (core_for(view, balancer) for _ in range(3))
    client = Client([[], [chunk(0, 1, 2, 3, 4, 5), done(None)]])

    async def run():
        loop = asyncio.get_running_loop()
        running = aio.events(holder, client, loop)
        assert isinstance(await anext(running), Started)
        served = aio.events(waiter, client, loop)
        waiting = asyncio.ensure_future(anext(served))
        gone = aio.events(leaver, client, loop)
        leaving = asyncio.ensure_future(anext(gone))
        while balancer.waiting < 2:
            await asyncio.sleep(0)
        leaving.cancel()  # the HTTP client of the second waiter disconnects
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert balancer.waiting == 1 and not waiting.done()
        await running.aclose()  # the running one ends: the first waiter is woken and served
        assert isinstance(await asyncio.wait_for(waiting, 10), Started)
        assert balancer.waiting == 0 and balancer.inflight == {"a": 1}
        await served.aclose()

    asyncio.run(run())
    assert balancer.waiting == 0 and balancer.inflight == {}
    assert [ep for ep, _ in client.sent] == ["tcp://a", "tcp://a"]


def test_a_verifier_busy_with_other_clients_is_waited_for_not_refused():
    """Its own queue is full of other clients' work: with a line, the generation tries the
    other verifier, else waits; the busy one gets nothing more until one of ours there ends
    or HOLD_S passes. Without a line it is `busy` as before (test above)."""
    from nodes.cluster_client.choice import HOLD_S

    balancer = Balancer(max_inflight=4, queue=4, queue_wait_s=60.0)
    view = View(verifier("a"))
    other = core_for(view, balancer)
    mine = other.begin(now=0)  # one of ours runs on `a`
    core = core_for(view, balancer)
    att = core.begin(now=1)
    assert core.reply(att, ErrorReply("busy", "verifier queue is full").to_message(),
                      now=1) == [] and not att.open
    core.end(att)
    assert core.begin(now=1.5) is None and balancer.waiting == 1  # held: waits in line
    other.end(mine)  # ours there ended: its queue has room again
    again = core.begin(now=1.6)
    assert again.verifier.node_id == "a" and balancer.waiting == 0
    # none of ours left there: the hold lasts HOLD_S
    assert core.reply(again, ErrorReply("busy", "queue full").to_message(), now=2) == []
    core.end(again)
    assert core.begin(now=2 + HOLD_S / 2) is None
    assert core.begin(now=2 + HOLD_S).verifier.node_id == "a"
    # with another verifier up, a busy one is simply passed over
    view.alive.append(verifier("b", load=5))
    core2 = core_for(view, balancer)
    att = core2.begin(now=10)
    assert att.verifier.node_id == "a"
    core2.reply(att, ErrorReply("busy", "queue full").to_message(), now=10)
    core2.end(att)
    assert core2.begin(now=10.1).verifier.node_id == "b"


def _turn(view, balancer, prompt_ids, *out_ids):
    """One whole generation of `prompt_ids`; the verifier that served it."""
    core = core_for(view, balancer, prompt_ids=prompt_ids)
    att = core.begin(now=0)
    core.reply(att, chunk(0, *out_ids), now=1)
    events = core.reply(att, done(None), now=2)
    core.end(att)
    assert isinstance(events[-1], Final)
    return att.verifier.node_id


def test_a_conversations_next_turn_goes_back_to_the_verifier_holding_it_load_allowing():
    """A verifier's prefix cache holds the conversations it served (affinity.py): the next
    turn goes there unless it carries more than SLACK sequences above the least loaded."""
    from nodes.cluster_client.affinity import MIN_TOKENS, SLACK

    balancer = Balancer()
    first = tuple(range(10, 10 + MIN_TOKENS + 8))
    assert _turn(View(verifier("a", load=1), verifier("b")), balancer, first, 1, 2) == "b"
    turn2 = (*first, 1, 2, 9, 9)  # the conversation so far, then a new message
    # b is busier than a, but within the slack: back to b
    assert _turn(View(verifier("a"), verifier("b", load=SLACK)), balancer, turn2, 3) == "b"
    assert balancer.affinity.routed == 1
    # a prompt that continues nothing goes to the least loaded
    other = tuple(range(100, 100 + MIN_TOKENS + 8))
    assert _turn(View(verifier("a"), verifier("b", load=SLACK)), balancer, other, 1) == "a"
    # a third turn: its holder is past the slack now, so the least loaded serves it
    turn3 = (*turn2, 3, 9, 9)
    assert _turn(View(verifier("a"), verifier("b", load=SLACK + 1)), balancer, turn3, 4) == "a"
    # ...and holds it from then on (one entry per conversation: the latest extends the others)
    assert _turn(View(verifier("a", load=1), verifier("b")), balancer,
                 (*turn3, 4, 9), 5) == "a"
    assert len(balancer.affinity) == 2  # the conversation and `other`


def test_a_short_shared_beginning_or_a_full_holder_does_not_pull_a_turn():
    from nodes.cluster_client.affinity import MIN_TOKENS

    balancer = Balancer(max_inflight=1)
    header = tuple(range(10, 10 + MIN_TOKENS - 2))  # a chat template's header, say
    assert _turn(View(verifier("a", load=1), verifier("b")), balancer, (*header, 1), 1) == "b"
    assert _turn(View(verifier("a"), verifier("b", load=1)), balancer, (*header, 2), 1) == "a"
    long = tuple(range(200, 200 + MIN_TOKENS + 8))
    assert _turn(View(verifier("a", load=1), verifier("b")), balancer, long, 1) == "b"
    view = View(verifier("a", load=1), verifier("b"))
    balancer.acquire(view.alive[1])  # b is at this client's limit
    assert _turn(view, balancer, (*long, 1, 7), 2) == "a"
