"""What both request clients do on a DEALER socket: send a request, send a cancel.

`StreamClient` (bus/streams.py) and `DirectClient` (bus/direct.py) differ in which thread owns
the socket, not in what a refused send means or how a cancel is told to the server; the
bookkeeping of the calls themselves is `bus/calls.py`. Each function runs on the socket's
owner thread.
"""

from __future__ import annotations

import zmq

from bus.calls import PeerUnavailable
from bus.loop import send_frames
from codec.messages import encode
from codec.structs import Cancel


def send_request(sock: zmq.Socket, frames: list, endpoint: str) -> PeerUnavailable | None:
    """Send a request's frames; None when sent, else the error that finishes its call (the
    socket's queue is full, or it refused the send)."""
    try:
        send_frames(sock, frames)
    except zmq.Again:
        return PeerUnavailable(f"{endpoint} is not reachable now")
    except zmq.ZMQError as exc:
        return PeerUnavailable(f"{endpoint}: {exc}")
    return None


def send_cancel(sock: zmq.Socket | None, sender: str, rid: int) -> None:
    """Tell the server to stop request `rid`, if the connection is still open; best effort (a
    refused send is ignored: the server times the request out on its own)."""
    if sock is None:
        return
    try:
        send_frames(sock, encode(Cancel().to_message(sender=sender, rid=rid)))
    except zmq.ZMQError:
        pass
