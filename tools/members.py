"""`specbus members`: join briefly as an observer, print the membership table, leave.

An observer has no roles, is never counted as a worker and is never offered work; it leaves
gracefully, so the members it looked at drop it at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from discovery.cards import printable
from discovery.table import Member
from nodes.cluster_args import add_cluster_arguments, positive_float
from nodes.logs import set_node_id
from nodes.node import Node, NodeConfig
from tools.monitor_view import card_drafter


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cluster_arguments(parser)
    parser.add_argument("--wait", type=positive_float, default=1.5,
                        help="seconds to listen before printing (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead")


def member_json(m: Member) -> dict:
    c = m.card
    return {
        "node_id": c.node_id, "name": c.name,
        "roles": ["observer"] if c.observer else list(c.roles),
        "state": m.state.value, "incarnation": c.incarnation, "version": c.version,
        "endpoints": dict(c.endpoints), "backend": c.backend, "model": c.model,
        "drafter": card_drafter(c),
        "tokenizer": c.tokenizer, "vocab": c.vocab, "tok_s": c.tok_s, "load": c.load,
        "free_mem": c.free_mem, "observer": c.observer, "extras": c.extras,
        "insecure": bool(c.extras.get("insecure")),
    }


def format_table(rows: list[dict]) -> str:
    cols = ("node_id", "name", "roles", "state", "incarnation", "backend", "model", "drafter",
            "stream")
    data = [
        [r["node_id"], printable(r["name"] or "-", 40), printable(",".join(r["roles"]) or "-"),
         r["state"], str(r["incarnation"]), printable(r["backend"] or "-", 20),
         printable(r["model"] or "-", 60), printable(r.get("drafter") or "-", 40),
         r["endpoints"].get("stream", "-") + ("  INSECURE" if r["insecure"] else "")]
        for r in rows
    ]
    widths = [max(len(c), *(len(d[i]) for d in data)) if data else len(c)
              for i, c in enumerate(cols)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(d, widths, strict=True)) for d in data]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cfg = NodeConfig(cluster=args.cluster, observer=True, interface=args.interface,
                     peers=tuple(args.peer), mdns=not args.no_mdns,
                     secret_file=args.secret_file, insecure=args.insecure)
    try:
        node = Node(cfg).start()
    except (ValueError, OSError) as exc:
        print(f"specbus members: {exc}", file=sys.stderr)
        return 2
    for handler in logging.getLogger().handlers:
        set_node_id(handler, node.node_id)
    try:
        time.sleep(args.wait)
        members = node.membership.members(include_self=False)
    finally:
        node.stop(leave=True)
    rows = sorted((member_json(m) for m in members), key=lambda r: (r["name"], r["node_id"]))
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        print(format_table(rows))
    else:
        print(f"no members of cluster {args.cluster!r} seen within {args.wait}s")
    return 0
