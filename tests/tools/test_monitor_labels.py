"""Issue 47, item 6, without processes: the drafter column (monitor and `specbus members`), the
`load` a node reports, the labels, and an events panel sized to what it holds."""

from __future__ import annotations

import asyncio

from discovery.cards import Card
from discovery.table import Member, State
from nodes.telemetry import work_in_hand
from tools.members import format_table, member_json
from tools.monitor_view import LEGEND, MEMBER_COLUMNS, ClusterView, member_rows, render_text


def _member(node_id, name, roles, extras=None):
    card = Card(node_id=node_id, cluster="c", incarnation=1, version=1, roles=roles, name=name,
                endpoints={"gossip": "tcp://127.0.0.1:1", "stream": "tcp://127.0.0.1:2"},
                backend="none", extras=extras or {})
    return Member(card=card, state=State("alive"), last_heard=0.0, since=0.0)


def _cluster():
    view = ClusterView()
    view.refresh([_member("a" * 12, "prop-ngram", ("proposer",), {"drafter": "ngram"}),
                  _member("b" * 12, "prop-eagle", ("proposer",), {"drafter": "eagle:\x1bx"}),
                  _member("c" * 12, "verif", ("verifier",))])
    return view


def test_the_drafter_is_in_the_members_table_and_the_proposer_panel():
    view = _cluster()
    rows = {r[0]: dict(zip(MEMBER_COLUMNS, r, strict=True)) for r in member_rows(view)}
    assert rows["prop-ngram"]["drafter"] == "ngram"
    assert rows["prop-eagle"]["drafter"] == "eagle:?x"  # a peer's string, made printable
    assert rows["verif"]["drafter"] == "-"
    view.on_stats("a" * 12, {"proposer": {"sessions_open": 2, "draft_tokens": 5}})
    text = render_text(view)
    assert any(line.startswith("prop-ngram") and "drafter ngram" in line
               for line in text.splitlines()), text


def test_specbus_members_prints_the_drafter():
    view = _cluster()
    rows = [member_json(m) for m in view.members()]
    assert {r["name"]: r["drafter"] for r in rows} == {
        "prop-eagle": "eagle:?x", "prop-ngram": "ngram", "verif": ""}
    table = format_table(rows).splitlines()
    assert "DRAFTER" in table[0]
    assert any("prop-ngram" in line and " ngram " in line for line in table)


def test_load_is_the_nodes_own_figure_once_its_stats_arrive():
    view = _cluster()
    loads = {r[0]: r[-1] for r in member_rows(view)}
    assert loads["verif"] == "0.00"  # the card's, before any stats
    view.on_stats("c" * 12, {"verifier": {"active": 3, "queued": 2}, "load": 5})
    assert {r[0]: r[-1] for r in member_rows(view)}["verif"] == "5.00"
    view.on_stats("c" * 12, {"load": True})  # malformed: the card's again
    assert {r[0]: r[-1] for r in member_rows(view)}["verif"] == "0.00"


def test_work_in_hand_sums_the_roles_work_without_counting_a_generation_twice():
    assert work_in_hand({}) == 0
    assert work_in_hand({"verifier": {"active": 3, "queued": 2}}) == 5
    assert work_in_hand({"proposer": {"sessions_open": 7}}) == 7
    assert work_in_hand({"gateway": {"inflight": 4}}) == 4
    # a gateway's requests beside its own verifier are that verifier's generations
    assert work_in_hand({"verifier": {"active": 1, "queued": 0}, "gateway": {"inflight": 1},
                         "proposer": {"sessions_open": 2}}) == 3
    assert work_in_hand({"verifier": {"active": "x", "queued": -1, "x": True}}) == 0


def test_once_and_the_live_view_share_the_labels():
    view = _cluster()
    view.on_stats("c" * 12, {"verifier": {"tok_s": 5.0, "acceptance": 0.5, "active": 0,
                                          "queued": 0, "max_batch": 4, "steps": 10,
                                          "stepped": 10, "rows": 20, "committed": 15}})
    text = render_text(view)
    assert all(line in text for line in LEGEND)
    assert "last gen" in text and "(since start)" in text and "total: steps 10" in text


class _FakeAttached:
    cluster = "c"

    def __init__(self, view):
        self.view = view

    def start(self):
        return self

    def refresh(self):
        pass

    def stop(self):
        pass


def test_the_events_panel_is_as_tall_as_what_it_holds():
    from textual.widgets import RichLog, Static

    from tools.monitor_tui import EVENT_ROWS, MonitorApp

    view = _cluster()
    for i in range(3):
        view.log.append(f"event {i}")
        view.log_total += 1
    app = MonitorApp(_FakeAttached(view))

    async def scenario():
        async with app.run_test(size=(140, 48)) as pilot:
            events = app.query_one("#events", RichLog)
            for _ in range(300):  # no timing assumed: wait for a refresh however slow
                await pilot.pause(0.1)
                if events.outer_size.height == 3 + 2:
                    break
            assert events.outer_size.height == 3 + 2  # three lines and its border
            legend = str(app.query_one("#legend", Static).render())
            assert "labels: now =" in legend
            for i in range(40):
                view.log.append(f"more {i}")
                view.log_total += 1
            for _ in range(300):
                await pilot.pause(0.1)
                if events.outer_size.height == EVENT_ROWS + 2:
                    break
            assert events.outer_size.height == EVENT_ROWS + 2  # then it scrolls
            await pilot.press("q")

    asyncio.run(scenario())
