"""The one place that creates ZeroMQ sockets.

Every socket in specbus comes from `SocketFactory`, so linger, high-water marks, the maximum
message size, TCP keepalive and ZMTP heartbeats are set once, here. With a `Security` (the
cluster secret, `bus.security`) every server socket (ROUTER, PUB) is a CURVE server and every
client socket (DEALER, SUB) a CURVE client, and a ZAP authenticator on the factory's own context
admits only cluster members.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import threading
from dataclasses import dataclass

import zmq

from bus.security import ZAP_DOMAIN, ClusterGate, Security
from codec.messages import DEFAULT_LIMITS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SocketOptions:
    """Options applied to every socket the factory makes."""

    linger_ms: int = 0
    sndhwm: int = 1000
    # No receive high-water mark. In libzmq 4.3.5 (and its master as of 2026) an engine whose
    # input stopped at the receive HWM and whose peer then hangs up is marked `_io_error`, and
    # its next ZMTP heartbeat (or a PING read later) runs `out_event`, which asserts
    # `!_io_error` and aborts the process (src/stream_engine_base.cpp:310; libzmq #3937).
    # Any peer could reach that: flood a node faster than its I/O thread reads, then leave
    # (2,000 forged members killed gateways and verifiers so). Without a receive HWM input
    # never stops; what bounds memory instead is the I/O thread reading everything that is
    # ready and the application's own limits (rate per connection, chunks per session,
    # bounded tables), and a flooding proposer's connection is closed (remote_draft.py).
    # The gossip SUB alone sets one, with its own heartbeat off (bus/gossip.py: gossip_sub).
    rcvhwm: int = 0
    # a message may carry a header plus max_message_bytes of tensors
    max_msg_bytes: int = DEFAULT_LIMITS.max_message_bytes + DEFAULT_LIMITS.max_header_bytes
    tcp_keepalive_idle_s: int = 10
    tcp_keepalive_intvl_s: int = 5
    tcp_keepalive_cnt: int = 3
    zmtp_heartbeat_ms: int = 1000
    zmtp_heartbeat_timeout_ms: int = 3000
    # request streams (DEALER/ROUTER) tolerate a stalled peer this long: a SIGSTOP, GC pause
    # or VM hiccup keeps its TCP connection, and dropping it would lose the replies in flight
    # (membership, not ZMTP, decides that a peer is dead; see docs/nodes.md "Stalls")
    stream_heartbeat_timeout_ms: int = 30000
    reconnect_ms: int = 100
    reconnect_max_ms: int = 2000


_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def close_socket(sock: zmq.Socket) -> None:
    """Close at once (linger 0), stopping the socket's monitor first, if it has one.

    libzmq sends monitor events with a blocking send under the socket's monitor lock. A socket
    still monitored once the PAIR reading its events is gone (closed by its owner, or by a
    stopped `HandshakeWatch`) blocks libzmq's I/O thread at its next event, for good; a closed
    socket lives on in libzmq's reaper for a moment and can still report. A monitor stopped
    before the close reports nothing more.
    """
    if sock.closed:
        return
    try:
        sock.monitor(None, 0)  # no monitor: nothing to stop
    except zmq.ZMQError as exc:  # the context is terminating: nothing is sent any more
        log.debug("stopping a monitor before close: %s", exc)
    sock.close(linger=0)


class HandshakeWatch:
    """Counts failed CURVE handshakes on server sockets (strangers without the key, or with a
    wrong one, never reach ZAP: the server cannot even read their HELLO).

    Each watched socket reports to an inproc monitor PAIR that this watch's own thread
    creates, polls and closes; the socket's owner only calls `zmq_socket_monitor`.
    """

    def __init__(self, context: zmq.Context) -> None:
        self.context = context
        self._names = itertools.count()
        self._pending: list[str] = []
        self._lock = threading.Lock()  # guards _pending and the counter
        self._failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specbus-handshakes",
                                        daemon=True)
        self._thread.start()

    @property
    def failed(self) -> int:
        with self._lock:
            return self._failed

    def watch(self, sock: zmq.Socket) -> None:
        addr = f"inproc://specbus-handshake-{id(self):x}-{next(self._names)}"
        sock.monitor(addr, _FAILED)
        with self._lock:
            self._pending.append(addr)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def _run(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        poller, pairs = zmq.Poller(), []
        try:
            while not self._stop.is_set():
                with self._lock:
                    fresh, self._pending = self._pending, []
                for addr in fresh:
                    pair = self.context.socket(zmq.PAIR)
                    pair.setsockopt(zmq.LINGER, 0)
                    pair.connect(addr)
                    poller.register(pair, zmq.POLLIN)
                    pairs.append(pair)
                for pair, _ in poller.poll(100):
                    try:
                        event = recv_monitor_message(pair, zmq.NOBLOCK)
                    except (zmq.ZMQError, ValueError):
                        continue
                    if event["event"] & _FAILED:
                        with self._lock:
                            self._failed += 1
                        log.info("refused a connection: CURVE handshake failed (%s)",
                                 event["event"])
        except zmq.ContextTerminated:
            pass
        finally:
            for pair in pairs:
                pair.close(linger=0)


class SocketFactory:
    """Creates configured sockets on one shared context.

    Sockets are not thread-safe: whoever asks the factory for a socket owns it, and in specbus
    that is the I/O thread (see `bus.loop.IOLoop`), except the DEALERs of a
    `bus.direct.DirectClient` (owned by the thread that made the client), benchmarks and tests.
    """

    def __init__(self, context: zmq.Context | None = None, options: SocketOptions | None = None,
                 security: Security | None = None):
        self.options = options or SocketOptions()
        self.security = security
        self.gate: ClusterGate | None = None
        self.handshakes: HandshakeWatch | None = None
        self._auth = None
        self._own_context = security is not None and context is None
        if security is None:
            self.context = context or zmq.Context.instance()
            return
        # A ZAP handler serves one context: a secured factory gets its own, so two nodes in
        # one process (tests, tools) never share or fight over an authenticator.
        from zmq.auth.thread import ThreadAuthenticator

        self.context = context or zmq.Context()
        self.gate = ClusterGate(security)
        self._auth = ThreadAuthenticator(self.context, log=logging.getLogger("bus.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self.gate)
        self.handshakes = HandshakeWatch(self.context)

    @property
    def secure(self) -> bool:
        return self.security is not None

    def close(self) -> None:
        """Stop the authenticator and end a context this factory made (after its sockets
        are closed: call once the I/O loop has stopped)."""
        if self.handshakes is not None:
            self.handshakes.close()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_context:
            self.context.destroy(linger=0)
            self._own_context = False

    def socket(self, kind: int) -> zmq.Socket:
        o = self.options
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, o.linger_ms)
        sock.setsockopt(zmq.SNDHWM, o.sndhwm)
        sock.setsockopt(zmq.RCVHWM, o.rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, o.max_msg_bytes)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, o.tcp_keepalive_idle_s)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, o.tcp_keepalive_intvl_s)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, o.tcp_keepalive_cnt)
        sock.setsockopt(zmq.HEARTBEAT_IVL, o.zmtp_heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, o.zmtp_heartbeat_timeout_ms)
        sock.setsockopt(zmq.RECONNECT_IVL, o.reconnect_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, o.reconnect_max_ms)
        return sock

    def _server(self, sock: zmq.Socket) -> zmq.Socket:
        if self.security is not None:
            self.security.apply_server(sock)
            self.handshakes.watch(sock)
        return sock

    def _client(self, sock: zmq.Socket) -> zmq.Socket:
        if self.security is not None:
            self.security.apply_client(sock)
        return sock

    def pub(self) -> zmq.Socket:
        return self._server(self.socket(zmq.PUB))

    def sub(self) -> zmq.Socket:
        return self._client(self.socket(zmq.SUB))

    def router(self) -> zmq.Socket:
        sock = self.socket(zmq.ROUTER)
        # replies to vanished peers are dropped, never raised into the I/O loop
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # a DEALER that reconnects (same ROUTING_ID) takes its identity over, so replies
        # to a request sent before the reconnect still reach it
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.options.stream_heartbeat_timeout_ms)
        return self._server(sock)

    def dealer(self) -> zmq.Socket:
        # No IMMEDIATE: connect is asynchronous and the first request to a new peer must queue
        # until the handshake completes. Requests to dead peers are bounded by their deadlines,
        # and discovery closes the DEALER of a peer it declares dead.
        sock = self.socket(zmq.DEALER)
        # a stable, unique routing id (never starting with 0, which libzmq reserves): after a
        # reconnect the server still routes replies of earlier requests to this socket
        sock.setsockopt(zmq.ROUTING_ID, b"\x01" + os.urandom(15))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.options.stream_heartbeat_timeout_ms)
        return self._client(sock)


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the concrete endpoint (port 0 or `*` picks a free port).

    Only explicit addresses are accepted: binding to all interfaces must be asked for by name
    (the product binds to 127.0.0.1 unless the user passes --interface).
    """
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        check_bind_host(host)
        if port in ("0", ""):
            endpoint = f"tcp://{host}:*"
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def check_bind_host(host: str) -> None:
    """Refuse wildcard or malformed bind hosts: specbus never binds all interfaces implicitly."""
    if host in ("*", "", "0.0.0.0", "[::]", "::"):
        raise ValueError(
            f"refusing to bind to all interfaces ({host or 'empty'!r}); pass a concrete address"
        )
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError as exc:
        raise ValueError(f"bind host must be an IP address, got {host!r}") from exc
