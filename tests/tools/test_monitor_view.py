"""The monitor's text formatting (fast units; the live views are in test_monitor*.py)."""

from __future__ import annotations

from tools.monitor_view import rate_text


def test_rates_keep_their_width_and_say_their_magnitude():
    assert rate_text(0.0) == "     0.0"
    assert rate_text(20.74) == "    20.7"
    assert rate_text(999.94) == "   999.9"
    assert rate_text(354061.7) == "    354k"  # an n-gram drafter: matching takes microseconds
    assert rate_text(2_500_000.0) == "      2M"
    assert {len(rate_text(x)) for x in (0.0, 20.7, 1234.0, 354061.7, 9e8)} == {8}


def _member(node_id, name, roles, state="alive", observer=False):
    from discovery.cards import Card
    from discovery.table import Member, State

    card = Card(node_id=node_id, cluster="c", incarnation=1, version=1, roles=roles, name=name,
                endpoints={"gossip": "tcp://127.0.0.1:1", "stream": "tcp://127.0.0.1:2"},
                observer=observer)
    return Member(card=card, state=State(state), last_heard=0.0, since=0.0)


def test_panels_fit_120_columns_name_everyone_and_drop_departed_observers():
    import time

    from tools.monitor_view import ClusterView, render_text, role_lines

    view = ClusterView()
    members = [_member("v" * 12, "verifier-with-a-long-name", ("verifier",)),
               _member("p" * 12, "", ("proposer",)),
               _member("g" * 12, "gw", ("gateway",)),
               _member("o" * 12, "", (), state="left", observer=True)]
    view.refresh(members)
    long_name = {"name": "remote:" + "x" * 60, "acceptance": 0.5, "drafts": 123456,
                 "timeouts": 1234, "rtt_ms": 12345.678}
    for i in range(40):  # sparklines full, big numbers everywhere
        view.on_stats("v" * 12, {"verifier": {"tok_s": 12345.6, "acceptance": 0.91,
                                              "active": 1, "queued": 16, "orphans_dropped": 99,
                                              "proposers": {"p" * 12: long_name}},
                                 "cpu_percent": 100.0, "rss_bytes": 2**40})
        view.on_stats("p" * 12, {"proposer": {"sessions_open": 256, "drafts_served": 10**7,
                                              "draft_tokens": 1000 * i}})
        view.on_stats("g" * 12, {"gateway": {"http": "http://127.0.0.1:65535", "inflight": 8,
                                             "requests": 10**6, "failovers": 3,
                                             "cancelled": 2}})
        time.sleep(0.002)
    verifiers, proposers, gateways = role_lines(view)
    assert all(len(line) <= 110 for line in [*verifiers, *proposers, *gateways])
    assert verifiers[0].startswith("verifier-with-a…") and proposers[0].startswith("p" * 12)
    assert gateways and "in flight" in gateways[0]
    assert "drafted" in proposers[0] and "tok/s" in proposers[0]
    assert "o" * 12 not in render_text(view)  # a departed observer is not listed
