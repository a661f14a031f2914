"""The gateway role: an aiohttp server on its own asyncio thread, beside the node's I/O thread.

The listening socket is bound before the node joins (a taken port fails the start, and the
card can carry the URL); the server starts once the node is up. Telemetry from the cluster
(`stats` gossip, I/O thread) is handed to the asyncio thread with `call_soon_threadsafe`: the
balancer's and metrics' state has a single owner.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
from typing import Any

from aiohttp import web

from nodes.client_tokenizers import TokenizerCache
from nodes.cluster_client.choice import Balancer
from nodes.gateway.app import GatewayApp
from nodes.gateway.http_server import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    KEEPALIVE_S,
    MAX_CONNECTIONS,
    ConnectionCap,
)
from nodes.gateway.metrics import GatewayMetrics
from nodes.gateway.origins import Origins
from nodes.node_common.host import RoleHost

log = logging.getLogger(__name__)

QUEUE = 64  # requests waiting for a verifier slot (`--gateway-queue`)
QUEUE_WAIT_S = 60.0  # the longest one waits before its 429 (`--gateway-queue-wait`)
UNKNOWN_CAP = 8  # in flight per verifier whose card does not say what it admits


def parse_http(text: str) -> tuple[str, int]:
    """`HOST:PORT` (port 0: any free port) -> (host, port); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--http must be HOST:PORT, got {text!r}")
    if not 0 <= int(port) < 65536:
        raise ValueError(f"--http port {port} is out of range (0-65535; 0 picks a free one)")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise ValueError(f"--http host must be an IP address, got {host!r}") from None
        host = "127.0.0.1"
    return host, int(port)


class GatewayRole:
    def __init__(self, host: str = "127.0.0.1", port: int = 8000,
                 max_inflight: int | None = None, stall_s: float = 15.0, tokenize: bool = True,
                 cors_origins: tuple[str, ...] = (), queue: int = QUEUE,
                 queue_wait_s: float = QUEUE_WAIT_S, allow_hosts: tuple[str, ...] = (),
                 max_connections: int = MAX_CONNECTIONS,
                 header_timeout: float = HEADER_TIMEOUT_S,
                 body_timeout: float = BODY_TIMEOUT_S) -> None:
        self.origins = Origins(host, tuple(cors_origins), tuple(allow_hosts))
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError:
            self._sock.close()
            raise
        self._sock.listen(128)
        bound = self._sock.getsockname()
        self.url = f"http://{host if family == socket.AF_INET else f'[{host}]'}:{bound[1]}"
        # per verifier: what it admits per connection (its card; 8 when it does not say) or
        # less; beyond that requests wait in a bounded line, FIFO, then 429
        self.balancer = Balancer(max_inflight, queue=queue, queue_wait_s=queue_wait_s,
                                 unknown_cap=UNKNOWN_CAP)
        self.metrics = GatewayMetrics()
        self.tokenizers = TokenizerCache(enabled=tokenize)
        self.stall_s = stall_s
        self._node = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._http: asyncio.Server | None = None
        self.connections: ConnectionCap | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gateway-http", daemon=True)

    @property
    def card_extras(self) -> dict[str, Any]:
        return {"http": self.url}

    def attach(self, node: RoleHost) -> None:
        """Before the node starts: listen to the cluster's telemetry (loads, acceptance)."""
        from nodes.telemetry import stats_topic

        self._node = node
        node.register_gossip("stats", self._on_stats)
        self._stats_topic = stats_topic(node.config.cluster)

    def start(self) -> None:
        """After the node has joined: subscribe to telemetry and serve HTTP."""
        self._node.gossip.subscribe(self._stats_topic)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise OSError(f"gateway HTTP server did not start: {self._error}")
        log.info("gateway serving %s", self.url)

    def close(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        if self._thread.is_alive():
            self._thread.join(10)
        if self._loop is None:
            self._sock.close()

    def telemetry(self) -> dict[str, Any]:
        m = self.metrics
        return {"gateway": {"http": self.url, "inflight": sum(self.balancer.inflight.values()),
                            "queued": self.balancer.waiting,
                            "queue_refused": self.balancer.refused,
                            "requests": sum(m.requests.values()), "failovers": m.failovers,
                            "stats_refused": m.stats_refused,
                            "connections_refused": self.connections.refused
                            if self.connections is not None else 0,
                            "connections_displaced": self.connections.displaced
                            if self.connections is not None else 0,
                            "body_timeouts": m.body_timeouts,
                            "cancelled": m.cancelled, "completion_tokens": m.completion_tokens}}

    # -- gateway thread -----------------------------------------------------------------------
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            app = GatewayApp(self._node, self.balancer, self.metrics, self.tokenizers,
                             self.stall_s, self.origins, self.body_timeout).build()
            # on close, streams still open get a second to end, then their handlers are
            # cancelled (which cancels their verifier work)
            self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                         shutdown_timeout=1.0)
            loop.run_until_complete(self._runner.setup())
            self.connections = ConnectionCap(self._runner.server, self.max_connections,
                                             self.header_timeout, KEEPALIVE_S)
            self._http = loop.run_until_complete(
                loop.create_server(self.connections, sock=self._sock, backlog=128))
        except Exception as exc:  # noqa: BLE001 - reported to start() in the main thread
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            self._http.close()  # stop accepting, then let the runner end what is open
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

    # -- I/O thread ---------------------------------------------------------------------------
    def _on_stats(self, topic: str, msg) -> None:
        stats = msg.get("stats")
        loop = self._loop
        if isinstance(stats, dict) and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._take_stats, msg.sender, stats)

    def _take_stats(self, node_id: str, stats: dict) -> None:
        if self._node.membership.get(node_id) is None:  # not a member: nothing to keep
            self.metrics.stats_refused += 1
            return
        self.metrics.on_stats(node_id, stats)
        v = stats.get("verifier")
        if isinstance(v, dict):
            active, queued = v.get("active"), v.get("queued")
            if all(isinstance(x, int) and not isinstance(x, bool) for x in (active, queued)):
                self.balancer.report(node_id, active, queued)
