"""The flags every command that joins a cluster takes, declared once.

`specbus node`, `generate`, `members` and `monitor` all find their cluster the same way: a
cluster name, the interface mDNS runs on, optional `--peer` seeds, and `--no-mdns`. Declaring
them here keeps their names, defaults, validation and help identical everywhere.
"""

from __future__ import annotations

import argparse
import os

from discovery.interfaces import DEFAULT_INTERFACE
from nodes.node import parse_peer


def peer_arg(text: str) -> str:
    """argparse type for `--peer HOST:PORT`: a stream endpoint, or a clear usage error."""
    try:
        return parse_peer(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_float(text: str) -> float:
    """argparse type for a duration in seconds that must be > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return v


def cpu_list(text: str) -> set[int]:
    """argparse type for `--cpus 0,2-3`: a set of core numbers this machine has."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError
            cores.update(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected CPU cores like 0 or 1,3 or 0-2, got {text!r}") from None
    have = os.cpu_count() or 1
    missing = sorted(c for c in cores if c >= have)
    if missing:
        raise argparse.ArgumentTypeError(
            f"no CPU core {missing[0]} on this machine (it has {have}: 0-{have - 1})")
    return cores


def add_cluster_arguments(parser: argparse.ArgumentParser,
                          title: str = "cluster") -> argparse._ArgumentGroup:
    """Add --cluster, --interface, --peer, --no-mdns, --secret-file and --insecure as one
    group; returns the group."""
    group = parser.add_argument_group(title)
    group.add_argument("--cluster", default="specbus", help="cluster name (default: specbus)")
    group.add_argument("--interface", default=DEFAULT_INTERFACE,
                       help="IPv4 address, interface name, or 'all' for mDNS on every "
                            "interface (default: 127.0.0.1, this machine only)")
    group.add_argument("--peer", action="append", default=[], type=peer_arg,
                       metavar="HOST:PORT",
                       help="seed: another node's request endpoint (repeatable); works where "
                            "multicast does not")
    group.add_argument("--no-mdns", action="store_true",
                       help="do not use mDNS (seeds and gossip only)")
    group.add_argument("--secret-file", default=None, metavar="FILE",
                       help="cluster secret (from `specbus keygen`): CURVE-encrypt every "
                            "connection and authenticate gossip; default: $SPECBUS_SECRET_FILE. "
                            "Required off loopback unless --insecure")
    group.add_argument("--insecure", action="store_true",
                       help="allow running without a secret on a non-loopback interface "
                            "(anyone on the network can join and read traffic)")
    return group
