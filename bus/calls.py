"""The call table both request clients drive: request ids, the calls in flight, how a reply
finds its call, when a call is finished, and the errors a call ends with.

Why one table: `StreamClient` (bus/streams.py; sockets on the I/O thread, deadlines on loop
timers) and `DirectClient` (bus/direct.py; sockets on the caller's thread, deadlines checked
when it waits) differ in who owns the sockets and who keeps time, not in what a call is. The
bookkeeping they share lives here, I/O-free (no sockets, threads or clocks), so the two cannot
drift apart: a reply with `more=True` (not an `error`) streams, any other reply finishes the
call, a finished call takes nothing more, a reply for no call in flight is late.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, Protocol

from codec.messages import Message


class BusError(Exception):
    """A request did not get a normal reply."""


class RequestTimeout(BusError):
    """The deadline passed before the final reply."""


class RequestCancelled(BusError):
    """The caller cancelled the request."""


class PeerUnavailable(BusError):
    """The peer is not connected, its queue is full, or it was forgotten."""


class RemoteError(BusError):
    """The peer answered with an `error` message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class BadReply(BusError):
    """The peer answered this request with a malformed message (a codec error)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


#: what a call hands its reader: a reply, or the error it ended with
Reply = Message | BusError


def unwrap(item: Reply) -> Message:
    """A reply as the reader gets it: an error raised, an `error` message as RemoteError."""
    if isinstance(item, BusError):
        raise item
    if item.type == "error":
        raise RemoteError(str(item.get("code")), str(item.get("message")))
    return item


def streams(msg: Message) -> bool:
    """Whether `msg` is a streamed (not final) reply: more follow, and it is not an error."""
    return bool(msg.more) and msg.type != "error"


class _Call(Protocol):
    rid: int
    endpoint: str
    done: bool


class Replies:
    """A call's reading side, on top of its `next()`: every reply until the final one, or
    the final one alone."""

    __slots__ = ()  # a call class with slots keeps them

    def next(self, timeout: float | None = None) -> Message:
        raise NotImplementedError

    def replies(self, timeout: float | None = None) -> Iterator[Message]:
        """Every reply until the final one (each waited for at most `timeout`)."""
        while True:
            msg = self.next(timeout)
            yield msg
            if not msg.more:
                return

    def result(self, timeout: float | None = None) -> Message:
        """The final reply (earlier streamed replies are discarded)."""
        while True:
            msg = self.next(timeout)
            if not msg.more:
                return msg


class CallTable:
    """Request ids (from 1: 0 is a server's liveness probe) and the calls in flight by id.
    Not thread-safe: each client uses it from the one thread that owns its calls (a
    `StreamClient` draws ids under its own lock)."""

    def __init__(self) -> None:
        self._rids = itertools.count(1)
        #: rid -> call, for calls sent and not finished
        self.pending: dict[int, Any] = {}

    def next_rid(self) -> int:
        return next(self._rids)

    def add(self, call: _Call) -> None:
        """`call` was sent: replies naming its rid are its own until it finishes."""
        self.pending[call.rid] = call

    def get(self, rid: int) -> Any:
        """The call in flight with this rid, or None (a reply to it is late)."""
        return self.pending.get(rid)

    def finish(self, call: _Call) -> bool:
        """Mark `call` finished and out of the table; False when it already was (its final
        item was delivered: nothing more goes to it)."""
        if call.done:
            return False
        call.done = True
        self.pending.pop(call.rid, None)
        return True

    def on(self, endpoint: str) -> list[Any]:
        """The calls in flight to `endpoint`."""
        return [c for c in self.pending.values() if c.endpoint == endpoint]

    def all(self) -> list[Any]:
        return list(self.pending.values())

    def __len__(self) -> int:
        return len(self.pending)
