"""The gossip channel: one PUB socket we publish on, one SUB socket connected to every peer.

Frames on the wire: `[topic] [header] [tensor]...`; SUB filters by topic prefix. Handlers run
on the I/O thread; malformed messages are counted and dropped, never raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from bus.loop import IOLoop, frames_ready, send_frames
from bus.sockets import SocketFactory, bind
from codec.errors import CodecError
from codec.messages import DEFAULT_LIMITS, Limits, Message, decode, encode

log = logging.getLogger(__name__)

GossipHandler = Callable[[str, Message], None]


class GossipChannel:
    """Publish to all subscribers; receive from every connected peer's PUB."""

    def __init__(
        self,
        loop: IOLoop,
        factory: SocketFactory,
        on_message: GossipHandler,
        bind_endpoint: str = "tcp://127.0.0.1:0",
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.loop = loop
        self.limits = limits
        self._on_message = on_message
        self._connected: set[str] = set()
        self.received = 0
        self.dropped = 0
        self.published = 0
        self.bytes_out = 0
        self.bytes_in = 0
        self._pub: zmq.Socket | None = None
        self._sub: zmq.Socket | None = None
        self.endpoint: str = loop.run_sync(lambda: self._open(factory, bind_endpoint))

    def _open(self, factory: SocketFactory, bind_endpoint: str) -> str:
        self._pub = factory.pub()
        endpoint = bind(self._pub, bind_endpoint)
        self._sub = factory.sub()
        self.loop.add_reader(self._sub, self._on_readable)
        self.loop.on_close(lambda: self._pub.close(linger=0))
        return endpoint

    # -- thread-safe API --------------------------------------------------------------------
    def subscribe(self, topic_prefix: str) -> None:
        self.loop.call_soon(lambda: self._sub.setsockopt_string(zmq.SUBSCRIBE, topic_prefix))

    def connect(self, endpoint: str) -> None:
        """Subscribe to a peer's PUB endpoint (idempotent)."""
        self.loop.call_soon(lambda: self._connect(endpoint))

    def disconnect(self, endpoint: str) -> None:
        self.loop.call_soon(lambda: self._disconnect(endpoint))

    def publish(self, topic: str, msg: Message) -> None:
        """Encode now (in the caller's thread, so errors surface here) and send from the loop."""
        frames = [topic.encode(), *encode(msg, self.limits)]
        self.loop.call_soon(lambda: self._send(frames))

    @property
    def peers(self) -> set[str]:
        return set(self._connected)

    # -- loop thread ------------------------------------------------------------------------
    def _connect(self, endpoint: str) -> None:
        if endpoint in self._connected:
            return
        self._sub.connect(endpoint)
        self._connected.add(endpoint)

    def _disconnect(self, endpoint: str) -> None:
        if endpoint in self._connected:
            self._connected.discard(endpoint)
            try:
                self._sub.disconnect(endpoint)
            except zmq.ZMQError as exc:
                log.debug("disconnect %s: %s", endpoint, exc)

    def _send(self, frames: list) -> None:
        try:
            send_frames(self._pub, frames)
        except zmq.Again:
            return  # PUB drops at the high-water mark anyway
        self.published += 1
        self.bytes_out += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)

    def _on_readable(self, sock: zmq.Socket) -> None:
        for frames in frames_ready(sock):
            self.bytes_in += sum(len(f) for f in frames)
            try:
                topic = bytes(frames[0].buffer).decode("utf-8")
                msg = decode(frames[1:], self.limits)
            except (CodecError, UnicodeDecodeError) as exc:
                self.dropped += 1
                log.debug("dropped malformed gossip: %s", exc)
                continue
            self.received += 1
            self._on_message(topic, msg)
