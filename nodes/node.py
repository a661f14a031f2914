"""The node process skeleton: I/O loop, gossip, request server, membership, mDNS.

Roles plug in by registering handlers: `register_request(type, fn)` for StreamServer
requests and `register_gossip(type, fn)` for gossip messages. Handlers run on the I/O thread
and must return quickly (long work goes to a worker thread that replies with
`request.reply()`). Membership registers its own message types the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bus.gossip import GossipChannel
from bus.loop import IOLoop
from bus.security import Security
from bus.sockets import SocketFactory
from bus.streams import Request, StreamClient, StreamServer, serve_ping
from codec.messages import Message
from discovery.cards import Card, check_cluster
from discovery.events import Subscriber
from discovery.identity import Identity, acquire_identity
from discovery.interfaces import DEFAULT_INTERFACE, NetChoice, resolve_interface
from discovery.mdns import Mdns
from discovery.membership import UPDATABLE, Membership
from discovery.table import Timeouts
from nodes.node_common.admission import RATE_LIMITED, AdmissionLimits, RateLimiter
from nodes.secret import security_for

log = logging.getLogger(__name__)

ROLES = ("verifier", "proposer", "gateway")


@dataclass
class NodeConfig:
    """Everything a node needs to start; the CLI builds one from its flags."""

    cluster: str = "specbus"
    roles: tuple[str, ...] = ()
    observer: bool = False
    interface: str = DEFAULT_INTERFACE
    peers: tuple[str, ...] = ()  # seeds: stream endpoints (tcp://HOST:PORT)
    port: int = 0  # request (ROUTER) port, gossip PUB on port + 1; 0: ephemeral ports
    advertise: str = ""  # request endpoint others are told to use (NAT, proxy); "" = bound one
    name: str | None = None
    backend: str = ""
    model: str = ""
    drafter: str = ""
    mdns: bool = True
    state_dir: Path | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    extras: dict[str, Any] = field(default_factory=dict)
    # initial card fields measured by the roles (tokenizer, vocab, tok_s, free_mem, ...);
    # they override backend/model above and their `extras` are merged
    card_fields: dict[str, Any] = field(default_factory=dict)
    secret_file: str | None = None  # cluster secret; None: $SPECBUS_SECRET_FILE, else none
    insecure: bool = False  # allow no secret off loopback
    security: Security | None = None  # already loaded keys (tools); wins over secret_file
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)


CARD_SETTABLE = UPDATABLE


def parse_peer(text: str) -> str:
    """`HOST:PORT` or `tcp://HOST:PORT` -> a stream endpoint; ValueError otherwise."""
    ep = text if text.startswith("tcp://") else f"tcp://{text}"
    host, sep, port = ep[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT (a node's request endpoint), got {text!r}")
    return ep


class Node:
    """One specbus process: owns the I/O loop and every socket through it."""

    def __init__(self, config: NodeConfig) -> None:
        check_cluster(config.cluster)
        for role in config.roles:
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
        if config.observer and config.roles:
            raise ValueError("an observer has no roles")
        if not (config.port == 0 or 0 < config.port < 65535):
            raise ValueError(f"--port must be 1..65534 (the gossip port is port + 1), "
                             f"got {config.port}")
        if config.advertise:
            config.advertise = parse_peer(config.advertise)
        bad = [k for k in config.card_fields if k not in CARD_SETTABLE]
        if bad:
            raise ValueError(f"card fields {bad} cannot be set (settable: {CARD_SETTABLE})")
        self.config = config
        self.net: NetChoice = resolve_interface(config.interface)
        self.identity: Identity | None = None
        self.security: Security | None = config.security or security_for(
            config.secret_file, config.insecure, self.net.bind_host,
            "observer" if config.observer else "node")
        self.insecure = self.security is None and config.insecure
        self.loop = IOLoop()
        self.factory = SocketFactory(security=self.security)
        self.rate = RateLimiter(config.admission)
        self._requests: dict[str, Callable[[Request], None]] = {}
        self._gossip_handlers: dict[str, Callable[[str, Message], None]] = {}
        self.gossip: GossipChannel | None = None
        self.server: StreamServer | None = None
        self.client: StreamClient | None = None
        self.membership: Membership | None = None
        self.mdns: Mdns | None = None
        self._stopped = False

    @property
    def node_id(self) -> str:
        return self.identity.node_id if self.identity else ""

    # -- extension points ---------------------------------------------------------------
    def register_request(self, type_: str, fn: Callable[[Request], None]) -> None:
        self._requests[type_] = fn

    def register_gossip(self, type_: str, fn: Callable[[str, Message], None]) -> None:
        self._gossip_handlers[type_] = fn

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, on_event: Subscriber | None = None) -> Node:
        """Join the cluster; `on_event` is subscribed before anything can happen."""
        cfg = self.config
        self.identity = acquire_identity(cfg.cluster, cfg.name, cfg.state_dir)
        self.loop.start()
        host, port = self.net.bind_host, cfg.port
        self.gossip = GossipChannel(self.loop, self.factory, self._on_gossip,
                                    bind_endpoint=f"tcp://{host}:{port + 1 if port else 0}")
        self.server = StreamServer(self.loop, self.factory, self._on_request,
                                   bind_endpoint=f"tcp://{host}:{port}", sender=self.node_id)
        self.client = StreamClient(self.loop, self.factory, sender=self.node_id)
        card = self._first_card()
        self.membership = Membership(self.loop, self.gossip, self.client, self.identity, card,
                                     cfg.timeouts, seeds=cfg.peers,
                                     extra_counters=self.security_counters)
        for t in ("card", "heartbeat", "leave"):
            self.register_gossip(t, self.membership.handle_gossip)
        self.register_request("snapshot_req", self.membership.handle_request)
        self.register_request("ping", serve_ping)
        if on_event is not None:
            self.membership.subscribe(on_event)
        self.membership.start()
        if cfg.mdns:
            self.mdns = Mdns(self.net, self.membership.on_mdns_peer)
            self.mdns.start(card)
        log.info("node %s up: gossip %s, requests %s, incarnation %d",
                 self.node_id, self.gossip.endpoint, self.server.endpoint,
                 self.identity.incarnation)
        return self

    def _first_card(self) -> Card:
        cfg = self.config
        extras = dict(cfg.extras)
        if self.insecure:
            extras["insecure"] = True
        if cfg.drafter:
            extras["drafter"] = cfg.drafter
        fields: dict[str, Any] = {"backend": cfg.backend, "model": cfg.model}
        fields.update({k: v for k, v in cfg.card_fields.items() if k != "extras"})
        extras.update(cfg.card_fields.get("extras") or {})
        card = Card(
            node_id=self.node_id, cluster=cfg.cluster, incarnation=self.identity.incarnation,
            version=1, roles=tuple(cfg.roles), name=cfg.name or "",
            endpoints={"gossip": self.gossip.endpoint,
                       "stream": cfg.advertise or self.server.endpoint},
            observer=cfg.observer, extras=extras, **fields,
        )
        return Card.from_map(card.to_map())  # same checks as a card from the wire

    def stop(self, leave: bool = True) -> None:
        """Announce the leave first (peers drop us at once), then close everything."""
        if self._stopped:
            return
        self._stopped = True
        if self.membership is not None and leave and self.loop.running:
            self.membership.leave()
            time.sleep(0.05)  # PUB sockets close with linger 0: let the leave go out first
        if self.mdns is not None:
            self.mdns.close()
        try:
            self.loop.stop()
        except OSError as exc:
            # Seen under heavy load before bus/loop.py closed its wake pipe under a lock
            # (EBADF from call_soon); kept so that shutdown always goes on.
            log.warning("I/O loop stop: %s", exc)
        if self.membership is not None:
            self.membership.close()
        self.factory.close()
        if self.identity is not None:
            self.identity.release()

    def security_counters(self) -> dict[str, int]:
        """Refusals of strangers and abusers: CURVE handshakes that failed (no key, wrong key)
        or were denied by ZAP (a client key outside the cluster), gossip with a
        wrong MAC (`forged`) or an old (epoch, seq) (`replayed`), requests over the rate."""
        g, gate = self.gossip, self.factory.gate
        watch = self.factory.handshakes
        return {"handshakes_failed": watch.failed if watch else 0,
                "handshakes_denied": gate.denied if gate else 0,
                "forged": g.forged if g else 0, "replayed": g.replayed if g else 0,
                "rate_limited": self.rate.refused}

    def security_stats(self) -> dict[str, Any]:
        """Telemetry provider: whether the bus is secured and what it refused."""
        return {"security": {"secure": self.security is not None, "insecure": self.insecure,
                             **self.security_counters()}}

    # -- I/O thread dispatch ------------------------------------------------------------
    def _on_gossip(self, topic: str, msg: Message) -> None:
        fn = self._gossip_handlers.get(msg.type)
        if fn is not None:
            fn(topic, msg)

    def _on_request(self, req: Request) -> None:
        if not self.rate.allow(req.peer):
            req.fail(RATE_LIMITED, "too many requests from this connection; slow down")
            return
        fn = self._requests.get(req.message.type)
        if fn is None:
            req.fail("unsupported", f"this node does not serve {req.message.type!r} requests")
            return
        fn(req)
