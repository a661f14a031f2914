"""`specbus node --role verifier --shards N --shard-group NAME`: one process of a sharded verifier.

Each round: join as a forming, non-worker member; wait until the group's N processes are present
(rendezvous.py); load only this rank's layers; join the torch.distributed group through rank 0's
TCP store. Rank 0 then leaves and rejoins as the verifier the cluster sees (its card lists the
stages); the other ranks stay as non-worker members marked as stages and follow rank 0's ops.
When any part fails (a stage dies, hangs or leaves) every process leaves the cluster and starts
a new round, so a restarted stage re-forms the group.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace

import psutil

from discovery.table import State
from nodes.engine.errors import GenerationError
from nodes.shard.layout import ShardBrokenError, ShardConfigError, split_layers

log = logging.getLogger(__name__)


def check_args(args: argparse.Namespace) -> None:
    """Reject what a shard process cannot be, before loading anything."""
    if args.shards < 1:
        raise ShardConfigError(f"--shards must be >= 1, got {args.shards}")
    if args.shards == 1:
        raise ShardConfigError("--shards 1 is an unsharded verifier: drop --shards")
    if not args.shard_group or len(args.shard_group) > 64:
        raise ShardConfigError("--shards needs --shard-group NAME (1-64 characters)")
    if args.role != ("verifier",):
        raise ShardConfigError("--shards applies to --role verifier alone")
    if (args.backend or "torch") != "torch":
        raise ShardConfigError(
            f"--shards is not supported on the {args.backend} backend (the pipeline runs on "
            "torch.distributed); use --backend torch")
    if args.shard_timeout <= 0 or args.shard_timeout > 600:
        raise ShardConfigError(f"--shard-timeout must be in (0, 600] s, got {args.shard_timeout}")


def interface_name(host: str) -> str | None:
    """The network interface holding `host` (gloo binds there, never on every interface)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == host for a in addrs):
            return name
    return None


class ShardProcess:
    """Runs rounds until stopped; one Node at a time."""

    def __init__(self, args: argparse.Namespace, printer) -> None:
        from nodes import models
        from nodes.backends.tokenizer import Tokenizer
        from nodes.node_args import config_from_args

        self.args = args
        self.printer = printer
        self.stop = threading.Event()
        self.ref = models.resolve(args.model or None)
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(self.ref.path), local_files_only=True)
        self.layers = int(cfg.num_hidden_layers)
        split_layers(self.layers, args.shards, 0)  # more shards than layers: fail now
        self.tokenizer = Tokenizer(self.ref.path)
        self.vocab = int(cfg.vocab_size)
        self.base = config_from_args(args)
        from discovery.interfaces import resolve_interface

        self.host = resolve_interface(self.base.interface).bind_host

    def emit(self, obj: dict) -> None:
        if self.printer is not None:
            self.printer({**obj, "t": time.monotonic()})

    def _start_node(self, roles: tuple[str, ...], card_fields: dict, attach=None):
        from nodes.json_lines import event_json
        from nodes.logs import set_node_id
        from nodes.node import Node

        config = replace(self.base, roles=roles, card_fields=card_fields, drafter="")
        node = Node(config)
        if attach is not None:
            attach.attach(node)
        node.start(on_event=(lambda ev: self.printer(event_json(ev))) if self.printer else None)
        for handler in logging.getLogger().handlers:
            set_node_id(handler, node.node_id)
        return node

    def run(self) -> int:
        while not self.stop.is_set():
            try:
                self.round()
            except ShardConfigError as exc:
                print(f"specbus node: {exc}", file=sys.stderr)
                return 2
            except ShardBrokenError as exc:
                log.warning("shard group %r broke: %s; re-forming", self.args.shard_group, exc)
                self.emit({"event": "shard_broken", "error": str(exc)})
                self.stop.wait(1.0)
        return 0

    def round(self) -> None:
        from nodes.shard.pipeline import close_group
        from nodes.shard.rendezvous import listen_socket, shard_extras, wait_for_group
        from nodes.shard.stage import StageModel

        args = self.args
        sock = listen_socket(self.host)
        fields = {"backend": "torch", "model": self.ref.name,
                  "tokenizer": self.tokenizer.fingerprint, "vocab": self.vocab,
                  "extras": {"shard": shard_extras(args.shard_group, args.shards,
                                                   sock.getsockname()[1], self.layers)}}
        node = self._start_node((), fields)
        card = node.membership.card
        self.emit({"event": "ready", "node_id": node.node_id, "name": card.name,
                   "incarnation": card.incarnation, "endpoints": card.endpoints,
                   "shard": "forming"})
        try:
            plan = wait_for_group(node, args.shard_group, args.shards, self.stop)
            if plan is None:
                return
            part = split_layers(self.layers, plan.world, plan.rank)
            if torch_cuda_available():
                log.warning("shard stages run on CPU over gloo even on a CUDA host: CUDA "
                            "stages over NCCL are not implemented (docs/sharding.md)")
            stage = StageModel(self.ref.path, part)
            self._join_group(plan, sock)
        except BaseException:
            node.stop(leave=True)
            sock.close()
            close_group()
            raise
        if plan.rank != 0:
            sock.close()
        try:
            if plan.rank == 0:
                node.stop(leave=True)
                node = None
                self._serve(plan, stage)
            else:
                self._follow(node, plan, stage)
        finally:
            if node is not None:
                node.stop(leave=True)
            sock.close()
            close_group()

    def _join_group(self, plan, sock) -> None:
        import torch.distributed as dist

        from nodes.shard.pipeline import init_group

        ifname = interface_name(self.host if plan.rank else plan.store_host)
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        try:
            init_group(plan.store_host, plan.store_port, plan.rank, plan.world,
                       self.args.shard_timeout * 3,
                       listen_fd=sock.fileno() if plan.rank == 0 else None)
        except (RuntimeError, dist.DistStoreError) as exc:
            raise ShardBrokenError(f"cannot form the group: {str(exc).splitlines()[0]}") from None
        log.info("shard group %r formed: rank %d of %d", self.args.shard_group, plan.rank,
                 plan.world)

    def _follow(self, node, plan, stage) -> None:
        from nodes.shard.pipeline import Link, follow

        sh = dict(node.membership.card.extras["shard"], phase="stage", rank=plan.rank,
                  leader=plan.members[0])
        node.membership.update_card(extras={"shard": sh})
        self.emit({"event": "shard_formed", "rank": plan.rank, "world": plan.world,
                   "node_id": node.node_id, "members": list(plan.members),
                   "param_mb": round(stage.param_bytes / 2**20, 1)})
        link = Link(self.args.shard_timeout, int(stage.full_config.hidden_size), self.vocab)
        follow(stage, link, self.stop)
        log.info("rank 0 stopped the pipeline; re-forming")

    def _serve(self, plan, stage) -> None:
        from nodes.assemble import RoleSpec, assemble
        from nodes.shard.pipeline import ShardedBackend
        from nodes.telemetry import Telemetry

        args = self.args
        backend = ShardedBackend(stage, self.tokenizer, self.ref.name, args.shard_timeout)
        node = roles = telemetry = None
        try:
            spec = RoleSpec(roles=("verifier",), backend="torch",
                            drafter=args.drafter or "none", max_draft=args.max_draft,
                            lease_s=args.session_lease,
                            threads=args.threads, max_context=args.max_context,
                            prebuilt=backend)
            try:
                roles = assemble(spec)
            except GenerationError as exc:
                if backend.broken:
                    raise ShardBrokenError(backend.broken) from None
                raise ShardConfigError(str(exc)) from None
            extras = dict(roles.card.get("extras") or {})
            extras["shard"] = {"group": args.shard_group, "of": plan.world, "phase": "serving",
                               "rank": 0, "stages": list(plan.members[1:])}
            node = self._start_node(("verifier",), {**roles.card, "extras": extras}, roles)
            card = node.membership.card
            self.emit({"event": "shard_formed", "rank": 0, "world": plan.world,
                       "node_id": node.node_id, "endpoints": card.endpoints,
                       "members": list(plan.members),
                       "param_mb": round(stage.param_bytes / 2**20, 1)})
            telemetry = Telemetry(node, providers=[roles.telemetry])
            telemetry.start()
            # this node is new: until it has heard of a stage, not knowing it means "not yet",
            # not "gone" (a loaded machine took longer than a 0.2 s tick, and the group broke
            # and re-formed in a loop); unknown after the grace, or forgotten once seen, is gone
            grace_until = time.monotonic() + 3 * args.shard_timeout
            seen: set[str] = set()
            while not self.stop.wait(0.2):
                if backend.broken:
                    raise ShardBrokenError(backend.broken)
                gone = [s for s in plan.members[1:]
                        if _gone(node, s, seen, time.monotonic() > grace_until)]
                if gone:
                    raise ShardBrokenError(f"stage {', '.join(gone)} left the cluster")
        finally:
            if telemetry is not None:
                telemetry.stop()
            if roles is not None:
                # in-flight and queued requests fail fast on the broken pipeline; their error
                # replies go out through the node before it leaves
                roles.close()
                time.sleep(0.2)
            if node is not None:
                node.stop(leave=True)
            backend.close()


def _gone(node, node_id: str, seen: set[str], grace_over: bool) -> bool:
    """Whether a stage is dead or left; `seen` collects the stages this node has known."""
    m = node.membership.get(node_id)
    if m is None:
        return node_id in seen or grace_over
    seen.add(node_id)
    return m.state in (State.DEAD, State.LEFT)


def run_sharded(args: argparse.Namespace) -> int:
    """Entry point from `specbus node` when `--shards` is given."""
    from nodes.json_lines import JsonLines
    from nodes.node_args import pin_cpus

    try:
        check_args(args)
        pin_cpus(args)
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        proc = ShardProcess(args, JsonLines() if args.print_events else None)
    except ValueError as exc:  # ShardConfigError, ModelNotFoundError, bad interface
        print(f"specbus node: {exc}", file=sys.stderr)
        return 2

    def on_signal(signum: int, frame: object) -> None:
        proc.stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    rc = proc.run()
    proc.emit({"event": "exit"})
    return rc


def torch_cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())
