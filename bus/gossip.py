"""The gossip channel: one PUB socket we publish on, one SUB socket connected to every peer.

Frames on the wire: `[topic] [header] [tensor]...`; SUB filters by topic prefix. Handlers run
on the I/O thread; malformed messages are counted and dropped, never raised.

With a cluster secret (the factory's `Security`) every message carries an authenticator frame
after the topic: `[topic] [auth] [header] [tensor]...`, auth = epoch (u64) | seq (u64) |
HMAC-SHA256 over epoch, seq and every other frame (length-prefixed). The epoch is the
publisher's start time in ns, the seq counts its messages; receivers keep the last
(epoch, seq) per sender id (the header's `from`, covered by the MAC) and drop a message that
does not move it forward (`replayed`) or whose MAC is wrong (`forged`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import zmq

from bus.loop import IOLoop, frames_ready, send_frames
from bus.sockets import SocketFactory, bind, close_socket
from codec.errors import CodecError
from codec.messages import DEFAULT_LIMITS, Limits, Message, decode, encode

log = logging.getLogger(__name__)

GossipHandler = Callable[[str, Message], None]

_AUTH = struct.Struct(">QQ")
AUTH_BYTES = _AUTH.size + hashlib.sha256().digest_size
MAX_SENDERS = 4096  # replay state kept for at most this many publishers (oldest forgotten)
#: gossip messages buffered per connected publisher before libzmq stops reading it (`gossip_sub`)
GOSSIP_RCVHWM = 256


def gossip_sub(factory: SocketFactory, limits: Limits = DEFAULT_LIMITS) -> zmq.Socket:
    """The SUB socket gossip is read from: the factory's, with bounded input per publisher.

    Why: every other socket has no receive HWM (bus/sockets.py: libzmq #3937 aborts an engine
    whose input stopped at the HWM, whose peer hung up, at its next ZMTP heartbeat), so input
    never stops and what a peer sends faster than the I/O thread reads is held in memory. One
    member publishing 1 GiB of suffix publications as fast as loopback carries them took a
    suffix proposer, which reads gossip on a core it shares with its indexer, to 650-850 MB
    resident (`specbus bench flood`). Gossip is lossy by design (a PUB drops at its own HWM
    too; membership and stats repeat themselves), so here each publisher's connection holds at
    most `GOSSIP_RCVHWM` messages: past that libzmq stops reading that connection, TCP pushes
    back, and the publisher's PUB drops what it sends to this node. Other members' connections
    are separate pipes and are not held up.

    The abort needs an out_event on the stopped engine after the hang-up. Its two sources on a
    SUB: this socket's own heartbeat timer, which is off here (ZMTP heartbeats only told a
    subscriber that a publisher's connection died, which TCP keepalive, reconnection and
    membership already do), and a PING from the peer still in the engine's read buffer when
    input restarts. `tests/bus/test_gossip_flood.py` floods and hangs up round after round
    with heartbeating publishers and checks that the process lives and its memory stays
    bounded. A frame is at most a header (no gossip message carries a larger tensor: a suffix
    publication's 32 KiB is the largest), so `MAXMSGSIZE` drops a peer that sends more."""
    sock = factory.sub()
    sock.setsockopt(zmq.RCVHWM, GOSSIP_RCVHWM)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_header_bytes)
    return sock


def gossip_mac(key: bytes, prefix: bytes, frames: Sequence) -> bytes:
    """HMAC-SHA256 of an auth prefix and length-prefixed frames (bytes or buffers)."""
    mac = hmac.new(key, prefix, hashlib.sha256)
    for f in frames:
        buf = memoryview(getattr(f, "buffer", f)).cast("B")
        mac.update(len(buf).to_bytes(8, "big"))
        mac.update(buf)
    return mac.digest()


def auth_frame(key: bytes, epoch: int, seq: int, frames: Sequence) -> bytes:
    """The authenticator frame for `frames` (topic, header, tensors) from (epoch, seq)."""
    prefix = _AUTH.pack(epoch, seq)
    return prefix + gossip_mac(key, prefix, frames)


class ReplayGuard:
    """Per-sender last (epoch, seq): accept a message only if it moves strictly forward."""

    def __init__(self, max_senders: int = MAX_SENDERS) -> None:
        self._last: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._max = max_senders

    def accept(self, sender: str, epoch: int, seq: int) -> bool:
        last = self._last.get(sender)
        if last is not None and (epoch, seq) <= last:
            return False
        self._last[sender] = (epoch, seq)
        self._last.move_to_end(sender)
        if len(self._last) > self._max:
            self._last.popitem(last=False)
        return True


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
        self.forged = 0  # secured: MAC missing or wrong
        self.replayed = 0  # secured: (epoch, seq) not newer than the sender's last
        security = getattr(factory, "security", None)
        self._key: bytes | None = security.gossip_key if security is not None else None
        self._epoch = time.time_ns()
        self._seq = 0
        self._guard = ReplayGuard()
        self._pub: zmq.Socket | None = None
        self._sub: zmq.Socket | None = None
        self.endpoint: str = loop.run_sync(lambda: self._open(factory, bind_endpoint))

    def _open(self, factory: SocketFactory, bind_endpoint: str) -> str:
        self._pub = factory.pub()
        endpoint = bind(self._pub, bind_endpoint)
        self._sub = gossip_sub(factory, self.limits)
        self.loop.add_reader(self._sub, self._on_readable)
        self.loop.on_close(lambda: close_socket(self._pub))
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
        if self._key is not None:
            self._seq += 1
            frames = [frames[0], auth_frame(self._key, self._epoch, self._seq, frames),
                      *frames[1:]]
        try:
            send_frames(self._pub, frames)
        except zmq.Again:
            return  # PUB drops at the high-water mark anyway
        self.published += 1
        self.bytes_out += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)

    def _on_readable(self, sock: zmq.Socket) -> None:
        for frames in frames_ready(sock):
            self.bytes_in += sum(len(f) for f in frames)
            auth = None
            if self._key is not None:
                auth = self._verify(frames)
                if auth is None:
                    self.forged += 1
                    continue
                frames = [frames[0], *frames[2:]]
            try:
                topic = bytes(frames[0].buffer).decode("utf-8")
                msg = decode(frames[1:], self.limits)
            except (CodecError, UnicodeDecodeError) as exc:
                self.dropped += 1
                log.debug("dropped malformed gossip: %s", exc)
                continue
            if auth is not None and not self._guard.accept(msg.sender, *auth):
                self.replayed += 1
                log.debug("dropped a replayed gossip %s from %r", msg.type, msg.sender)
                continue
            self.received += 1
            self._on_message(topic, msg)

    def _verify(self, frames: list) -> tuple[int, int] | None:
        """(epoch, seq) of a message whose MAC checks out, else None."""
        if len(frames) < 3 or len(frames[1]) != AUTH_BYTES:
            return None
        auth = bytes(frames[1].buffer)
        prefix, tag = auth[:_AUTH.size], auth[_AUTH.size:]
        want = gossip_mac(self._key, prefix, [frames[0], *frames[2:]])
        if not hmac.compare_digest(tag, want):
            return None
        return _AUTH.unpack(prefix)
