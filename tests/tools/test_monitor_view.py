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
                                              "max_batch": 256, "steps": 10**7 + i,
                                              "stepped": 256 * (10**7 + i),
                                              "rows": 10**12 + i, "committed": 10**11,
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
    assert verifiers[1].startswith("  batch 1/256  per step: sequences")
    assert verifiers[1].endswith("s)") and "(last " in verifiers[1]
    assert verifiers[0].startswith("verifier-with-a…") and proposers[0].startswith("p" * 12)
    assert gateways and "in flight" in gateways[0]
    assert "drafter -" in proposers[0]  # its card names none here
    assert "drafted" in proposers[1] and "tok/s" in proposers[1] and "last " in proposers[1]
    assert "o" * 12 not in render_text(view)  # a departed observer is not listed


def _verifier_stats(steps, stepped, rows, committed, active=0, max_batch=4):
    return {"verifier": {"tok_s": 10.0, "acceptance": 0.5, "active": active, "queued": 0,
                         "max_batch": max_batch, "steps": steps, "stepped": stepped,
                         "rows": rows, "committed": committed}}


def test_batch_figures_follow_the_latest_interval_it_stepped_in():
    from tools.monitor_view import ClusterView, role_lines

    view = ClusterView()
    view.refresh([_member("v" * 12, "v", ("verifier",))])
    view.on_stats("v" * 12, _verifier_stats(10, 20, 60, 30, active=2))  # since it started
    assert view.stats("v" * 12).batch_window_s is None
    assert "(since start)" in role_lines(view)[0][1]
    assert view.stats("v" * 12).batch == {"mean_batch": 2.0, "rows_per_forward": 6.0,
                                          "tokens_per_forward_per_seq": 1.5}
    view.on_stats("v" * 12, _verifier_stats(14, 36, 100, 62, active=4))  # +4 steps, 16 seqs
    batch = role_lines(view)[0][1]
    window = view.stats("v" * 12).batch_window_s
    assert window is not None and window >= 0  # over the interval between the two samples
    assert batch == ("  batch 4/4  per step: sequences  4.00  rows/forward   10.0  "
                     f"tokens/forward/seq  2.00 (last {window:.1f}s)")
    view.on_stats("v" * 12, _verifier_stats(14, 36, 100, 62, active=0))  # idle: kept
    assert "sequences  4.00" in role_lines(view)[0][1] and "batch 0/4" in role_lines(view)[0][1]
    view.on_stats("v" * 12, _verifier_stats(1, 1, 9, 1, active=1))  # restarted: from 0 again
    assert view.stats("v" * 12).batch["rows_per_forward"] == 9.0
    assert "(since start)" in role_lines(view)[0][1]
    view.on_stats("v" * 12, {"verifier": {"tok_s": 1.0, "steps": "x"}})  # no batch counters
    assert len(role_lines(view)[0]) == 2  # the verifier's line and the cpu line, no batch line


def test_the_totals_line_shows_prompt_positions_reused_once_there_are_any():
    from tools.monitor_view import ClusterView, role_lines

    view = ClusterView()
    view.refresh([_member("v" * 12, "v", ("verifier",))])
    for reused, tail in ((0, "total: steps 10"), (1234, "total: steps 10  prompt reused 1234"),
                         ("x", "total: steps 10")):
        stats = _verifier_stats(10, 20, 60, 30)
        stats["verifier"]["reused"] = reused
        view.on_stats("v" * 12, stats)
        assert role_lines(view)[0][2].endswith(tail)


def test_batch_figures_render_from_a_real_verifier_telemetry_snapshot(tiny_backend):
    """A batching verifier role (tiny random model, its own n-gram drafter) serves four
    requests at once; what its node would publish (`Roles.telemetry`) renders as the
    monitor's batch line, with the figures its counters give."""
    from bus.loop import IOLoop
    from bus.sockets import SocketFactory
    from codec.messages import make
    from nodes.assemble import Roles
    from nodes.drafters.ngram import NgramDrafter
    from nodes.engine.core import Engine
    from nodes.verifier.role import VerifierRole
    from tests.nodes.conftest import BusHost
    from tools.monitor_view import ClusterView, render_text, role_lines

    loop = IOLoop(name="monitor-test-io").start()
    role = VerifierRole(Engine(tiny_backend, NgramDrafter(), max_draft=4), max_batch=4)
    try:
        host = BusHost(loop, SocketFactory())
        role.attach(host)
        prompt = "Copy this: one two three four, one two three four, one two three four"
        calls = [host.client.request(host.server.endpoint,
                                     make("generate_req", prompt=prompt, max_tokens=12 + i),
                                     timeout=120) for i in range(4)]
        for call in calls:
            call.result(120)
        stats = Roles(verifier=role).telemetry()
    finally:
        role.close()
        loop.stop()
    v = stats["verifier"]
    assert v["max_batch"] == 4 and v["steps"] > 0 and v["generations"] == 4
    assert v["committed"] == v["tokens"] > 0  # every token committed in a step, streamed once
    view = ClusterView()
    view.refresh([_member("v" * 12, "v", ("verifier",))])
    view.on_stats("v" * 12, {**stats, "cpu_percent": 1.0, "rss_bytes": 2**20})
    line = role_lines(view)[0][1]
    assert line == (f"  batch 0/4  per step: sequences {v['stepped'] / v['steps']:5.2f}  "
                    f"rows/forward {v['rows'] / v['steps']:6.1f}  tokens/forward/seq "
                    f"{v['committed'] / v['stepped']:5.2f} (since start)")
    assert line in render_text(view)  # the `--once` snapshot; the TUI shows role_lines too


def test_the_totals_line_shows_the_verifiers_cumulative_acceptance():
    """Issue 47: the verifier's own running acceptance (every client's, since it started),
    on the `total:` line, beside the last generation's on its first line."""
    from tools.monitor_view import ClusterView, role_lines

    view = ClusterView()
    view.refresh([_member("v" * 12, "v", ("verifier",))])
    stats = _verifier_stats(10, 20, 60, 30)
    stats["verifier"].update(acceptance=0.0, acceptance_cumulative=0.56, drafted=400)
    view.on_stats("v" * 12, stats)
    lines = role_lines(view)[0]
    assert "accept 0.00" in lines[0]
    assert lines[2].endswith("total: steps 10  accept 0.56 of 400 drafted")


def test_a_round_trip_never_timed_reads_as_unknown_not_zero():
    """A quiet proposer's commit answers are read late and never timed (`rtt_ms` null in the
    verifier's stats): the panel says '-', not 0 ms, and a timed one keeps its figure."""
    from tools.monitor_view import ClusterView, role_lines

    view = ClusterView()
    view.refresh([_member("v" * 12, "v", ("verifier",))])
    links = {"a" * 12: {"name": "quiet", "acceptance": 0.0, "drafts": 0, "rtt_ms": None},
             "b" * 12: {"name": "near", "acceptance": 0.5, "drafts": 9, "rtt_ms": 1.25}}
    stats = _verifier_stats(1, 1, 1, 1)
    stats["verifier"]["proposers"] = links
    view.on_stats("v" * 12, stats)
    lines = role_lines(view)[0]
    quiet = next(line for line in lines if "quiet" in line)
    near = next(line for line in lines if "near" in line)
    assert quiet.endswith("last rtt      - ms") and near.endswith("last rtt   1.25 ms")
