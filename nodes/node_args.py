"""What a node's command-line flags become: its `NodeConfig`, and the process's CPU pinning.

Shared by `specbus node` (nodes/cmd_node.py) and the sharded verifier's processes
(nodes/shard/node_run.py), so neither imports the other.
"""

from __future__ import annotations

import argparse
import logging
import os

from bus.security import resolve_secret_path
from discovery.table import Timeouts
from nodes.node import NodeConfig

log = logging.getLogger(__name__)


def config_from_args(args: argparse.Namespace) -> NodeConfig:
    observer = args.role == ("observer",)
    try:
        timeouts = Timeouts(heartbeat=args.heartbeat, suspect_after=args.suspect_after,
                            dead_after=args.dead_after, forget_after=args.forget_after)
    except ValueError as exc:
        raise SystemExit(f"specbus node: {exc}") from None
    return NodeConfig(
        cluster=args.cluster, roles=() if observer else args.role, observer=observer,
        interface=args.interface, peers=tuple(args.peer), port=args.port, name=args.name,
        advertise=args.advertise or "",
        backend=args.backend or "", model=args.model, drafter=args.drafter, mdns=not args.no_mdns,
        state_dir=args.state_dir, timeouts=timeouts,
        secret_file=resolve_secret_path(args.secret_file), insecure=args.insecure,
    )


def pin_cpus(args: argparse.Namespace) -> None:
    """`--cpus`: pin the whole process (every thread it starts later too) to those cores."""
    if args.cpus is None:
        return
    try:
        os.sched_setaffinity(0, args.cpus)
    except (OSError, AttributeError) as exc:
        raise ValueError(f"--cpus {sorted(args.cpus)}: cannot pin this process: {exc}") from None
    if not args.threads:
        args.threads = len(args.cpus)
    log.info("pinned to CPUs %s, %d torch threads", sorted(args.cpus), args.threads)
