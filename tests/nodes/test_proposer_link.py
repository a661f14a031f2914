"""A verifier's view of one proposer: the round trip it shows and drafts ahead by."""

from __future__ import annotations

from nodes.verifier.proposer_client import RTT_WINDOW, ProposerLink


def test_late_reads_never_inflate_the_round_trip():
    """Replies read a verify forward late are upper bounds; the estimate is the tightest."""
    link = ProposerLink("p", "tcp://127.0.0.1:1")
    for rtt in (0.120, 0.0004, 0.080, 0.150, 0.045):
        link.observe_rtt(rtt)
    assert link.net_s == 0.0004
    assert link.as_dict()["rtt_ms"] == 0.4


def test_an_old_low_reading_ages_out():
    """The path got slower (a proposer moved, the LAN is loaded): the estimate follows."""
    link = ProposerLink("p", "tcp://127.0.0.1:1")
    link.observe_rtt(0.0004)
    for _ in range(RTT_WINDOW):
        link.observe_rtt(0.003)
    assert link.net_s == 0.003


def test_untimed_readings_size_the_horizon_but_are_not_shown():
    """A quiet source's late readings (its read cadence) feed `net_s`, never `rtt_ms`."""
    link = ProposerLink("p", "tcp://127.0.0.1:1")
    link.observe_rtt(0.162, timed=False)
    assert link.net_s == 0.162 and link.as_dict()["rtt_ms"] is None
    link.observe_rtt(0.0009)
    link.observe_rtt(0.150, timed=False)
    assert link.net_s == 0.0009 and link.as_dict()["rtt_ms"] == 0.9
