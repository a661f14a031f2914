"""The monitor against real node processes: JSON events, stats, the terminal UI, and that
attaching changes nothing for the cluster."""

from __future__ import annotations

import argparse
import asyncio
import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.local_cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def two_proposers(tmp_path):
    c = LocalCluster(log_dir=tmp_path / "logs", mdns=False)
    try:
        c.start_node("p1", "--role", "proposer")
        c.start_node("p2", "--role", "proposer", seed=True)
        yield c
    finally:
        c.stop()


def monitor_proc(cluster, *extra):
    seeds = [a for n in cluster.nodes for a in ("--peer", n.stream.removeprefix("tcp://"))]
    return subprocess.Popen(
        [sys.executable, "-m", "nodes.cli", "monitor", "--cluster", cluster.cluster,
         "--no-mdns", *seeds, *extra],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)


def read_until(proc, pred, timeout):
    """JSON lines from proc until pred(line) is true; returns (matched line, all lines)."""
    seen = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            break
        obj = json.loads(line)
        seen.append(obj)
        if pred(obj):
            return obj, seen
    return None, seen


def test_json_events_join_stats_leave_dead(two_proposers):
    p1, p2 = two_proposers.nodes
    mon = monitor_proc(two_proposers, "--json")
    try:
        joined = set()
        ok, seen = read_until(mon, lambda o: (o["event"] == "join" and joined.add(o["node_id"])
                                              is None and joined >= {p1.node_id, p2.node_id}),
                              20)
        assert ok, seen
        for o in seen:
            assert {"event", "node_id", "ts"} <= set(o)
        ok, seen = read_until(mon, lambda o: o["event"] == "stats" and o["node_id"] == p1.node_id,
                              10)
        assert ok, seen
        st = ok["stats"]
        assert st["proposer"]["sessions_open"] == 0 and st["proposer"]["drafts_served"] == 0
        # a proposer started without --drafter drafts with the suffix drafter, whose shared
        # index it reports (nodes/assemble.py, DEFAULT_PROPOSER_DRAFTER)
        assert st["proposer"]["suffix_index"]["index_bytes"] >= 0, st["proposer"]
        assert st["rss_bytes"] > 0 and "cpu_percent" in st and "dropped" in st
        p1.signal(signal.SIGTERM)
        ok, seen = read_until(mon, lambda o: o["event"] == "leave" and o["node_id"] == p1.node_id,
                              10)
        assert ok and ok["name"] == "p1", seen
        p2.signal(signal.SIGKILL)
        ok, seen = read_until(mon, lambda o: o["event"] == "dead" and o["node_id"] == p2.node_id,
                              10)
        assert ok and ok["state"] == "dead", seen
    finally:
        mon.terminate()
        assert mon.wait(10) == 0


def test_once_json_snapshot_lists_members_and_is_never_a_worker(two_proposers):
    out = subprocess.run(
        [sys.executable, "-m", "nodes.cli", "monitor", "--cluster", two_proposers.cluster,
         "--no-mdns", "--peer", two_proposers.nodes[0].stream.removeprefix("tcp://"),
         "--once", "--json", "--wait", "2.5"],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
    snap = json.loads(out.stdout)
    names = {m["name"]: m for m in snap["members"]}
    assert set(names) == {"p1", "p2"}
    assert all(m["state"] == "alive" and m["roles"] == ["proposer"] for m in names.values())
    assert all(m["stats"].get("proposer") is not None for m in names.values())


def test_tui_lists_nodes_and_updates_when_one_is_killed(two_proposers):
    from tools.monitor import Attached
    from tools.monitor_tui import MonitorApp

    p1, p2 = two_proposers.nodes
    args = argparse.Namespace(cluster=two_proposers.cluster, interface="127.0.0.1",
                              peer=[p1.stream.removeprefix("tcp://")], no_mdns=True)
    app = MonitorApp(Attached(args))

    def states(table):
        return {table.get_row_at(i)[0]: table.get_row_at(i)[6] for i in range(table.row_count)}

    async def scenario():
        async with app.run_test(size=(160, 40)) as pilot:
            table = app.query_one("#members")
            for _ in range(100):
                await pilot.pause(0.1)
                if states(table) == {"p1": "alive", "p2": "alive"}:
                    break
            assert states(table) == {"p1": "alive", "p2": "alive"}
            await pilot.resize_terminal(100, 30)  # survives a resize
            p2.signal(signal.SIGKILL)
            for _ in range(60):
                await pilot.pause(0.1)
                if states(table).get("p2") == "dead":
                    break
            assert states(table) == {"p1": "alive", "p2": "dead"}
            log = "\n".join(str(line) for line in app.query_one("#events").lines)
            assert "dead" in log and "p2" in log
            await pilot.press("q")

    asyncio.run(scenario())


def test_once_on_an_empty_cluster_says_so_and_fails():
    out = subprocess.run(
        [sys.executable, "-m", "nodes.cli", "monitor", "--cluster", "nobody-here-7f3a",
         "--no-mdns", "--once", "--wait", "0.5"],
        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 1
    assert "no members of cluster 'nobody-here-7f3a'" in out.stderr and out.stdout == ""
