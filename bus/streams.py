"""Request streams over DEALER/ROUTER: request ids, deadlines, cancellation, streamed replies.

A client sends `[header] [tensor]...` on a DEALER (one per peer endpoint); the server's ROUTER
sees `[peer id] [header] [tensor]...` and answers with the same request id (`rid`). A reply
with `more=True` is followed by others; the last one has `more=False`. The client may send a
`cancel` with the same rid. Everything socket-related runs on the I/O thread; `Call` and
`Request` hand results across threads.

Liveness: a client's `close()` cancels what it still has in flight. A client watches each
DEALER's connection (a ZMQ socket monitor) so callers can tell a peer whose connection is gone
(SIGKILL: the kernel closes it at once) from one that is merely stalled (SIGSTOP keeps it). A
server can probe whether a peer's connection still exists (`peer_connected`): routing ids are
stable per DEALER (bus/sockets.py), so that answer is exact.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from bus.calls import (
    BusError,
    CallTable,
    PeerUnavailable,
    RemoteError,
    Replies,
    RequestCancelled,
    RequestTimeout,
    streams,
    unwrap,
)
from bus.dealer import send_cancel, send_request
from bus.loop import IOLoop, Timer, frames_ready, send_frames
from bus.sockets import SocketFactory, bind
from codec.errors import CodecError
from codec.messages import DEFAULT_LIMITS, Limits, Message, decode, decode_header, encode
from codec.structs import ErrorReply, Pong

log = logging.getLogger(__name__)


# -- client side ---------------------------------------------------------------------------

_END = object()
_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
CANCEL_LINGER_MS = 500  # how long a closed client still tries to deliver its cancels
PROBE_RID = 0  # request ids start at 1: a reply with rid 0 is a server's liveness probe


def _link_address() -> str:
    """A fresh inproc address for a DEALER's connection monitor."""
    return f"inproc://specbus-link-{os.urandom(8).hex()}"


class Call(Replies):
    """One request in flight. Read replies with `next()`, `replies()` or `result()`."""

    def __init__(self, client: StreamClient, endpoint: str, rid: int,
                 on_reply: Callable[[Call, Message | BusError], None] | None) -> None:
        self.client = client
        self.endpoint = endpoint
        self.rid = rid
        self._on_reply = on_reply
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.timer: Timer | None = None
        self.done = False  # set on the I/O thread once the final reply or failure is in
        self.streaming = False  # set on the I/O thread once a first (non-final) reply is in

    def _deliver(self, item: Message | BusError) -> None:
        if self._on_reply is not None:
            self._on_reply(self, item)
        else:
            self._queue.put(item)

    def next(self, timeout: float | None = None) -> Message:
        """The next reply; raises BusError (RemoteError for an `error` reply)."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise RequestTimeout(f"no reply to request {self.rid} within {timeout}s") from None
        return unwrap(item)

    def cancel(self) -> None:
        """Stop waiting, and tell the server (thread-safe)."""
        self.client.cancel(self)


class StreamClient:
    """Sends requests to any number of peers; one DEALER per peer endpoint, owned by the loop."""

    def __init__(self, loop: IOLoop, factory: SocketFactory, sender: str = "",
                 limits: Limits = DEFAULT_LIMITS) -> None:
        self.loop = loop
        self.factory = factory
        self.sender = sender
        self.limits = limits
        self._rid_lock = threading.Lock()
        self._dealers: dict[str, zmq.Socket] = {}
        self._monitors: dict[str, zmq.Socket] = {}  # endpoint -> its DEALER's monitor (PAIR)
        #: endpoints whose connection is up now: an immutable set the loop thread replaces
        self._up: frozenset[str] = frozenset()
        #: request ids and the calls in flight (the I/O thread's; ids drawn under the lock)
        self._calls = CallTable()
        self._closed = False
        loop.on_close(self._close_dealers)  # monitors are stopped before their sockets close
        self.sent = 0
        self.late = 0  # replies after the deadline, after cancel, or for unknown ids
        self.dropped = 0  # malformed replies

    def request(self, endpoint: str, msg: Message, timeout: float | None = None,
                on_reply: Callable[[Call, Message | BusError], None] | None = None) -> Call:
        """Send `msg` to the ROUTER at `endpoint`; thread-safe.

        With `on_reply`, replies are handed to that callback on the I/O thread instead of
        being queued for `Call.next()`.
        """
        with self._rid_lock:
            rid = self._calls.next_rid()
        msg.rid = rid
        if not msg.sender:
            msg.sender = self.sender
        frames = encode(msg, self.limits)
        call = Call(self, endpoint, rid, on_reply)
        if self.loop.in_loop():  # already the socket's owner: send now, no hand-off
            self._start(call, frames, timeout)
        else:
            self.loop.call_soon(lambda: self._start(call, frames, timeout))
        return call

    def cancel(self, call: Call) -> None:
        self.loop.call_soon(lambda: self._cancel(call))

    def forget(self, endpoint: str) -> None:
        """Close the connection to a dead peer and fail its pending calls at once.

        Except calls that are mid-stream (they had a reply) on a connection that is up: the
        peer is there, merely silent (stopped, paused), and their later replies will come on
        that connection, which then stays open.
        """
        self.loop.call_soon(lambda: self._forget(endpoint))

    def release(self, endpoint: str) -> None:
        """Close the connection to `endpoint` if no call is in flight on it (thread-safe); the
        next request reconnects. Connections are made lazily and let go when unused."""
        self.loop.call_soon(lambda: self._release(endpoint))

    def connected(self, endpoint: str) -> bool:
        """Whether the connection to `endpoint` is up now (thread-safe; False before the
        first handshake, after a disconnect, and for endpoints never used)."""
        return endpoint in self._up

    def close(self, timeout: float = 2.0) -> None:
        """Cancel every call still in flight (the servers drop that work), then close the
        connections. Thread-safe; later requests fail with PeerUnavailable."""
        if self.loop.in_loop():
            self._close()
        elif self.loop.running:
            try:
                self.loop.run_sync(self._close, timeout)
            except (TimeoutError, RuntimeError) as exc:
                log.warning("stream client close: %s", exc)

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    # -- loop thread ------------------------------------------------------------------------
    def _dealer(self, endpoint: str) -> zmq.Socket:
        sock = self._dealers.get(endpoint)
        if sock is None:
            sock = self.factory.dealer()
            # before connect, so no event is missed; a unique address (pyzmq's default is
            # derived from the fd, which a later socket may reuse before this one is gone)
            mon = sock.get_monitor_socket(_LINK_EVENTS, _link_address())
            sock.connect(endpoint)
            self._dealers[endpoint] = sock
            self._monitors[endpoint] = mon
            self.loop.add_reader(sock, self._on_readable)
            self.loop.add_reader(mon, lambda m, ep=endpoint: self._on_link_event(ep, m))
        return sock

    def _on_link_event(self, endpoint: str, mon: zmq.Socket) -> None:
        for frames in frames_ready(mon):
            event = parse_monitor_message([f.bytes for f in frames])["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._up = self._up | {endpoint}
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_MONITOR_STOPPED):
                self._up = self._up - {endpoint}

    def _close_dealer(self, endpoint: str) -> None:
        sock = self._dealers.pop(endpoint, None)
        mon = self._monitors.pop(endpoint, None)
        if sock is not None and mon is not None:
            # The monitor goes before its reader. libzmq sends monitor events with a blocking
            # send while holding the socket's monitor lock: an event after the reading PAIR is
            # closed (a peer's disconnect, common when a cluster stops) blocks libzmq's I/O
            # thread for good, and disable_monitor then waits for that lock forever, holding
            # the GIL: a node stuck at stop (2 of 16 six-node stops on loopback).
            sock.disable_monitor()
        if mon is not None:
            self.loop.remove_reader(mon, close=True)
        if sock is not None:
            self.loop.remove_reader(sock, close=True)
        self._up = self._up - {endpoint}

    def _close_dealers(self) -> None:
        for endpoint in list(self._dealers):
            self._close_dealer(endpoint)

    def _close(self) -> None:
        self._closed = True
        cancelled = {call.endpoint for call in self._calls.all()}
        for call in self._calls.all():
            self._cancel(call)
        for endpoint in list(self._dealers):
            if endpoint in cancelled:  # let the cancels go out after the socket is closed
                self._dealers[endpoint].setsockopt(zmq.LINGER, CANCEL_LINGER_MS)
            self._close_dealer(endpoint)

    def _start(self, call: Call, frames: list, timeout: float | None) -> None:
        if self._closed:
            self._finish(call, PeerUnavailable("the stream client is closed"))
            return
        refused = send_request(self._dealer(call.endpoint), frames, call.endpoint)
        if refused is not None:
            self._finish(call, refused)
            return
        self.sent += 1
        self._calls.add(call)
        if timeout is not None:
            call.timer = self.loop.call_later(timeout, lambda: self._expire(call, timeout))

    def _finish(self, call: Call, item: Message | BusError) -> None:
        if not self._calls.finish(call):
            return
        if call.timer is not None:
            call.timer.cancel()
        call._deliver(item)

    def _expire(self, call: Call, timeout: float) -> None:
        self._finish(call, RequestTimeout(f"request {call.rid} to {call.endpoint}: {timeout}s"))

    def _cancel(self, call: Call) -> None:
        if call.done:
            return
        send_cancel(self._dealers.get(call.endpoint), self.sender, call.rid)
        self._finish(call, RequestCancelled(f"request {call.rid} cancelled"))

    def _release(self, endpoint: str) -> None:
        if endpoint in self._dealers and not self._calls.on(endpoint):
            self._close_dealer(endpoint)

    def _forget(self, endpoint: str) -> None:
        calls = self._calls.on(endpoint)
        keep = [c for c in calls if c.streaming] if endpoint in self._up else []
        if keep:
            log.debug("%s: keeping the connection, %d call(s) mid-stream on it", endpoint,
                      len(keep))
        else:
            self._close_dealer(endpoint)
        for call in calls:
            if call not in keep:
                self._finish(call, PeerUnavailable(f"{endpoint} was forgotten"))

    def _on_readable(self, sock: zmq.Socket) -> None:
        for frames in frames_ready(sock):
            try:
                msg = decode(frames, self.limits)
            except CodecError as exc:
                self.dropped += 1
                log.debug("dropped malformed reply: %s", exc)
                continue
            if msg.rid == PROBE_RID:
                continue  # a server checking that we are still connected
            call = self._calls.get(msg.rid)
            if call is None:
                self.late += 1
                continue
            if streams(msg):
                call.streaming = True
                call._deliver(msg)
            else:
                self._finish(call, msg)


# -- server side ---------------------------------------------------------------------------


class Request:
    """A request received by a StreamServer. `reply()` and `fail()` are thread-safe."""

    def __init__(self, server: StreamServer, peer: bytes, message: Message) -> None:
        self.server = server
        self.peer = peer
        self.message = message
        self.rid = message.rid
        self._cancelled: threading.Event | None = None  # made on first use: most never are
        self.finished = False
        self.dropped = False  # the server dropped it (and answered): later replies go nowhere
        self._cancel_callbacks: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> threading.Event:
        """Set when the client cancels (or the server forgets the peer); thread-safe."""
        if self._cancelled is None:
            with self.server.cancel_lock:
                if self._cancelled is None:
                    self._cancelled = threading.Event()
        return self._cancelled

    def reply(self, msg: Message, more: bool = False) -> None:
        """Send a reply; `more=True` means further replies follow. A request the server
        dropped was answered already: replies still under way from its worker are discarded."""
        if self.dropped:
            return
        if self.finished:
            raise RuntimeError(f"request {self.rid} already answered")
        msg.rid = self.rid
        msg.more = more
        if not msg.sender:
            msg.sender = self.server.sender
        if not msg.session:
            msg.session = self.message.session
        if not more:
            self.finished = True
        frames = encode(msg, self.server.limits)
        self.server.send(self.peer, frames, self if not more else None)

    def fail(self, code: str, message: str) -> None:
        self.reply(ErrorReply(code, message).to_message())

    def on_cancel(self, fn: Callable[[], None]) -> None:
        """Run `fn()` (on the I/O thread) if the client cancels."""
        self._cancel_callbacks.append(fn)

    def _cancel(self) -> None:
        self.cancelled.set()
        for fn in self._cancel_callbacks:
            fn()


RequestHandler = Callable[[Request], None]


class StreamServer:
    """A ROUTER that hands each decoded request to `handler` on the I/O thread.

    The handler must return quickly: long work belongs on a worker thread that answers with
    `request.reply()`. Malformed input is answered with a typed `error` when it can be routed
    back, and counted in `dropped` either way; the server keeps serving.
    """

    def __init__(self, loop: IOLoop, factory: SocketFactory, handler: RequestHandler,
                 bind_endpoint: str = "tcp://127.0.0.1:0", sender: str = "",
                 limits: Limits = DEFAULT_LIMITS) -> None:
        self.loop = loop
        self.handler = handler
        self.sender = sender
        self.limits = limits
        self._inflight: dict[tuple[bytes, int], Request] = {}
        self.cancel_lock = threading.Lock()  # guards lazy creation of Request.cancelled
        self.received = 0
        self.dropped = 0
        self.handler_errors = 0
        self._router: zmq.Socket | None = None
        self.endpoint: str = loop.run_sync(lambda: self._open(factory, bind_endpoint))

    def _open(self, factory: SocketFactory, bind_endpoint: str) -> str:
        self._router = factory.router()
        endpoint = bind(self._router, bind_endpoint)
        self.loop.add_reader(self._router, self._on_readable)
        return endpoint

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def send(self, peer: bytes, frames: list, finished: Request | None = None) -> None:
        """Send frames to a peer (thread-safe); `finished` is dropped from the in-flight set."""
        if self.loop.in_loop():
            self._send(peer, frames, finished)
        else:
            self.loop.call_soon(lambda: self._send(peer, frames, finished))

    def _send(self, peer: bytes, frames: list, finished: Request | None) -> None:
        if finished is not None:
            self._inflight.pop((peer, finished.rid), None)
        try:
            send_frames(self._router, [peer, *frames])
        except zmq.ZMQError as exc:
            log.debug("reply to %r dropped: %s", peer, exc)

    def _on_readable(self, sock: zmq.Socket) -> None:
        for frames in frames_ready(sock):
            self._on_frames(frames)

    def _on_frames(self, frames: list) -> None:
        peer = frames[0].bytes
        try:
            msg = decode(frames[1:], self.limits)
        except CodecError as exc:
            self.dropped += 1
            self._reject(peer, frames[1:], exc)
            return
        self.received += 1
        if msg.type == "cancel":
            req = self._inflight.pop((peer, msg.rid), None)
            if req is not None:
                req._cancel()
            return
        req = Request(self, peer, msg)
        self._inflight[(peer, msg.rid)] = req
        try:
            self.handler(req)
        except Exception as exc:  # noqa: BLE001 - a handler bug answers one request, not all
            self.handler_errors += 1
            log.exception("handler failed on %s", msg.type)
            if not req.finished:
                req.fail("internal", f"{type(exc).__name__}: {exc}"[:200])

    def _reject(self, peer: bytes, frames: list, exc: CodecError) -> None:
        """Answer a malformed request with a typed error, routed by whatever rid we can read."""
        rid = 0
        if frames:
            try:
                rid = int(decode_header(frames[0], self.limits).get("rid", 0))
            except CodecError:
                rid = 0
        reply = ErrorReply(exc.code, str(exc)[:300]).to_message(sender=self.sender, rid=rid)
        self._send(peer, encode(reply, self.limits), None)

    def requests_from(self, sender: str) -> list[Request]:
        """In-flight requests whose message names `sender` (loop thread only)."""
        return [r for r in self._inflight.values() if r.message.sender == sender]

    def drop(self, req: Request, code: str = "dropped", why: str = "") -> None:
        """Forget one in-flight request, answer it with an `error` (`code`, `why`) so that a
        client still listening learns its stream ended, and cancel its work (loop thread).
        Every drop answers: a stream that just stops would leave its client waiting forever."""
        if self._inflight.pop((req.peer, req.rid), None) is None:
            return
        if not req.finished:
            req.finished = req.dropped = True
            reply = ErrorReply(code, why or "the server dropped this request").to_message(
                sender=self.sender, rid=req.rid, session=req.message.session)
            self._send(req.peer, encode(reply, self.limits), None)
        req._cancel()

    def requests(self, type_: str) -> list[Request]:
        """In-flight requests of one message type (loop thread only)."""
        return [r for r in self._inflight.values() if r.message.type == type_]

    def peer_connected(self, peer: bytes) -> bool:
        """Whether the ROUTER still has a connection to `peer` (loop thread only).

        Sends a tiny `pong` with rid 0 (clients ignore it) with ROUTER_MANDATORY on: libzmq
        refuses it (EHOSTUNREACH) when no connection carries that routing id. A stalled peer
        keeps its TCP connection, so it counts as connected; a killed one does not.
        """
        probe = encode(Pong(payload="").to_message(sender=self.sender, rid=PROBE_RID), self.limits)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            send_frames(self._router, [peer, *probe])
        except zmq.ZMQError as exc:
            return exc.errno != errno.EHOSTUNREACH  # a full queue (EAGAIN) is still a peer
        finally:
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        return True

    def forget_peer(self, peer: bytes) -> list[Request]:
        """Drop (and cancel) every in-flight request of a peer; loop thread only."""
        gone = [r for (p, _), r in self._inflight.items() if p == peer]
        for r in gone:
            self._inflight.pop((peer, r.rid), None)
            r._cancel()
        return gone


def serve_ping(req: Request) -> bool:
    """Answer a `ping` with a `pong`; returns False for any other type (handler helper)."""
    if req.message.type != "ping":
        return False
    req.reply(Pong(payload=req.message.get("payload", "")).to_message())
    return True


__all__: list[Any] = [
    "BusError", "Call", "PeerUnavailable", "RemoteError", "Request", "RequestCancelled",
    "RequestTimeout", "StreamClient", "StreamServer", "serve_ping",
]
