"""`specbus monitor`: attach to the bus as an observer and watch the cluster live.

Three modes: the terminal UI (default), `--json` (one JSON object per line per event: join,
update, suspect, alive, dead, leave, stats), and `--once` (a snapshot after `--wait` seconds,
as text or, with `--json`, one JSON object). The monitor joins as an observer: it is never
counted as a worker and never offered work.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

from nodes.cluster_args import add_cluster_arguments
from nodes.json_lines import JsonLines
from tools.monitor_view import ClusterView, render_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cluster_arguments(parser)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per line per event instead of the UI")
    parser.add_argument("--once", action="store_true",
                        help="print a snapshot after --wait seconds and exit")
    parser.add_argument("--wait", type=float, default=3.0,
                        help="seconds to listen before a --once snapshot (default 3)")


class Attached:
    """An observer node wired to a ClusterView; `emit` gets each event's JSON form."""

    def __init__(self, args: argparse.Namespace, emit=None) -> None:
        from nodes.node import Node, NodeConfig, parse_peer
        from nodes.telemetry import stats_topic

        self.view = ClusterView()
        self.emit = emit or (lambda obj: None)
        self.cluster = args.cluster
        self.topic = stats_topic(args.cluster)
        self.node = Node(NodeConfig(cluster=args.cluster, observer=True,
                                    interface=args.interface,
                                    peers=tuple(parse_peer(p) for p in args.peer),
                                    mdns=not args.no_mdns,
                                    # tools build args by hand (demo): absent = no secret
                                    secret_file=getattr(args, "secret_file", None),
                                    insecure=getattr(args, "insecure", False)))

    def start(self) -> Attached:
        self.node.register_gossip("stats", self._on_stats)
        self.node.start(on_event=lambda ev: self.emit(self.view.on_event(ev)))
        self.node.gossip.subscribe(self.topic)
        return self

    def refresh(self) -> None:
        self.view.refresh(self.node.membership.members(include_self=False))

    def stop(self) -> None:
        self.node.stop(leave=True)

    def _on_stats(self, topic: str, msg) -> None:
        if topic != self.topic or msg.get("cluster") != self.cluster or not msg.sender:
            return
        m = self.node.membership.get(msg.sender)
        if m is None:
            return  # stats from a node we do not know (yet): wait for its card
        self.emit(self.view.on_stats(msg.sender, dict(msg["stats"])))


def run(args: argparse.Namespace) -> int:
    if args.wait < 0:
        print("specbus monitor: --wait must be >= 0", file=sys.stderr)
        return 2
    try:
        if args.once:
            return _once(args)
        if args.json:
            return _stream_json(args)
        from tools.monitor_tui import run_tui

        return run_tui(Attached(args))
    except ValueError as exc:
        print(f"specbus monitor: {exc}", file=sys.stderr)
        return 2


def _once(args: argparse.Namespace) -> int:
    att = Attached(args).start()
    try:
        time.sleep(args.wait)
        att.refresh()
        snap = att.view.snapshot()
    finally:
        att.stop()
    if args.json:
        print(json.dumps(snap, default=str))
    if not att.view.members():  # as `members` does: an empty table is an answer, not success
        print(f"specbus monitor: no members of cluster {args.cluster!r} seen within "
              f"{args.wait:g}s", file=sys.stderr)
        return 1
    if not args.json:
        print(render_text(att.view))
    return 0


def _stream_json(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    att = Attached(args, emit=JsonLines()).start()
    try:
        while not stop.wait(0.2):
            pass
    finally:
        att.stop()
    return 0
