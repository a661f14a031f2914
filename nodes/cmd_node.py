"""`specbus node`: run a node that joins its cluster, serves its roles, and leaves on
SIGINT/SIGTERM.

Roles (nodes/verifier, nodes/proposer; built by nodes/assemble.py) are assembled
before joining — models loaded, speed measured — so the first card is complete; they register
their request handlers on `Node` before it starts.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import zmq

from bus.security import read_secret_file
from discovery.interfaces import resolve_interface
from discovery.table import Timeouts
from nodes.backends.weights import CHOICES as WEIGHT_CHOICES
from nodes.cluster_args import add_cluster_arguments, cpu_list, peer_arg, positive_float
from nodes.json_lines import JsonLines, event_json
from nodes.logs import set_node_id
from nodes.node import ROLES, Node, NodeConfig
from nodes.node_args import config_from_args, pin_cpus
from nodes.telemetry import Telemetry

log = logging.getLogger(__name__)

DEFAULT_HTTP = "127.0.0.1:8000"  # a gateway's HTTP address: this machine only
SHUTDOWN_REPORT_S = 8.0  # a stop slower than this prints every thread's stack (stderr)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a specbus node until SIGINT/SIGTERM: it discovers its cluster (mDNS on the "
        "chosen interface, plus --peer seeds), gossips its capability card and heartbeats, "
        "serves its roles, and leaves cleanly. A verifier loads --model and serves "
        "generation requests, borrowing drafts from the cluster's proposers; a proposer serves "
        "draft sessions with its --drafter."
    )
    parser.add_argument("--role", required=True, type=parse_roles,
                        metavar="verifier|proposer|gateway|ROLE,ROLE|observer",
                        help="what this node does, roles combine with commas (gateway: "
                             "OpenAI-compatible HTTP API; observer: listens, never offered "
                             "work)")
    add_cluster_arguments(parser)
    parser.add_argument("--port", type=int, default=0,
                        help="fixed request port (gossip uses port + 1), handy as a --peer "
                             "seed for others (default: ephemeral ports)")
    parser.add_argument("--advertise", default=None, type=peer_arg, metavar="HOST:PORT",
                        help="request endpoint other nodes are told to use when it differs "
                             "from the bound one (NAT, containers, a proxy in between)")
    parser.add_argument("--cpus", default=None, type=cpu_list, metavar="LIST",
                        help="pin this node's process to these CPU cores (e.g. 0 or 1,2 or "
                             "0-3); torch threads default to their count")
    parser.add_argument("--name", default=None,
                        help="display name; a named node keeps its id across restarts")
    parser.add_argument("--model", default="",
                        help="model the verifier runs (and int8 quantizes): alias, folder or "
                             "cached HF repo id (default: the embedded smollm2-135m)")
    parser.add_argument("--drafter", default="",
                        help="ngram | suffix[:OPTS] | int8 | eagle[:PATH] | model:REF | none; "
                             "a proposer's drafter (default suffix; an eagle head is served to "
                             "torch verifiers of its model, which send it their hidden "
                             "states), or a verifier's own fallback (default none)")
    parser.add_argument("--suffix-budget", type=positive_float, default=None, metavar="MB",
                        help="memory for the suffix drafter's index of earlier outputs (default "
                             "64; the same as --drafter suffix:budget=MB)")
    parser.add_argument("--backend", default=None, choices=("torch", "mlx"),
                        help="torch (default) or mlx")
    parser.add_argument("--weights", default=None, choices=WEIGHT_CHOICES,
                        help="a torch verifier's weights: auto (default, or $SPECBUS_WEIGHTS: a "
                             "GGUF model's own blocks on a CPU where the quantized forward "
                             "serves it, the embedded model's included; fp32 otherwise), fp32 "
                             "(the reference mode, identical to Hugging Face generate), q8 / q4 "
                             "(Q8_0 / Q4_1 "
                             "blocks quantized at load; the embedded model's q4 is its shipped "
                             "Q4_1 file as it is) or file (a --model FILE.gguf's own blocks); "
                             "speculation stays bit-identical to the same weights' plain decoding")
    parser.add_argument("--max-draft", type=int, default=16,
                        help="longest draft block a verifier asks for (default 16)")
    parser.add_argument("--kv-sink", type=int, default=None, metavar="S",
                        help="a verifier's bounded K/V (torch or MLX): every full-attention layer "
                             "attends to the first S positions and the last --kv-window W, "
                             "and keeps only those (memory constant past S + W); both or "
                             "neither; speculation identical to plain decoding under the bound")
    parser.add_argument("--kv-window", type=int, default=None, metavar="W",
                        help="the bounded K/V's window of recent positions (with --kv-sink)")
    parser.add_argument("--tree-width", type=_tree_width, default=None, metavar="N",
                        help="proposer: candidates per drafted position sent to verifiers, "
                             "the chain's token and up to N-1 alternatives (default: the "
                             "drafter's own, 3 for model drafters, 4 for suffix, 1 for ngram; 1: "
                             "chains only)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads for this node's models (default: torch's choice; "
                             "use 1 when several model nodes share a machine's cores)")
    parser.add_argument("--max-context", type=int, default=0, metavar="N",
                        help="longest context served: a verifier's prompt + max tokens, a "
                             "proposer's draft session (default: the model's context; 8192 "
                             "for model-free drafters)")
    parser.add_argument("--max-batch", type=int, default=8, metavar="N",
                        help="verifier: generations stepped together, one forward per step "
                             "(default 8; 1: one at a time; docs/engine.md, Batching)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="verifier: run a batch one sequence at a time, so every output "
                             "is bit for bit its solo output (costs the batching gain)")
    parser.add_argument("--prefill-chunk", type=int, default=0, metavar="N",
                        help="verifier: prefill prompts longer than N positions in chunks of "
                             "N, one chunk per batch step, so a long prompt does not stall "
                             "the running generations (default 0: whole)")
    parser.add_argument("--prefix-cache-mb", type=int, default=None, metavar="MB",
                        help="verifier: MiB of finished generations' K/V kept so that a prompt "
                             "starting the same way (a conversation's next turn, a shared "
                             "system prompt) prefills only the rest (default 256; 0: off; "
                             "docs/engine.md, Prefix reuse)")
    parser.add_argument("--session-lease", type=positive_float, default=30.0,
                        help="seconds a proposer keeps a verifier's idle draft session "
                             "(a verifier sets it on the sessions it opens; default 30)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where node ids and incarnation counters live "
                             "(default: $SPECBUS_STATE_DIR or ~/.cache/specbus)")
    parser.add_argument("--heartbeat", type=positive_float, default=Timeouts.heartbeat,
                        help="heartbeat interval in seconds (default: %(default)s)")
    parser.add_argument("--suspect-after", type=positive_float, default=Timeouts.suspect_after,
                        help="silence before a member is suspect (default: %(default)s)")
    parser.add_argument("--dead-after", type=positive_float, default=Timeouts.dead_after,
                        help="silence before a member is dead (default: %(default)s)")
    parser.add_argument("--forget-after", type=positive_float, default=Timeouts.forget_after,
                        help="seconds a dead or departed member is remembered (and its gossip "
                             "connection kept, to hear it come back) (default: %(default)s)")
    parser.add_argument("--http", default=None, metavar="HOST:PORT",
                        help=f"where a gateway serves HTTP (default {DEFAULT_HTTP}, this "
                             "machine only; another address only when given here; port 0: "
                             "any free port)")
    parser.add_argument("--gateway-max-inflight", type=int, default=None, metavar="N",
                        help="requests a gateway keeps in flight per verifier (running + "
                             "queued there; default: what the verifier admits per connection, "
                             "its --max-batch + 8); more wait in the gateway's queue")
    parser.add_argument("--gateway-queue", type=int, default=64, metavar="N",
                        help="requests a gateway holds waiting for a verifier slot, first come "
                             "first served, before it answers 429 (default 64; 0: 429 at once "
                             "when every verifier is full)")
    parser.add_argument("--gateway-queue-wait", type=positive_float, default=60.0,
                        metavar="SECONDS",
                        help="the longest a request waits in the gateway's queue before its "
                             "429 (default 60)")
    parser.add_argument("--gateway-stall", type=positive_float, default=15.0,
                        metavar="SECONDS",
                        help="a streaming verifier silent this long is taken for stalled and "
                             "the generation resumes elsewhere (default 15)")
    parser.add_argument("--served-name", default=None, metavar="NAME",
                        help="the model's name for clients (card, /v1/models, members); "
                             "default: the alias or repo id, or a local folder's own name")
    share = parser.add_mutually_exclusive_group()
    share.add_argument("--share-prompts", action="store_true",
                       help="a verifier publishes its prompts too, not only its outputs, to "
                            "the cluster's suffix drafters (docs/security.md)")
    share.add_argument("--no-share", action="store_true",
                       help="a verifier publishes nothing to the cluster's suffix drafters")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="let browser pages from ORIGIN (e.g. http://ui.example:3000; * for "
                             "any) call the gateway; repeatable (default: on a loopback gateway, "
                             "pages of this machine, http://localhost:* and http://127.0.0.1:*; "
                             "otherwise none)")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="a name clients may send as the HTTP Host besides the addresses the "
                             "gateway serves (its IP, localhost on loopback, this machine's "
                             "names on a network address), e.g. a proxy's; repeatable; * turns "
                             "the check off (docs/security.md, DNS rebinding)")
    parser.add_argument("--gateway-no-tokenizer", action="store_true",
                        help="never tokenize in the gateway: send text/messages to verifiers "
                             "(no exact failover)")
    shard = parser.add_argument_group("sharded verifier (docs/sharding.md)")
    shard.add_argument("--shards", type=int, default=0, metavar="N",
                       help="run this verifier as one of N pipeline stages on N processes; "
                            "start the same command on each host")
    shard.add_argument("--shard-group", default="", metavar="NAME",
                       help="the shard group these processes form (found through membership)")
    shard.add_argument("--shard-timeout", type=positive_float, default=10.0, metavar="SECONDS",
                       help="longest wait on a stage before the group is taken for broken "
                            "(default 10)")
    parser.add_argument("--print-events", action="store_true",
                        help="print one JSON line per membership event on stdout "
                             "(for scripts, tests and benchmarks)")


def _with_suffix_budget(drafter: str, budget_mb: float | None) -> str:
    """`--suffix-budget MB` as the suffix drafter's own option (the roles take a drafter spec,
    so the budget travels inside it); refused with any other drafter."""
    if budget_mb is None:
        return drafter
    if drafter != "suffix" and not drafter.startswith("suffix:"):
        raise SystemExit("specbus node: --suffix-budget needs --drafter suffix")
    return f"{drafter}{',' if ':' in drafter else ':'}budget={budget_mb:g}"


def _tree_width(text: str) -> int:
    """argparse type for `--tree-width`: 1..16 candidates per drafted position."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= v <= 16:
        raise argparse.ArgumentTypeError(f"expected 1..16 candidates per position, got {v}")
    return v


def parse_roles(text: str) -> tuple[str, ...]:
    roles = tuple(r.strip() for r in text.split(",") if r.strip())
    if roles == ("observer",):
        return roles
    bad = [r for r in roles if r not in ROLES]
    if not roles or bad:
        raise argparse.ArgumentTypeError(
            f"unknown role {', '.join(bad) or text!r}: use verifier, proposer, "
            "gateway, a comma-separated combination, or observer")
    return tuple(dict.fromkeys(roles))


def _make_gateway(args: argparse.Namespace, config: NodeConfig):
    """Bind the gateway's HTTP socket before the node joins (its URL goes on the card)."""
    if "gateway" not in config.roles:
        if args.http is not None:
            raise ValueError("--http needs the gateway role (--role gateway or ROLE,gateway)")
        if args.cors_origin:
            raise ValueError("--cors-origin needs the gateway role")
        if args.allow_host:
            raise ValueError("--allow-host needs the gateway role")
        return None
    from nodes.gateway.role import GatewayRole, parse_http

    if args.gateway_max_inflight is not None and args.gateway_max_inflight < 1:
        raise ValueError(f"--gateway-max-inflight must be >= 1, got {args.gateway_max_inflight}")
    if args.gateway_queue < 0:
        raise ValueError(f"--gateway-queue must be >= 0, got {args.gateway_queue}")
    host, port = parse_http(args.http or DEFAULT_HTTP)
    try:
        gateway = GatewayRole(host, port, max_inflight=args.gateway_max_inflight,
                              stall_s=args.gateway_stall, tokenize=not args.gateway_no_tokenizer,
                              cors_origins=tuple(args.cors_origin), queue=args.gateway_queue,
                              queue_wait_s=args.gateway_queue_wait,
                              allow_hosts=tuple(args.allow_host))
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port} for HTTP: {exc}") from None
    extras = {**(config.card_fields.get("extras") or {}), **gateway.card_extras}
    config.card_fields = {**config.card_fields, "extras": extras}
    return gateway


def run(args: argparse.Namespace) -> int:
    if args.shards or args.shard_group:
        from nodes.shard.node_run import run_sharded

        return run_sharded(args)
    try:
        pin_cpus(args)
        config = config_from_args(args)
        if config.secret_file:  # refuse a bad secret before spending seconds on models
            read_secret_file(config.secret_file)
        _check_addresses(config)  # and a bad --interface or a taken --port too
        gateway = _make_gateway(args, config)
        roles = _assemble_roles(args, config)
        node = Node(config)
    except ValueError as exc:  # includes GenerationError: unknown model, drafter, mismatch
        print(f"specbus node: {exc}", file=sys.stderr)
        return 2
    if roles is not None:
        roles.attach(node)  # handlers are in place before the node can receive a request
    if gateway is not None:
        gateway.attach(node)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    printer = JsonLines() if args.print_events else None
    try:
        node.start(on_event=(lambda ev: printer(event_json(ev))) if printer else None)
    except (ValueError, OSError, zmq.ZMQError) as exc:
        print(f"specbus node: cannot start: {exc}", file=sys.stderr)
        node.stop(leave=False)
        if gateway is not None:
            gateway.close()
        return 1
    if gateway is not None:
        try:
            gateway.start()
        except OSError as exc:
            print(f"specbus node: {exc}", file=sys.stderr)
            node.stop(leave=True)
            return 1
        print(f"specbus gateway: OpenAI-compatible API on {gateway.url}/v1", file=sys.stderr)
    for handler in logging.getLogger().handlers:
        set_node_id(handler, node.node_id)
    if roles is not None:
        roles.start()
    card = node.membership.card
    print(f"specbus node {node.node_id}{f' ({card.name})' if card.name else ''} in cluster "
          f"{card.cluster!r}: requests {card.endpoints['stream']}, gossip "
          f"{card.endpoints['gossip']}, incarnation {card.incarnation}", file=sys.stderr)
    if printer is not None:
        printer({"event": "ready", "node_id": node.node_id, "name": card.name,
                 "incarnation": card.incarnation, "endpoints": card.endpoints,
                 **({"http": gateway.url} if gateway is not None else {}),
                 "t": time.monotonic()})
    providers = [node.security_stats, *([roles.telemetry] if roles else [])]
    if gateway is not None:
        providers.append(gateway.telemetry)
    telemetry = Telemetry(node, providers=providers)
    telemetry.start()
    try:
        while not stop.wait(0.2):
            pass
    finally:
        # Diagnosis, not a cure: if leaving and closing (interpreter exit included) has not
        # finished in SHUTDOWN_REPORT_S, every thread's stack goes to stderr.
        faulthandler.dump_traceback_later(SHUTDOWN_REPORT_S, exit=False)
        telemetry.stop()
        if gateway is not None:
            gateway.close()
        node.stop(leave=True)
        if roles is not None:
            roles.close()
        if printer is not None:
            g = node.gossip
            printer({"event": "exit", "node_id": node.node_id, "bytes_out": g.bytes_out,
                     "bytes_in": g.bytes_in, "published": g.published, "received": g.received,
                     "dropped": g.dropped, **node.membership.counters, "t": time.monotonic()})
    return 0


def _check_addresses(config: NodeConfig) -> None:
    """Refuse a bad `--interface` or a taken `--port` (and the gossip port after it) at once,
    not after loading a model for half a minute. The ports are bound and released here; the
    node binds them again when it starts. The probe binds as ZeroMQ's own listener does, with
    SO_REUSEADDR: a port some process listens on is refused, one whose last connections sit in
    TIME-WAIT (a node SIGKILLed a moment ago) is not, since the real bind succeeds there."""
    host = resolve_interface(config.interface).bind_host
    if not config.port:
        return
    for port in (config.port, config.port + 1):
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot use port {port} on {host} ({exc.strerror}); the node "
                             f"needs --port and --port + 1") from None
        finally:
            probe.close()


def _assemble_roles(args: argparse.Namespace, config: NodeConfig):
    """Load what the roles need (models, drafters) and put what they measured on the card.

    Slow (model loading) and done before joining, so the first card is already complete. A
    proposer's drafter defaults to `suffix`; a verifier drafts nothing itself unless asked (it
    borrows the cluster's proposers).
    """
    if config.observer or not config.roles:
        return None
    from nodes.assemble import (
        DEFAULT_PREFIX_CACHE_MB,
        DEFAULT_PROPOSER_DRAFTER,
        RoleSpec,
        assemble,
        return_freed_memory,
    )

    default = DEFAULT_PROPOSER_DRAFTER if "proposer" in config.roles else "none"
    drafter = _with_suffix_budget(args.drafter or default, args.suffix_budget)
    from nodes.backends.kv_bound import check_kv_bound
    from nodes.backends.weights import default_weights

    check_kv_bound(args.kv_sink, args.kv_window)  # before any model loads
    spec = RoleSpec(roles=config.roles, model=args.model or None,
                    weights=args.weights or default_weights(
                        args.kv_sink is not None or args.kv_window is not None),
                    kv_sink=args.kv_sink, kv_window=args.kv_window,
                    backend=args.backend or "torch", drafter=drafter,
                    max_draft=args.max_draft, tree_width=args.tree_width,
                    lease_s=args.session_lease,
                    threads=args.threads,
                    max_context=args.max_context,
                    max_batch=args.max_batch, batch_invariant=args.batch_invariant,
                    prefill_chunk=args.prefill_chunk,
                    prefix_cache_mb=(DEFAULT_PREFIX_CACHE_MB if args.prefix_cache_mb is None
                                     else args.prefix_cache_mb),
                    share="off" if args.no_share else "prompts" if args.share_prompts
                    else "output", served_name=args.served_name or "")
    roles = assemble(spec)
    return_freed_memory()  # what loading and quantising freed (assemble's locals are gone)
    extras = {**(config.card_fields.get("extras") or {}), **(roles.card.get("extras") or {})}
    config.card_fields = {**config.card_fields, **roles.card, "extras": extras}
    if "proposer" in config.roles:
        config.drafter = spec.drafter
    return roles
