"""A node's log says why its incarnation rose (issue 47, item 6): a refutation is a warning
naming the claim it answers; a start logs the incarnation it took and what the counter held."""

from __future__ import annotations

import logging
from dataclasses import replace

from discovery.cards import Card
from discovery.identity import Identity, acquire_identity
from discovery.refuter import Refuter


class _View:
    def __init__(self, card):
        self.own = card


class _Announcer:
    left = False

    def __init__(self, view):
        self.view = view

    def set_card(self, card):
        self.view.own = card


class _Counters:
    def __init__(self):
        self.counts = {}

    def inc(self, name, n=1):
        self.counts[name] = self.counts.get(name, 0) + n


class _Loop:
    def call_later(self, delay, fn):
        self.later = fn


def _refuter():
    card = Card(node_id="a" * 12, cluster="c", incarnation=1, version=3, roles=("proposer",),
                name="p", endpoints={"gossip": "tcp://127.0.0.1:1",
                                     "stream": "tcp://127.0.0.1:2"})
    view = _View(card)
    return Refuter(_Loop(), view, Identity("a" * 12, 1, None, None), _Announcer(view),
                   _Counters(), heartbeat_s=0.5), view


def test_a_refutation_logs_the_rise_and_its_reason(caplog):
    refuter, view = _refuter()
    with caplog.at_level(logging.WARNING, logger="discovery.membership"):
        refuter.refute(1, "bbbbbbbbbbbb listing us as suspect")
    assert view.own.incarnation == 2
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == ["raising our incarnation 1 -> 2 to refute bbbbbbbbbbbb listing us as "
                     "suspect"]


def test_claims_in_our_name_say_what_they_were(caplog):
    for call, words in ((lambda r: r.on_own_heartbeat(2, 1), "a heartbeat in our name at "
                         "incarnation 2"),
                        (lambda r: r.on_own_leave(1), "a leave announced in our name"),
                        (lambda r: r.on_own_card(replace(r.view.own, incarnation=3)),
                         "a card of ours at incarnation 3")):
        refuter, view = _refuter()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="discovery.membership"):
            call(refuter)
        assert view.own.incarnation > 1
        assert any(words in r.getMessage() for r in caplog.records), caplog.records


def test_a_start_logs_its_incarnation(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="discovery.identity"):
        first = acquire_identity("c", "node-x", state_dir=tmp_path)
        first.release()
        second = acquire_identity("c", "node-x", state_dir=tmp_path)
        second.release()
    assert second.incarnation == first.incarnation + 1
    lines = [r.getMessage() for r in caplog.records if "started again" in r.getMessage()]
    assert f"incarnation {second.incarnation} for node {second.node_id}" in lines[-1]
    assert f"held {first.incarnation})" in lines[-1]
