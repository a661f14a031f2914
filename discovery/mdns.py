"""mDNS announce and browse with python-zeroconf (`_specbus._tcp.local.`).

Every node registers one service whose TXT records carry the cluster, node id, protocol
version and both endpoints, and browses for the others. Zeroconf runs on its own threads; we
hand each resolved peer to a callback and never touch ZeroMQ sockets from here. Zeroconf is
bound to the chosen interface only (loopback by default, where Linux delivers multicast
between processes once IP_MULTICAST_IF is 127.0.0.1, which zeroconf sets). If mDNS cannot
start, the node carries on with seeds and gossip.

All our questions are QM (multicast answers). Zeroconf asks its first question QU by default,
and a unicast answer to port 5353 reaches only one of the sockets sharing that port with
SO_REUSEPORT: with several nodes on one host (loopback, tests, benchmarks) the asker would
often never see it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from zeroconf import (
    DNSQuestionType,
    InterfaceChoice,
    IPVersion,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
)

from codec.schema import PROTOCOL_VERSION
from discovery.cards import Card, CardError, check_cluster, check_endpoint, check_node_id
from discovery.daemon_workers import DaemonWorkers
from discovery.interfaces import NetChoice
from discovery.limits import MAX_PROTO, parse_decimal

log = logging.getLogger(__name__)

SERVICE_TYPE = "_specbus._tcp.local."
RESOLVE_ATTEMPTS = 3
SELF_CHECK_S = 5.0


@dataclass(frozen=True)
class PeerAd:
    """What a peer announces over mDNS."""

    node_id: str
    cluster: str
    proto: int
    gossip: str
    stream: str


def txt_properties(card: Card) -> dict[str, str]:
    return {
        "cluster": card.cluster,
        "node": card.node_id,
        "proto": str(PROTOCOL_VERSION),
        "gossip": card.endpoints["gossip"],
        "stream": card.endpoints["stream"],
    }


def parse_properties(props: dict) -> PeerAd:
    """TXT records -> PeerAd; raises CardError for anything missing or malformed."""
    def text(key: str) -> str:
        raw = props.get(key.encode())
        if not isinstance(raw, bytes):
            raise CardError(f"mDNS TXT record has no {key!r}")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CardError(f"mDNS TXT {key!r} is not UTF-8") from None

    cluster, node_id = text("cluster"), text("node")
    check_cluster(cluster)
    check_node_id(node_id)
    proto = parse_decimal(text("proto"), MAX_PROTO)
    if proto is None:
        raise CardError(f"mDNS TXT proto must be an integer in [0, {MAX_PROTO}], got "
                        f"{text('proto')!r}"[:200])
    gossip, stream = text("gossip"), text("stream")
    if not (check_endpoint(gossip) and check_endpoint(stream)):
        raise CardError(f"mDNS TXT endpoints are malformed: {gossip!r} {stream!r}"[:200])
    return PeerAd(node_id, cluster, proto, gossip, stream)


class Mdns:
    """Announce our card's endpoints and report peers of any cluster to `on_peer`."""

    def __init__(self, net: NetChoice, on_peer: Callable[[PeerAd], None]) -> None:
        self.net = net
        self._on_peer = on_peer
        self._zc: Zeroconf | None = None
        self._browser: ServiceBrowser | None = None
        self._info: ServiceInfo | None = None
        self._pool = DaemonWorkers(2, "specbus-mdns")  # never holds the process exit
        self._closed = False
        self._count_lock = threading.Lock()  # resolver pool threads count concurrently
        self.seen = 0
        self.malformed = 0
        self.self_seen = threading.Event()

    def start(self, card: Card) -> bool:
        """Start announcing and browsing; False (logged) if mDNS is unavailable here."""
        interfaces = InterfaceChoice.All if self.net.mdns is None else list(self.net.mdns)
        try:
            self._zc = Zeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
        except OSError as exc:
            log.warning("mDNS unavailable (%s); discovery continues through seeds and gossip",
                        exc)
            return False
        host, port = card.endpoints["stream"][len("tcp://"):].rsplit(":", 1)
        self._info = ServiceInfo(
            SERVICE_TYPE,
            f"{card.node_id}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(host)],
            port=int(port),
            properties=txt_properties(card),
            server=f"specbus-{card.node_id}.local.",
        )
        self._pool.submit(self._register)
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._on_change],
                                       question_type=DNSQuestionType.QM)
        return True

    def _register(self) -> None:
        try:
            # node ids are unique, so probing for name conflicts would only add ~1 s
            self._zc.register_service(self._info, cooperating_responders=True)
        except Exception as exc:  # noqa: BLE001 - zeroconf raises many kinds; keep running
            log.warning("mDNS registration failed: %s", exc)
            return
        # Self-check: our browser should hear our own announcement (IP_MULTICAST_LOOP). If it
        # does not, multicast is not delivered on this interface; say so, once.
        deadline = time.monotonic() + SELF_CHECK_S
        while not self.self_seen.wait(0.1):
            if self._closed:
                return  # never hold up shutdown
            if time.monotonic() > deadline:
                where = "every interface" if self.net.mdns is None else ", ".join(self.net.mdns)
                log.warning("mDNS on %s: our own announcement never came back within %.0fs; "
                            "multicast may not work here, use --peer seeds", where, SELF_CHECK_S)
                return

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str,
                   state_change: ServiceStateChange) -> None:
        if self._info is not None and name == self._info.name:
            self.self_seen.set()  # our own multicast came back: mDNS works on this interface
            return
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            if not self._closed:
                self._pool.submit(self._resolve, name)  # refused (False) once closing

    def _resolve(self, name: str) -> None:
        info = None
        for _ in range(RESOLVE_ATTEMPTS):
            if self._closed or self._zc is None:
                return
            try:
                info = self._zc.get_service_info(SERVICE_TYPE, name, timeout=1500,
                                                 question_type=DNSQuestionType.QM)
            except Exception as exc:  # noqa: BLE001 - zeroconf internals; one peer, not the node
                log.debug("mDNS lookup of %s failed: %s", name, exc)
            if info is not None:
                break
        if info is None:
            log.debug("mDNS service %s did not resolve", name)
            return
        try:
            ad = parse_properties(info.properties or {})
        except CardError as exc:
            with self._count_lock:
                self.malformed += 1
            log.debug("ignoring mDNS service %s: %s", name, exc)
            return
        with self._count_lock:
            self.seen += 1
        self._on_peer(ad)

    def close(self) -> None:
        """Unregister (peers' caches drop us) and stop zeroconf's threads."""
        self._closed = True
        self._pool.close()
        if self._zc is None:
            return
        try:
            if self._browser is not None:
                self._browser.cancel()
            self._zc.close()  # sends goodbyes for registered services
        except Exception as exc:  # noqa: BLE001 - best effort at shutdown
            log.debug("mDNS close: %s", exc)
        self._zc = None
